"""FP8 weight-gradient GEMM into an fp32 gradient buffer, adding in the GEMM's epilogue.

`fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate)`: out [N, K] (+)= (gqt [N, T] * sg) @ (xqt [K, T] * sx)^T,
both operands FP8 row-major with one fp32 scale each (the FP8 linear's transposed copies of the output
gradient and the input). The CUDA extension (`csrc/fp8_wgrad.cu`, cuBLASLt with beta = 1) adds into `out`
without an fp32 temporary: `torch._scaled_mm` can only overwrite its output, which left every
micro-batch after a step's first with a temporary and an add pass over the weight gradient.
The reference (same signature) dequantizes and multiplies in fp32; the FP8 linear falls back to
`_scaled_mm` + add on GPUs without the extension (`fp8_wgrad_gemm` returns False there).
"""
from __future__ import annotations

import warnings

import torch


def fp8_wgrad_reference(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                        accumulate: bool) -> None:
    prod = torch.mm(gqt.float() * sg.float(), (xqt.float() * sx.float()).t())
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)


def cuda_extension():
    """The compiled cuBLASLt GEMM, or None (no CUDA, no toolkit: one warning)."""
    from .cuda_ext import load_extension
    return load_extension("fp8_wgrad", ("fp8_wgrad.cu",), libraries=("cublasLt",))


def extension_fits(out: torch.Tensor, gqt: torch.Tensor, xqt: torch.Tensor) -> bool:
    """The shapes, dtypes and alignments the cuBLASLt FP8 GEMM takes (else the caller's fallback runs)."""
    if not (out.is_cuda and out.dtype == torch.float32 and out.is_contiguous() and gqt.is_contiguous()
            and xqt.is_contiguous()):
        return False
    if gqt.dtype == torch.float8_e5m2 and xqt.dtype == torch.float8_e5m2:
        return False  # cuBLAS has no e5m2 x e5m2 kernel
    if any(d % 16 for d in (*gqt.shape, xqt.shape[0])):
        return False
    return gqt.data_ptr() % 16 == 0 and xqt.data_ptr() % 16 == 0 and out.data_ptr() % 4 == 0


class _Unusable:
    """Set when cuBLASLt refused a problem (no algorithm for it on this GPU / library): the fallback then
    runs for the rest of the run instead of failing every backward (found out once per run)."""

    reason = None


def fp8_wgrad_gemm(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                   accumulate: bool) -> bool:
    """Runs the extension when it exists and fits; False otherwise (nothing written)."""
    if _Unusable.reason is not None or not extension_fits(out, gqt, xqt):  # (off-GPU: does not fit)
        return False
    ext = cuda_extension()
    if ext is None:
        return False
    try:
        ext.fp8_wgrad(out, gqt, sg.float().reshape(1), xqt, sx.float().reshape(1), accumulate, False)
    except RuntimeError as e:  # checked before launching: nothing was written
        _Unusable.reason = str(e)
        warnings.warn(f"megacoat: the FP8 weight-gradient GEMM extension failed ({str(e)[:300]}); using "
                      "_scaled_mm and an add for the rest of this run (slower, same result)", stacklevel=2)
        return False
    return True
