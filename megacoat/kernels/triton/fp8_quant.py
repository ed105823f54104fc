"""Triton FP8 quantizers: per-block amax, per-tensor cast (+ fused transposed copy), 1x16 groups.

Numerics are those of `megacoat.precision.fp8` (the reference): fp32 math, IEEE division
(`div_rn`, as torch's `/`), clamp to +-fp8_max, then the cast (round to nearest even). The
`@triton.jit` helpers at the top are shared with the fused activation kernels (fp8_act.py).
Every kernel masks its edges, so any shape works.
"""
import triton
import triton.language as tl


@triton.jit
def sat_cast(v, FMAX: tl.constexpr, out_dtype: tl.constexpr):
    """fp32 values already divided by their scale -> fp8 codes (saturating)."""
    return tl.clamp(v, -FMAX, FMAX).to(out_dtype)


@triton.jit
def group_scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr):
    """Just-in-time scale, bit-identical to the reference's (amax + EPS) / FMAX in fp32."""
    return tl.math.div_rn(amax + EPS, FMAX)


@triton.jit
def quantize_groups_store(v, rows, groups, lanes, mask, q_ptr, s_ptr, stride_q, stride_s,
                          FMAX: tl.constexpr, EPS: tl.constexpr):
    """v: fp32 tile [BM, BG, 16] (masked lanes hold 0). Stores 1x16 codes and fp32 group scales."""
    gmax = tl.max(tl.abs(v), axis=2)
    scale = group_scale(gmax, FMAX, EPS)
    q = sat_cast(tl.math.div_rn(v, scale[:, :, None]), FMAX, q_ptr.dtype.element_ty)
    cols = groups[None, :, None] * 16 + lanes[None, None, :]
    tl.store(q_ptr + rows[:, None, None] * stride_q + cols, q, mask=mask)
    gmask = tl.max(mask.to(tl.int32), axis=2) > 0
    tl.store(s_ptr + rows[:, None] * stride_s + groups[None, :], scale, mask=gmask)


@triton.jit
def amax_partial_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def cast_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, M, K, stride_x,
                FMAX: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """q[m, k] = sat(x[m, k] / scale); with TRANSPOSE also qt[k, m] (qt is [K, M] row-major)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    q = sat_cast(tl.math.div_rn(x, scale), FMAX, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(q), mask=tl.trans(mask))


@triton.jit
def quantize_1x16_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_x,
                         FMAX: tl.constexpr, EPS: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr):
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    groups = pid_g * BG + tl.arange(0, BG)
    lanes = tl.arange(0, 16)
    cols = groups[None, :, None] * 16 + lanes[None, None, :]
    mask = (rows[:, None, None] < M) & (cols < K)
    v = tl.load(x_ptr + rows[:, None, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    quantize_groups_store(v, rows, groups, lanes, mask, q_ptr, s_ptr, K, G, FMAX, EPS)


@triton.jit
def dequantize_1x16_kernel(q_ptr, s_ptr, y_ptr, M, K, G, BM: tl.constexpr, BG: tl.constexpr):
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    groups = pid_g * BG + tl.arange(0, BG)
    lanes = tl.arange(0, 16)
    cols = groups[None, :, None] * 16 + lanes[None, None, :]
    mask = (rows[:, None, None] < M) & (cols < K)
    q = tl.load(q_ptr + rows[:, None, None] * K + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows[:, None] * G + groups[None, :], mask=(rows[:, None] < M) & (groups[None, :] < G),
                other=0.0)
    tl.store(y_ptr + rows[:, None, None] * K + cols, (q * s[:, :, None]).to(y_ptr.dtype.element_ty), mask=mask)
