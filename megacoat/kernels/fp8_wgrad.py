"""FP8 weight-gradient GEMM into an fp32 gradient buffer, adding in the GEMM's epilogue.

`fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate)`: out [N, K] (+)= (gqt [N, T] * sg) @ (xqt [K, T] * sx)^T,
both operands FP8 row-major with one fp32 scale each (the FP8 linear's transposed copies of the output
gradient and the input). The CUDA extension (`csrc/fp8_wgrad.cu`, cuBLASLt with beta = 1) adds into `out`
without an fp32 temporary: `torch._scaled_mm` can only overwrite its output, which left every
micro-batch after a step's first with a temporary and an add pass over the weight gradient.
The reference (same signature) dequantizes and multiplies in fp32: the tests' oracle (off-GPU the FP8
linear's own emulation, `fp8_gemm` + add, computes the same thing). On a
GPU where the extension is missing or declines a problem (`fp8_wgrad_gemm` returns False: shapes, dtypes or
alignment it cannot take, checked by the extension; or a problem cuBLASLt refused once, remembered for the run) the
FP8 linear runs `_scaled_mm` and an add instead.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch

from .fp8 import fp8_gemm_reference


def fp8_wgrad_reference(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                        accumulate: bool) -> None:
    prod = fp8_gemm_reference(gqt, sg.float(), xqt, sx.float(), torch.float32)
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)


@lru_cache(maxsize=None)  # looked up once: this runs on every micro-batch of every linear
def cuda_extension():
    """The compiled cuBLASLt GEMM, or None (no CUDA, no toolkit: one warning)."""
    from .cuda_ext import load_extension
    return load_extension("fp8_wgrad", ("fp8_wgrad.cu",), libraries=("cublasLt",))


class _Refused:
    """Problems cuBLASLt refused (no algorithm for that shape, dtype pair and alignment on this GPU and
    library): each then runs the fallback for the rest of the run, after one warning, instead of failing
    every backward. Other problems keep the extension."""

    keys: set = set()


def _problem_key(out, gqt, xqt, accumulate):
    # out's alignment up to 256 bytes, as the extension's algorithm cache tells problems apart (it takes >= 16)
    return (tuple(gqt.shape), xqt.shape[0], gqt.dtype, xqt.dtype, out.data_ptr() % 256, accumulate, out.device)


def fp8_wgrad_gemm(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                   accumulate: bool) -> bool:
    """Runs the extension when it exists and takes the problem; False otherwise (nothing written).

    The extension decides what it takes (csrc/fp8_wgrad.cu `takes`: every tensor on one GPU; out a
    contiguous fp32 [N, K]; gqt [N, T] and xqt [K, T] contiguous FP8, not both e5m2; N, K, T non-zero
    multiples of 16; one-element fp32 scales; every pointer 16-byte aligned) and returns False for the rest:
    in C++, because these checks in Python cost more host time than the launch, on every micro-batch of
    every linear."""
    ext = cuda_extension()  # None off-GPU
    if ext is None:
        return False
    if _Refused.keys and _problem_key(out, gqt, xqt, accumulate) in _Refused.keys:
        return False
    try:
        return ext.fp8_wgrad(out, gqt, sg, xqt, sx, accumulate, False)
    except torch.OutOfMemoryError:
        raise  # a transient condition of this call, not a property of the problem
    except RuntimeError as e:  # every check comes before the launch: nothing was written
        _Refused.keys.add(_problem_key(out, gqt, xqt, accumulate))
        warnings.warn(f"megacoat: the FP8 weight-gradient GEMM extension refused a problem ({str(e)[:300]}); "
                      "that problem uses _scaled_mm and an add for the rest of this run (slower)", stacklevel=2)
        return False
