"""Python entry points to fast kernels (Triton, CUDA C++). Each has a plain-PyTorch reference with
the same signature, chosen automatically when the kernel cannot run (CPU, missing build)."""

import os
from functools import lru_cache


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
