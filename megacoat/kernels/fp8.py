"""Launchers of the Triton FP8 quantizers (kernels/triton/fp8_quant.py).

Same signatures as the references in `megacoat.precision.fp8`, which decides when to call them
(CUDA tensors and Triton importable). Triton is imported lazily: this module imports without it.
Set MEGACOAT_NO_TRITON=1 to force the references.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

# Kept here (the lower layer) so that precision/fp8.py and these launchers share one definition.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EPS = 1e-12
AMAX_BLOCK = 4096
# Tile sizes and warps per kernel: (rows, cols or 16-groups, num_warps). A dict so that
# benchmarks/fp8_bench.py can sweep them on the GPU; the values here are the ones in use.
TILES = {"cast": (64, 128, 8), "quantize_1x16": (16, 16, 4), "dequantize_1x16": (16, 16, 4)}


@lru_cache(maxsize=None)
def available() -> bool:
    """Triton kernels can run (Triton importable, not disabled). Devices are checked by callers."""
    if os.environ.get("MEGACOAT_NO_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def _k():
    from .triton import fp8_quant
    return fp8_quant


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous [M, K] matrix (K = last dim)."""
    x = x.contiguous()
    return x.view(-1, x.shape[-1]) if x.dim() != 2 else x


def amax_partials(x: torch.Tensor) -> torch.Tensor:
    """Stage one of the two-stage amax: max |x| per block of AMAX_BLOCK elements (fp32)."""
    x = x.contiguous().view(-1)
    nblk = triton_cdiv(x.numel(), AMAX_BLOCK)
    out = torch.empty(nblk, dtype=torch.float32, device=x.device)
    _k().amax_partial_kernel[(nblk,)](x, out, x.numel(), BLOCK=AMAX_BLOCK, num_warps=8)
    return out


def amax(x: torch.Tensor) -> torch.Tensor:
    return amax_partials(x).amax()  # stage two: a tiny reduction


def cast_tensorwise(x: torch.Tensor, scale: torch.Tensor, fmt: str, transpose: bool):
    x2 = _rows(x)
    m, k = x2.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE[fmt], device=x.device)
    qt = torch.empty((k, m) if transpose else (0,), dtype=FP8_DTYPE[fmt], device=x.device)
    bm, bk, warps = TILES["cast"]
    grid = (triton_cdiv(m, bm), triton_cdiv(k, bk))
    _k().cast_kernel[grid](x2, scale.float().contiguous(), q, qt if transpose else q, m, k, x2.stride(0),
                           FMAX=FP8_MAX[fmt], TRANSPOSE=transpose, BM=bm, BK=bk, num_warps=warps)
    return q.view(x.shape), qt


def quantize_1x16(x: torch.Tensor, fmt: str):
    x2 = _rows(x)
    m, k = x2.shape
    g = triton_cdiv(k, 16)
    q = torch.empty((m, k), dtype=FP8_DTYPE[fmt], device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    bm, bg, warps = TILES["quantize_1x16"]
    grid = (triton_cdiv(m, bm), triton_cdiv(g, bg))
    _k().quantize_1x16_kernel[grid](x2, q, s, m, k, g, x2.stride(0), FMAX=FP8_MAX[fmt], EPS=EPS, BM=bm, BG=bg,
                                    num_warps=warps)
    return q.view(x.shape), s.view(*x.shape[:-1], g)


def dequantize_1x16(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    q2 = _rows(q)
    m, k = q2.shape
    g = triton_cdiv(k, 16)
    if scales.shape[-1] != g:
        raise ValueError(f"1x16 scales of shape {tuple(scales.shape)} do not match codes of shape {tuple(q.shape)}")
    s2 = scales.contiguous().view(-1, g)
    y = torch.empty((m, k), dtype=dtype, device=q.device)
    bm, bg, warps = TILES["dequantize_1x16"]
    grid = (triton_cdiv(m, bm), triton_cdiv(g, bg))
    _k().dequantize_1x16_kernel[grid](q2, s2, y, m, k, g, BM=bm, BG=bg, num_warps=warps)
    return y.view(q.shape)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
