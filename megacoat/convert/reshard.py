"""megacoat -> megacoat: a weights-only copy of a checkpoint, split into files for a target TP."""
from __future__ import annotations

from typing import Optional

import torch

from ..checkpoint.model_io import read_model_tensors, write_model_checkpoint
from .target import check_checkpoint_target, check_target_pp


def megacoat_to_megacoat(load_dir: str, save_dir: str, tp: int = 1, pp: int = 1, dtype: Optional[torch.dtype] = None,
                         force: bool = False) -> str:
    """Iteration 0 of `save_dir`, laid out for TP=`tp` (any layout loads it; `pp` is only checked)."""
    check_checkpoint_target(save_dir, 0, force)
    m, vocab, tensors, meta = read_model_tensors(load_dir)
    check_target_pp(pp, m.num_layers)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    source = (meta.get("extra") or {}).get("source")  # where the weights came from (e.g. Megatron's layer spec)
    return write_model_checkpoint(save_dir, m, vocab, tensors, tp=tp,
                                  extra_files=lambda d: {"source": source} if source else {})
