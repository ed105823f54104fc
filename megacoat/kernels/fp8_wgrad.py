"""FP8 weight-gradient GEMM into an fp32 gradient buffer, adding in the GEMM's epilogue.

`fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate)`: out [N, K] (+)= (gqt [N, T] * sg) @ (xqt [K, T] * sx)^T,
both operands FP8 row-major with one fp32 scale each (the FP8 linear's transposed copies of the output
gradient and the input). The CUDA extension (`csrc/fp8_wgrad.cu`, cuBLASLt with beta = 1) adds into `out`
without an fp32 temporary: `torch._scaled_mm` can only overwrite its output, which left every
micro-batch after a step's first with a temporary and an add pass over the weight gradient.
The reference (same signature) dequantizes and multiplies in fp32: the tests' oracle (off-GPU the FP8
linear's own emulation, `fp8_gemm` + add, computes the same thing). On a
GPU where the extension is missing or declines a problem (`fp8_wgrad_gemm` returns False: shapes, dtypes or
alignment it cannot take, checked in Python; or a problem cuBLASLt refused once, remembered for the run) the
FP8 linear runs `_scaled_mm` and an add instead.
"""
from __future__ import annotations

import warnings

import torch

from .fp8 import fp8_gemm_reference


def fp8_wgrad_reference(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                        accumulate: bool) -> None:
    prod = fp8_gemm_reference(gqt, sg.float(), xqt, sx.float(), torch.float32)
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)


def cuda_extension():
    """The compiled cuBLASLt GEMM, or None (no CUDA, no toolkit: one warning)."""
    from .cuda_ext import load_extension
    return load_extension("fp8_wgrad", ("fp8_wgrad.cu",), libraries=("cublasLt",))


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def problem_fits(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor) -> bool:
    """The shapes, dtypes and alignments the cuBLASLt FP8 GEMM takes, whatever the device: the same checks
    as csrc/fp8_wgrad.cu, so that a problem it would refuse runs the fallback instead of raising."""
    if not (out.dtype == torch.float32 and out.dim() == 2 and gqt.dim() == 2 and xqt.dim() == 2
            and out.is_contiguous() and gqt.is_contiguous() and xqt.is_contiguous()):
        return False
    if gqt.dtype not in _FP8 or xqt.dtype not in _FP8 or gqt.dtype == xqt.dtype == torch.float8_e5m2:
        return False  # cuBLAS has no e5m2 x e5m2 kernel
    n, t = gqt.shape
    k = xqt.shape[0]
    if xqt.shape[1] != t or tuple(out.shape) != (n, k) or min(n, k, t) == 0 or any(d % 16 for d in (n, k, t)):
        return False
    if sg.numel() != 1 or sx.numel() != 1:
        return False
    # out 16-byte aligned too: a 4-byte-aligned out crashed cuBLASLt (see csrc/fp8_wgrad.cu)
    return gqt.data_ptr() % 16 == 0 and xqt.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0


def extension_fits(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor) -> bool:
    """problem_fits, with every tensor on the same GPU."""
    if not all(t.is_cuda and t.device == out.device for t in (out, gqt, sg, xqt, sx)):
        return False
    return problem_fits(out, gqt, sg, xqt, sx)


class _Refused:
    """Problems cuBLASLt refused (no algorithm for that shape, dtype pair and alignment on this GPU and
    library): each then runs the fallback for the rest of the run, after one warning, instead of failing
    every backward. Other problems keep the extension."""

    keys: set = set()


def _problem_key(out, gqt, xqt, accumulate):
    return (tuple(gqt.shape), xqt.shape[0], gqt.dtype, xqt.dtype, out.data_ptr() % 16, accumulate, out.device)


def fp8_wgrad_gemm(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                   accumulate: bool) -> bool:
    """Runs the extension when it exists and takes the problem; False otherwise (nothing written)."""
    if not extension_fits(out, gqt, sg, xqt, sx):  # off-GPU: never fits
        return False
    key = _problem_key(out, gqt, xqt, accumulate)
    if key in _Refused.keys:
        return False
    ext = cuda_extension()
    if ext is None:
        return False
    try:
        ext.fp8_wgrad(out, gqt, sg.float().reshape(1), xqt, sx.float().reshape(1), accumulate, False)
    except torch.OutOfMemoryError:
        raise  # a transient condition of this call, not a property of the problem
    except RuntimeError as e:  # every check comes before the launch: nothing was written
        _Refused.keys.add(key)
        warnings.warn(f"megacoat: the FP8 weight-gradient GEMM extension refused a problem ({str(e)[:300]}); "
                      "that problem uses _scaled_mm and an add for the rest of this run (slower)", stacklevel=2)
        return False
    return True
