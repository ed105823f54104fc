"""Loading the optional CUDA C++ extensions of `csrc/`.

An extension is used from the installed package when `setup.py` built it (`megacoat._<name>`);
otherwise it is compiled on first use with `torch.utils.cpp_extension.load` where nvcc and a CUDA
build of torch exist (cached by torch under ~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR).
When neither works the caller runs its torch reference, after one warning that says how to get
the kernel. A missing build is never an error.
"""
from __future__ import annotations

import importlib
import os
import shutil
import warnings
from functools import lru_cache
from typing import Optional, Sequence

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
NVCC_FLAGS = ["-O3", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a",
              "-gencode=arch=compute_90,code=compute_90", "-std=c++17"]


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available() and torch.version.cuda is not None


def precise_flags():
    return [f for f in NVCC_FLAGS if f != "--use_fast_math"]


@lru_cache(maxsize=None)
def load_extension(name: str, sources: Sequence[str], precise: bool = False,
                   libraries: Sequence[str] = ()) -> Optional[object]:
    """The compiled module `megacoat._<name>`, or None (after one warning) if it cannot be had.

    `sources` are file names inside csrc/. Set MEGACOAT_NO_CUDA_EXT=1 to force the references.
    `precise`: build without --use_fast_math (IEEE division/sqrt, accurate powf, denormals kept),
    for kernels that must agree bit for bit with their torch reference. `libraries`: CUDA libraries to link
    (e.g. "cublasLt"), found in the toolkit's lib64.
    """
    if os.environ.get("MEGACOAT_NO_CUDA_EXT") == "1" or not cuda_available():
        return None
    try:
        return importlib.import_module(f"megacoat._{name}")
    except ImportError:
        pass
    paths = [os.path.join(CSRC, s) for s in sources]
    if not all(os.path.exists(p) for p in paths) or shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        warnings.warn(f"megacoat: CUDA kernel '{name}' is not built and nvcc is not available: using the PyTorch "
                      "reference (slower). Install a CUDA toolkit matching torch.version.cuda and reinstall "
                      "(`pip install -e .`) to get it.", stacklevel=2)
        return None
    try:
        from torch.utils.cpp_extension import load
        return load(name=f"megacoat_{name}", sources=paths, extra_cuda_cflags=precise_flags() if precise else NVCC_FLAGS,
                    extra_cflags=["-O3"], extra_ldflags=[f"-l{lib}" for lib in libraries],
                    verbose=os.environ.get("MEGACOAT_VERBOSE_BUILD") == "1")
    except Exception as e:  # noqa: BLE001 - a failed build must leave the reference running
        warnings.warn(f"megacoat: building CUDA kernel '{name}' failed ({type(e).__name__}: {str(e)[-500:]}); using "
                      "the PyTorch reference (slower). Set MEGACOAT_VERBOSE_BUILD=1 to see the compiler output.",
                      stacklevel=2)
        return None
