"""--save-retain N: after a checkpoint is published, delete this run's checkpoints beyond its newest N."""
from __future__ import annotations

import os
import shutil
from typing import Callable, Iterable, List, Optional

from .format import iteration_dir_name, read_tracker


def prune_checkpoints(save_dir: str, keep: int, own: Iterable[int],
                      log: Optional[Callable[[str], None]] = None) -> List[int]:
    """Remove the oldest of `own` (the iterations this run wrote or resumed from, see ownership.py)
    beyond the newest `keep`; the tracker's iteration and other runs' checkpoints are never removed.
    Returns the removed iterations. Call on one rank, after the publish."""
    if keep < 1:
        raise ValueError("--save-retain must be >= 1")
    iters = sorted(set(own))
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
