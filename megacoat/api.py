"""Public Python API."""
from __future__ import annotations

from typing import Optional

import torch


def load_model(checkpoint_dir: str, device: str = "cpu", dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """A single-process model from a megacoat checkpoint, whatever TP/DP it was saved with.

    `checkpoint_dir` is a --save directory (the tracker's iteration is loaded) or one iter_* directory.
    `model(tokens[b, s])` returns logits [b, s, vocab] (padding columns removed). The model is in
    eval mode, in `dtype` (default: the dtype the weights were saved in).
    """
    from .checkpoint.model_io import load_full_model

    return load_full_model(checkpoint_dir, device=device, dtype=dtype)
