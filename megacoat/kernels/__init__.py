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


def _traced(args) -> bool:
    """The launch is being traced (dynamo, or inductor decomposing a triton_op with fake/functional
    tensors), as opposed to running on real tensors."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) for a in args)


class _Launcher:
    """`kernel[grid](*args)`: through `wrap_triton` only while traced. On real tensors the plain Triton
    launch: the wrapper's eager path dispatches a higher-order op per launch (~0.3 ms of host time,
    which made every eager FP8 kernel host-bound, 2-12x slower than its GPU time)."""

    def __init__(self, kernel, wrap):
        self._kernel, self._wrap, self._wrapped = kernel, wrap, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self._wrap is not None and _traced(args):
                if self._wrapped is None:
                    self._wrapped = self._wrap(self._kernel)
                return self._wrapped[grid](*args, **kwargs)
            return self._kernel[grid](*args, **kwargs)
        return launch


class TraceableKernels:
    """A Triton kernel module whose kernels launch through `torch.library.wrap_triton` when traced:
    inside a `torch.library.triton_op` that torch.compile traces, inductor then launches them from its
    own generated code (no Python op dispatch, no Triton launcher in Python per call: the FP8 ops were
    host-bound at 1.36B, 156 us of host time per cast). On real tensors they launch directly."""

    def __init__(self, module):
        self._module = module
        self._wrap = getattr(torch.library, "wrap_triton", None)  # torch >= 2.6
        self._launchers = {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        launcher = self._launchers.get(name)
        if launcher is None:
            launcher = self._launchers[name] = _Launcher(getattr(self._module, name), self._wrap)
        return launcher
