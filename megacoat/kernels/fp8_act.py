"""Launchers of the fused FP8 activation kernels (kernels/triton/fp8_act.py).

Same signatures and outputs as the references in `megacoat.precision.activations`, which decides
when to call them. Triton is imported lazily.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from . import TraceableKernels
from .fp8 import EPS, FP8_DTYPE, FP8_MAX, SCALE_DTYPE_1X16, group_grid, pow2_at_least, triton_cdiv

SAVE = "e4m3"
ACT_KIND = {"silu": 0, "gelu": 1}
# (rows, 16-groups, num_warps, split) of each element-wise kernel (split: threads per 16-group, 1 or 2;
# the winners of `benchmarks/fp8_bench.py --parts tiles` on an H200;
# see kernels/triton/fp8_quant.py); the norms take whole rows (see _norm_tile).
# Module-level so that benchmarks/fp8_bench.py can sweep them.
TILES = {"act_fwd": (4, 32, 4, 2), "act_bwd": (2, 64, 4, 2), "swiglu_fwd": (4, 64, 8, 2),
         "swiglu_bwd": (8, 16, 4, 1), "norm_elems_per_program": 4096,
         # The SwiGLU backward straight to per-tensor FP8 (both layouts): its amax pass (a 1x16 tile as above;
         # it stores nothing, so larger tiles: fewer programs, fewer atomics on the one amax) and the cast's 2-D
         # tile (rows, gate columns, num_warps). Cast: the best of `benchmarks/fp8_bench.py --parts swiglubwd` on an
         # H200 at [8192, 2 x 5632] and [16384, 2 x 4096] (204.6 / 293.0 us with the amax pass, against 230.1 / 333.4
         # for (128, 64, 8)).
         "swiglu_bwd_amax": (8, 64, 8, 2), "swiglu_bwd_cast": (32, 128, 4),
         # norm backward: (elements per loop iteration, programs per SM, num_warps (0: by the row width),
         # software-pipeline stages of the row loop). The sweep's best over 8192x2048, 4096x4096 and 16384x4096
         # with the fused residual gradient and its amax (`benchmarks/fp8_bench.py --parts reductions`, H200):
         # 56.8 / 87.9 / 269.0 us against 78.4 / 95.4 / 286.2 for (4096, 4, 0, 1).
         "norm_bwd": (4096, 2, 0, 2)}


@lru_cache(maxsize=None)  # one module wrapper: its launchers (and their wrap_triton objects) are reused
def _k():
    from .triton import fp8_act
    return TraceableKernels(fp8_act)


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _norm_tile(k: int, elems: int, warps: int = 0):
    """(rows per tile, 16-groups per row (a power of 2), num_warps) for rows of k elements and tiles of
    about `elems` elements (several narrow rows per tile); warps 0: by the row width."""
    bg = pow2_at_least(triton_cdiv(k, 16))
    br = max(1, min(16, elems // (bg * 16)))
    if not warps:
        warps = 4 if bg * 16 <= 2048 else (8 if bg * 16 <= 8192 else 16)
    return br, bg, warps


def norm_fwd(x, residual, weight, bias, eps: float, rms: bool):
    k = x.shape[-1]
    x2 = x.contiguous().view(-1, k)
    m, g = x2.shape[0], triton_cdiv(k, 16)
    dev = x.device
    res = residual.contiguous().view(-1, k) if residual is not None else None
    stream = torch.empty_like(x2) if res is not None else x2.new_empty(0)
    y = torch.empty_like(x2)
    q = torch.empty((m, k), dtype=FP8_DTYPE[SAVE], device=dev)
    qs = torch.empty((m, g), dtype=SCALE_DTYPE_1X16, device=dev)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    mean = torch.empty(m if not rms else 0, dtype=torch.float32, device=dev)
    br, bg, warps = _norm_tile(k, TILES["norm_elems_per_program"])
    grid = triton_cdiv(m, br)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    _k().norm_fwd_kernel[(grid,)](
        x2, res if res is not None else x2, stream if res is not None else x2, weight,
        bias if bias is not None else weight, y, q, qs, rstd, mean if not rms else rstd, amax,
        m, k, g, eps, HAS_RES=res is not None, RMS=rms, HAS_BIAS=bias is not None,
        FMAX=FP8_MAX[SAVE], EPS=EPS, BR=br, BG=bg, num_warps=warps)
    lead = x.shape[:-1]
    return (stream.view(x.shape) if res is not None else stream, y.view(x.shape), amax,
            q.view(x.shape), qs.view(*lead, g), rstd.view(lead), mean.view(lead) if not rms else mean)


def norm_bwd(dy, xq, xs, rstd, mean, weight, has_bias: bool, rms: bool, dres=None, want_amax: bool = False):
    """-> (dx, dweight, dbias or empty, max |dx| (0-d fp32) or empty)."""
    k = dy.shape[-1]
    dy2 = dy.view(-1, k)
    m, g = dy2.shape[0], triton_cdiv(k, 16)
    dev = dy.device
    elems, per_sm, warps, stages = TILES["norm_bwd"]
    br, bg, warps = _norm_tile(k, elems, warps)
    progs = max(1, min(triton_cdiv(m, br), per_sm * _sm_count(dev)))
    rows_per_prog = triton_cdiv(triton_cdiv(m, progs), br) * br
    progs = triton_cdiv(m, rows_per_prog)
    dx = torch.empty_like(dy2)
    dw = torch.empty((progs, k), dtype=torch.float32, device=dev)
    db = torch.empty((progs, k) if has_bias else (0,), dtype=torch.float32, device=dev)
    amax = torch.zeros((), dtype=torch.float32, device=dev) if want_amax else torch.empty(0, device=dev)
    _k().norm_bwd_kernel[(progs,)](
        dy2, xq.contiguous().view(-1, k), xs.contiguous().view(-1, g), rstd.contiguous().view(-1),
        mean.contiguous().view(-1) if not rms else rstd, weight,
        dres.contiguous().view(-1, k) if dres is not None else dy2, dx, dw, db if has_bias else dw,
        amax if want_amax else dw, m, k, g, rows_per_prog, RMS=rms, HAS_BIAS=has_bias, HAS_RES=dres is not None,
        AMAX=want_amax, BR=br, BG=bg, STAGES=stages, num_warps=warps)
    return (dx.view(dy.shape), dw.sum(0).to(weight.dtype),
            db.sum(0).to(weight.dtype) if has_bias else weight.new_empty(0), amax)


def _ew_grid(name: str, m: int, g: int):
    bm, bg, warps, split = TILES[name]
    return dict(BM=bm, BG=bg, SPLIT=split, num_warps=warps), group_grid(m, g, bm, bg)


def swiglu_fwd(h):
    two_f = h.shape[-1]
    if two_f % 2:
        raise ValueError(f"SwiGLU input's last dim ({two_f}) must be even: [gate; up] halves")
    f = two_f // 2
    h2 = h.contiguous().view(-1, two_f)
    m, g = h2.shape[0], triton_cdiv(f, 16)
    dev = h.device
    p = torch.empty((m, f), dtype=h.dtype, device=dev)
    q = torch.empty((m, 2, f), dtype=FP8_DTYPE[SAVE], device=dev)
    qs = torch.empty((m, 2, g), dtype=SCALE_DTYPE_1X16, device=dev)
    tile, grid = _ew_grid("swiglu_fwd", m, g)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    _k().swiglu_fwd_kernel[grid](h2, p, q, qs, amax, m, f, g, FMAX=FP8_MAX[SAVE], EPS=EPS, **tile)
    lead = h.shape[:-1]
    return p.view(*lead, f), amax, q.view(*lead, 2, f), qs.view(*lead, 2, g)


def swiglu_bwd(dp, hq, hs):
    """-> (dh, max |dh|)."""
    f = dp.shape[-1]
    dp2 = dp.view(-1, f)
    m, g = dp2.shape[0], triton_cdiv(f, 16)
    dh = torch.empty((m, 2 * f), dtype=dp.dtype, device=dp.device)
    amax = torch.zeros((), dtype=torch.float32, device=dp.device)
    tile, grid = _ew_grid("swiglu_bwd", m, g)
    _k().swiglu_bwd_kernel[grid](dp2, hq.contiguous().view(m, 2, f), hs.contiguous().view(m, 2, g), dh, amax, m, f,
                                 g, **tile)
    return dh.view(*dp.shape[:-1], 2 * f), amax


def swiglu_bwd_quantized(dp, hq, hs, fmt: str):
    """-> (gq [M, 2F], gqt [2F, M], scale, max |dh|): dh = [dgate; dup] cast per tensor to `fmt` in both
    layouts without writing dh (two launches: the amax pass, then the recomputing cast)."""
    f = dp.shape[-1]
    dp2 = dp.contiguous().view(-1, f)
    m, g = dp2.shape[0], triton_cdiv(f, 16)
    dev = dp.device
    bm, bf, warps = TILES["swiglu_bwd_cast"]
    if bf % 16:
        raise ValueError(f"TILES['swiglu_bwd_cast'] columns per tile ({bf}) must be a multiple of 16 "
                         "(whole 1x16 groups)")
    q3, s3 = hq.contiguous().view(m, 2, f), hs.contiguous().view(m, 2, g)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    tile, grid = _ew_grid("swiglu_bwd_amax", m, g)
    _k().swiglu_bwd_kernel[grid](dp2, q3, s3, dp2, amax, m, f, g, STORE=False, **tile)
    dt = FP8_DTYPE[fmt]
    gq = torch.empty((m, 2 * f), dtype=dt, device=dev)
    gqt = torch.empty((2 * f, m), dtype=dt, device=dev)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    _k().swiglu_bwd_cast_kernel[(triton_cdiv(m, bm), triton_cdiv(f, bf))](
        dp2, q3, s3, amax, scale, gq, gqt, m, f, g, FMAX=FP8_MAX[fmt], EPS=EPS, BM=bm, BF=bf, num_warps=warps)
    return gq, gqt, scale, amax


def act_fwd(h, kind: str):
    k = h.shape[-1]
    h2 = h.contiguous().view(-1, k)
    m, g = h2.shape[0], triton_cdiv(k, 16)
    dev = h.device
    y = torch.empty_like(h2)
    q = torch.empty((m, k), dtype=FP8_DTYPE[SAVE], device=dev)
    qs = torch.empty((m, g), dtype=SCALE_DTYPE_1X16, device=dev)
    tile, grid = _ew_grid("act_fwd", m, g)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    _k().act_fwd_kernel[grid](h2, y, q, qs, amax, m, k, g, KIND=ACT_KIND[kind], FMAX=FP8_MAX[SAVE], EPS=EPS, **tile)
    return y.view(h.shape), amax, q.view(h.shape), qs.view(*h.shape[:-1], g)


def act_bwd(dy, hq, hs, kind: str):
    k = dy.shape[-1]
    dy2 = dy.view(-1, k)
    m, g = dy2.shape[0], triton_cdiv(k, 16)
    dh = torch.empty_like(dy2)
    tile, grid = _ew_grid("act_bwd", m, g)
    _k().act_bwd_kernel[grid](dy2, hq.contiguous().view(m, k), hs.contiguous().view(m, g), dh, m, k, g,
                              KIND=ACT_KIND[kind], **tile)
    return dh.view(dy.shape)
