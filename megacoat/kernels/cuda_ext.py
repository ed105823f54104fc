"""Loading the optional CUDA C++ extensions of `csrc/`.

An extension is used from the installed package when `setup.py` built it (`megacoat._<name>`);
otherwise it is compiled on first use with `torch.utils.cpp_extension.load` where nvcc and a CUDA
build of torch exist, for this GPU only, and cached by torch (under ~/.cache/torch_extensions or
$TORCH_EXTENSIONS_DIR). A compilation says so before and after (it takes a while: the message gives
an estimate). When neither works the caller runs its torch reference, after one warning that says
how to get the kernel. A missing build is never an error.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import os
import sys
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
# No --use_fast_math: the kernels repeat their torch references' fp32 operations bit for bit (it would swap
# divisions, square roots and powf for approximations and flush denormals). .cpp sources (the torch
# bindings, the cuBLASLt GEMM) go to the host compiler with CXX_FLAGS.
NVCC_FLAGS = ["-O3", "-std=c++17"]
CXX_FLAGS = ["-O3"]


@dataclass(frozen=True)
class Extension:
    sources: Tuple[str, ...]  # inside csrc/, compiled in parallel (torch's ninja; MAX_JOBS caps it)
    about_s: int  # how long its first-use build takes, for the announcement (benchmarks/cuda_build_time.py)
    libraries: Tuple[str, ...] = ()  # CUDA libraries to link, found in the toolkit's lib64


# The extensions, `megacoat._<name>` (setup.py builds the same sources). Each has its kernels in .cu files that
# include no torch header and its torch binding in a .cpp file with the few torch headers it needs: parsing
# torch's headers, once per nvcc pass, was most of the build. The slowest file of each compiles in 7-12 s of
# one core (sm_90a, benchmarks/cuda_build_time.py measures the whole build).
EXTENSIONS = {
    "fused_adamw": Extension(("fused_adamw.cu", "fused_adamw_binding.cpp"), about_s=10),
    "sdp4bit": Extension(("sdp4bit_encode.cu", "sdp4bit_requantize.cu", "sdp4bit_binding.cpp"), about_s=10),
    "fp8_gemm": Extension(("fp8_gemm.cpp",), about_s=15, libraries=("cublasLt",)),
}

# torch's JIT build holds `<build dir>/lock` while it compiles; a build killed meanwhile (a timeout, Ctrl-C) leaves
# it behind, and every later load then waits for it forever, silently (three runs on an H200 printed nothing for
# minutes). Our kernels build in well under a minute; a lock this old is taken to be such a leftover
# (torch never refreshes its mtime, so a genuine build slower than this would lose it).
STALE_BUILD_LOCK_S = 1800
_clock = time.monotonic  # for the build's duration


def build_directory(name: str) -> str:
    """Where torch's JIT build of extension `megacoat_<name>` lives ($TORCH_EXTENSIONS_DIR/<name>, else torch's
    default root plus its per-Python, per-CUDA folder): torch's own answer."""
    from torch.utils import cpp_extension
    return cpp_extension._get_build_directory(f"megacoat_{name}", False)


@contextlib.contextmanager
def _exclusive(path: str):
    """An exclusive advisory lock on `path` (created if needed) for the block; a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_if_stale(lock: str, clock) -> Optional[float]:
    """Remove `lock` if it is (still) older than STALE_BUILD_LOCK_S; returns its age then, else None. Checked and
    removed under a second lock, so that of several processes finding the same stale lock (ranks of a node, jobs
    sharing the cache) only the first removes it: the others then see the fresh lock of its build and wait."""
    with _exclusive(lock + ".guard"):
        try:
            age = clock() - os.path.getmtime(lock)
        except OSError:
            return None  # gone meanwhile
        if age <= STALE_BUILD_LOCK_S:
            return None  # a new build's lock
        try:
            os.remove(lock)
        except FileNotFoundError:
            pass
        return age


def wait_for_build_lock(build_dir: str, clock=time.time, sleep=time.sleep, poll_s: float = 5.0) -> Optional[str]:
    """Before torch's build: if `<build_dir>/lock` exists, wait while it is younger than STALE_BUILD_LOCK_S (another
    process is building; it removes the lock when done), then remove it as a killed build's leftover. Says what it
    does (one warning each). Returns the last message, or None when there was no lock. Raises OSError when the
    lock cannot be removed (the caller then runs the reference)."""
    lock = os.path.join(build_dir, "lock")
    said = None
    while True:
        try:
            age = clock() - os.path.getmtime(lock)
        except OSError:
            return said  # no lock (any more): torch takes it from here
        if age > STALE_BUILD_LOCK_S:
            removed = _remove_if_stale(lock, clock)
            if removed is not None:
                said = (f"megacoat: removed the CUDA extension build lock {lock}, {removed / 60:.0f} minutes old: a "
                        "build was killed while holding it (torch would have waited for it forever)")
                warnings.warn(said, stacklevel=3)
                return said
            continue  # another process removed it first: look again
        if said is None:
            said = (f"megacoat: waiting for the CUDA extension build lock {lock} ({age:.0f} s old): another process is "
                    f"building this kernel. If none is, a killed build left it: delete the file, or megacoat removes "
                    f"it once it is {STALE_BUILD_LOCK_S // 60} minutes old")
            warnings.warn(said, stacklevel=3)
        sleep(poll_s)


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available() and torch.version.cuda is not None


def arch_flags(capability) -> List[str]:
    """nvcc's target for a GPU of compute capability (major, minor): its machine code only. No PTX for other
    GPUs: a first-use build is for the GPU at hand, and every further target is another full device
    compilation. Hopper gets sm_90a (its architecture-specific instructions allowed)."""
    arch = "%d%d" % tuple(capability) + ("a" if tuple(capability) == (9, 0) else "")
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _cached_build_is_current(name: str, paths: Sequence[str]) -> bool:
    """Whether torch's cache already holds this extension built after its sources (and csrc's headers) last
    changed: then loading it compiles nothing. (torch decides itself; this only chooses whether to announce a
    compilation.)"""
    try:
        built = os.path.getmtime(os.path.join(build_directory(name), f"megacoat_{name}.so"))
        inputs = list(paths) + glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "*.cuh"))
        return built >= max(os.path.getmtime(p) for p in inputs)
    except OSError:
        return False


def installed_build(name: str) -> Optional[object]:
    """`megacoat._<name>` as setup.py built it, or None."""
    try:
        return importlib.import_module(f"megacoat._{name}")
    except ImportError:
        return None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@lru_cache(maxsize=None)
def load_extension(name: str) -> Optional[object]:
    """The compiled module `megacoat._<name>` (a key of EXTENSIONS), or None (after one warning) if it cannot
    be had. Set MEGACOAT_NO_CUDA_EXT=1 to force the references, MEGACOAT_VERBOSE_BUILD=1 to see the compiler's
    output."""
    ext = EXTENSIONS[name]
    if os.environ.get("MEGACOAT_NO_CUDA_EXT") == "1" or not cuda_available():
        return None
    module = installed_build(name)
    if module is not None:
        return module
    from torch.utils import cpp_extension
    paths = [os.path.join(CSRC, s) for s in ext.sources]
    if not all(os.path.exists(p) for p in paths) or cpp_extension.CUDA_HOME is None:
        warnings.warn(f"megacoat: CUDA kernel '{name}' is not built and nvcc is not available: using the PyTorch "
                      "reference (slower). Install a CUDA toolkit matching torch.version.cuda and reinstall "
                      "(`pip install -e .`) to get it.", stacklevel=2)
        return None
    return _build(name, paths, ext.about_s, ext.libraries)


def _build(name: str, paths: Sequence[str], about_s: int, libraries: Sequence[str]) -> Optional[object]:
    """torch's JIT build of the sources for this GPU, announced when it compiles; None after a warning if it fails."""
    import torch
    from torch.utils import cpp_extension
    t0 = _clock()
    announce = not _cached_build_is_current(name, paths)
    files = ", ".join(os.path.relpath(p, os.path.dirname(CSRC)) for p in paths)
    try:
        build_dir = build_directory(name)
        if announce:
            _say(f"megacoat: compiling CUDA kernels {name} ({files}) for this GPU (first use, about {about_s} s; cached "
                f"in {build_dir})")
        wait_for_build_lock(build_dir)
        module = cpp_extension.load(
            name=f"megacoat_{name}", sources=list(paths), with_cuda=True,
            extra_cuda_cflags=NVCC_FLAGS + arch_flags(torch.cuda.get_device_capability()),
            extra_cflags=CXX_FLAGS, extra_ldflags=[f"-l{lib}" for lib in libraries],
            verbose=os.environ.get("MEGACOAT_VERBOSE_BUILD") == "1")
    except Exception as e:  # noqa: BLE001 - a failed build must leave the reference running
        warnings.warn(f"megacoat: building CUDA kernel '{name}' failed after {_clock() - t0:.0f} s "
                      f"({type(e).__name__}: {str(e)[-500:]}); using the PyTorch reference (slower). Set "
                      "MEGACOAT_VERBOSE_BUILD=1 to see the compiler output.", stacklevel=3)
        return None
    if announce:
        _say(f"megacoat: compiled CUDA kernels {name} in {_clock() - t0:.0f} s")
    return module
