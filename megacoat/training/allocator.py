"""The CUDA caching allocator's settings megacoat runs with."""
from __future__ import annotations

import os
import sys

EXPANDABLE_SEGMENTS = "expandable_segments:True"
# Where torch reads the allocator's settings: the CUDA name overrides the newer generic one when both are set.
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def default_cuda_allocator_settings() -> bool:
    """Turn on expandable segments (segments grow in place, so blocks freed at one size are not stranded for the
    next: a 7B bf16 step at micro-batch 6 ran out of memory on an H200 with 7.5 GiB reserved but unallocated, and ran
    with them; torchtitan's launcher sets the same) unless the user configured the allocator in either variable or
    CUDA already started (the allocator reads its settings once, when CUDA initializes). Returns whether it set them.
    Call it before the first CUDA use: the entry point does, and so does the trainer for library callers."""
    if any(os.environ.get(k) for k in ALLOC_CONF_VARIABLES):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True
