"""Public Python API."""
from __future__ import annotations

from typing import Optional, Union

import torch

# The weight dtypes by the names the tools' --dtype flags take; load_model also takes torch's own names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {**DTYPES, **{str(d).replace("torch.", ""): d for d in DTYPES.values()}}


def load_model(checkpoint_dir: str, device: str = "cpu",
               dtype: Optional[Union[torch.dtype, str]] = None) -> torch.nn.Module:
    """A single-process model from a megacoat checkpoint, whatever TP/DP it was saved with.

    `checkpoint_dir` is a --save directory (the tracker's iteration is loaded) or one iter_* directory.
    `model(tokens[b, s])` returns logits [b, s, vocab] (padding columns removed). The model is in
    eval mode, in `dtype` (a torch floating dtype or its name, "bf16", "fp32", "fp16"; default: the
    dtype the weights were saved in).
    """
    from .checkpoint.model_io import load_full_model

    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise ValueError(f"load_model: dtype {dtype!r} is not one of {', '.join(sorted(_DTYPE_NAMES))}")
        dtype = _DTYPE_NAMES[dtype.lower()]
    elif dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"load_model: dtype must be a floating torch dtype or its name, not {dtype!r}")
    return load_full_model(checkpoint_dir, device=device, dtype=dtype)
