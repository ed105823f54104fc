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
import time
import warnings
from functools import lru_cache
from typing import Optional, Sequence

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
NVCC_FLAGS = ["-O3", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a",
              "-gencode=arch=compute_90,code=compute_90", "-std=c++17"]


# torch's JIT build holds `<build dir>/lock` while it compiles; a build killed meanwhile (a timeout, Ctrl-C) leaves
# it behind, and every later load then waits for it forever, silently (seen on the H200, 2026-12-02: three runs
# printed nothing for minutes). Our three kernels build in 2-3 minutes on 16 cores; a lock this old is taken to be
# such a leftover (torch never refreshes its mtime, so a genuine build slower than this would lose it).
STALE_BUILD_LOCK_S = 1800


def build_directory(name: str) -> str:
    """Where torch's JIT build of extension `megacoat_<name>` lives: $TORCH_EXTENSIONS_DIR/<name>, else torch's
    default root plus its per-Python, per-CUDA folder (torch's own `_get_build_directory` where it has one)."""
    from torch.utils import cpp_extension
    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is not None:
        return get(f"megacoat_{name}", False)
    return os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(),
                        f"megacoat_{name}")


def wait_for_build_lock(build_dir: str, clock=time.time, sleep=time.sleep, poll_s: float = 5.0,
                        may_remove: Optional[bool] = None) -> Optional[str]:
    """Before torch's build: if `<build_dir>/lock` exists, wait while it is younger than STALE_BUILD_LOCK_S (another
    process is building; it removes the lock when done), then remove it as a killed build's leftover. Only one
    process per node removes it (`may_remove`, default: LOCAL_RANK 0): two ranks removing the same stale lock
    could delete the lock of the build the first one then starts. Says what it does (one warning each). Returns
    the last message, or None when there was no lock. Raises OSError when the lock cannot be removed (the caller
    then runs the reference)."""
    if may_remove is None:
        may_remove = os.environ.get("LOCAL_RANK", "0") == "0"
    lock = os.path.join(build_dir, "lock")
    said = None
    while True:
        try:
            age = clock() - os.path.getmtime(lock)
        except OSError:
            return said  # no lock (any more): torch takes it from here
        if age > STALE_BUILD_LOCK_S and may_remove:
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
            said = (f"megacoat: removed the CUDA extension build lock {lock}, {age / 60:.0f} minutes old: a build was "
                    "killed while holding it (torch would have waited for it forever)")
            warnings.warn(said, stacklevel=3)
            return said
        if said is None:
            said = (f"megacoat: waiting for the CUDA extension build lock {lock} ({age:.0f} s old): another process is "
                    f"building this kernel. If none is, a killed build left it: delete the file, or megacoat removes "
                    f"it once it is {STALE_BUILD_LOCK_S // 60} minutes old")
            warnings.warn(said, stacklevel=3)
        sleep(poll_s)


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
        wait_for_build_lock(build_directory(name))
        return load(name=f"megacoat_{name}", sources=paths, extra_cuda_cflags=precise_flags() if precise else NVCC_FLAGS,
                    extra_cflags=["-O3"], extra_ldflags=[f"-l{lib}" for lib in libraries],
                    verbose=os.environ.get("MEGACOAT_VERBOSE_BUILD") == "1")
    except Exception as e:  # noqa: BLE001 - a failed build must leave the reference running
        warnings.warn(f"megacoat: building CUDA kernel '{name}' failed ({type(e).__name__}: {str(e)[-500:]}); using "
                      "the PyTorch reference (slower). Set MEGACOAT_VERBOSE_BUILD=1 to see the compiler output.",
                      stacklevel=2)
        return None
