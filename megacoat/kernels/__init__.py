"""Python entry points to fast kernels (Triton, CUDA C++). Each has a plain-PyTorch reference with
the same signature, chosen automatically when the kernel cannot run (CPU, missing build)."""

import os
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton kernels can run here (Triton importable, not disabled with MEGACOAT_NO_TRITON=1).
    Devices are checked by the callers."""
    if os.environ.get("MEGACOAT_NO_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


class TraceableKernels:
    """A Triton kernel module whose kernels launch through `torch.library.wrap_triton`: inside a
    `torch.library.triton_op` that torch.compile traces, inductor then launches them from its own
    generated code (no Python op dispatch, no Triton launcher in Python per call: the FP8 ops were
    host-bound at 1.36B, 156 us of host time per cast). In eager code the wrapper just launches."""

    def __init__(self, module):
        self._module = module
        self._wrap = getattr(torch.library, "wrap_triton", None)  # torch >= 2.6

    def __getattr__(self, name):
        kernel = getattr(self._module, name)
        return self._wrap(kernel) if self._wrap is not None else kernel
