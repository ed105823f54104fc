"""--save-retain N: after a checkpoint is published, delete all but the newest N iter_* directories."""
from __future__ import annotations

import os
import re
import shutil
from typing import Callable, List, Optional

from .format import iteration_dir_name, read_tracker

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def prune_checkpoints(save_dir: str, keep: int, log: Optional[Callable[[str], None]] = None) -> List[int]:
    """Remove the oldest complete checkpoints beyond the newest `keep`; the tracker's iteration is
    never removed. Returns the removed iterations. Call on one rank, after the publish."""
    if keep < 1:
        raise ValueError("--save-retain must be >= 1")
    iters = sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(save_dir)) if m)
    latest = read_tracker(save_dir)
    removed = []
    for it in iters[:-keep] if len(iters) > keep else []:
        if it == latest:
            continue
        shutil.rmtree(os.path.join(save_dir, iteration_dir_name(it)), ignore_errors=True)
        removed.append(it)
    if removed and log is not None:
        log(f"--save-retain {keep}: removed checkpoint(s) of iteration {', '.join(map(str, removed))}")
    return removed
