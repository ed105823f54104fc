"""Fused RoPE over the QKV projection's output (reference: megacoat/model/rope.py `rope_qkv_reference`).

The QKV output is [rows = s * b, groups, heads per group + 2, d] (Megatron's per-group layout: the group's query
heads, then k, then v). Forward: one pass reads it and writes the rotated q [rows, heads, d], the rotated k and a
copy of v [rows, groups, d] (three kernels before, each reading its part). Backward: one pass reads dq, dk, dv (any
strides with a contiguous last dim: they come from the attention backward) and writes the QKV output's gradient,
rotated back, and (AMAX) its max |.| into a zeroed fp32 scalar: the FP8 QKV linear casts that gradient with
it instead of an amax pass of its own. Rotate-half layout on the halves of d: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; fp32 math, one
rounding. The cos/sin tables are [s, b, d] with any strides (d contiguous).

A program takes ROWS rows and GROUPS groups, one group at a time; the tables are loaded once per program. Per
group, every load (the query heads as one [ROWS, QSLOTS, d / 2] tile per half, QSLOTS = heads per group padded to a
power of two; k and v as [ROWS, 1, d / 2] tiles) is issued before the first store: stores may alias later loads for
all the compiler knows, and a loop over the heads that loads, then stores, waited for memory at each head (~50% of
HBM). The three parts keep separate pointers: one pointer chosen per slot with tl.where loses the 16-byte accesses.
"""
import triton
import triton.language as tl

from .fp8_quant import atomic_max_amax


@triton.jit
def _tile(R, ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, QSLOTS: tl.constexpr):
    """This program's rows [ROWS, 1, 1] (int64), query slots [1, QSLOTS, 1] and half-dim lanes [1, 1, BLOCK_H]."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return rows[:, None, None], tl.arange(0, QSLOTS)[None, :, None], tl.arange(0, BLOCK_H)[None, None, :]


@triton.jit
def _tables(cos_ptr, sin_ptr, r, B, cs_s, cs_b, h, R, HALF: tl.constexpr):
    """cos and sin halves in fp32 of rows r = s_index * B + b_index: [ROWS, 1, BLOCK_H] each."""
    base = (r // B) * cs_s + (r % B) * cs_b + h
    mask = (r < R) & (h < HALF)
    c1 = tl.load(cos_ptr + base, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + base, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """y = x cos + rotate_half(x) sin, on the halves."""
    return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


@triton.jit
def _rotate_back(dy1, dy2, c1, c2, s1, s2):
    """The transpose: dx = dy cos + rotate_half^T(dy sin), on the halves."""
    return dy1 * c1 + dy2 * s2, dy2 * c2 + (-dy1) * s1


@triton.jit
def _load_halves(ptr, mask, HALF: tl.constexpr):
    return (tl.load(ptr, mask=mask, other=0.0).to(tl.float32),
            tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _store_halves(ptr, y1, y2, mask, HALF: tl.constexpr):
    tl.store(ptr, y1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, y2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_qkv_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, R, B, G, cs_s, cs_b, QPG: tl.constexpr,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, QSLOTS: tl.constexpr, ROWS: tl.constexpr,
                        GROUPS: tl.constexpr):
    """qkv [R, G, QPG + 2, D] -> q [R, G * QPG, D] and k [R, G, D] rotated, v [R, G, D] copied."""
    r, j, h = _tile(R, ROWS, HALF, BLOCK_H, QSLOTS)
    D: tl.constexpr = 2 * HALF
    c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, r, B, cs_s, cs_b, h, R, HALF)
    for i in tl.range(0, GROUPS):
        g = tl.program_id(1) * GROUPS + i
        # g < G as a tensor: the interpreter refuses a scalar bool in a mask
        kmask = (r < R) & (r * 0 + g < G) & (h < HALF)
        qmask = kmask & (j < QPG)
        src = qkv_ptr + (r * G + g) * ((QPG + 2) * D) + h
        xq1, xq2 = _load_halves(src + j * D, qmask, HALF)
        xk1, xk2 = _load_halves(src + QPG * D, kmask, HALF)
        v = src + (QPG + 1) * D
        v1 = tl.load(v, mask=kmask)
        v2 = tl.load(v + HALF, mask=kmask)
        yq1, yq2 = _rotate(xq1, xq2, c1, c2, s1, s2)
        yk1, yk2 = _rotate(xk1, xk2, c1, c2, s1, s2)
        _store_halves(q_ptr + ((r * G + g) * QPG + j) * D + h, yq1, yq2, qmask, HALF)
        _store_halves(k_ptr + (r * G + g) * D + h, yk1, yk2, kmask, HALF)
        tl.store(v_ptr + (r * G + g) * D + h, v1, mask=kmask)
        tl.store(v_ptr + (r * G + g) * D + h + HALF, v2, mask=kmask)


@triton.jit
def rope_qkv_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, dqkv_ptr, amax_ptr, R, B, G, cs_s, cs_b,
                        dq_s, dq_b, dq_h, dk_s, dk_b, dk_h, dv_s, dv_b, dv_h, QPG: tl.constexpr,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, QSLOTS: tl.constexpr, ROWS: tl.constexpr,
                        GROUPS: tl.constexpr, AMAX: tl.constexpr):
    """dq [s, b, G * QPG, D], dk and dv [s, b, G, D] (by their strides) -> dqkv [R, G, QPG + 2, D], R = s * b;
    AMAX: amax_ptr = max(it, max |dqkv|) (of the rounded values, as the cast will see them)."""
    r, j, h = _tile(R, ROWS, HALF, BLOCK_H, QSLOTS)
    D: tl.constexpr = 2 * HALF
    c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, r, B, cs_s, cs_b, h, R, HALF)
    s_idx = r // B
    b_idx = r % B
    acc = tl.zeros((), tl.float32)
    for i in tl.range(0, GROUPS):
        g = tl.program_id(1) * GROUPS + i
        kmask = (r < R) & (r * 0 + g < G) & (h < HALF)  # g < G as a tensor (see the forward)
        qmask = kmask & (j < QPG)
        dyq1, dyq2 = _load_halves(dq_ptr + s_idx * dq_s + b_idx * dq_b + (g * QPG + j) * dq_h + h, qmask, HALF)
        dyk1, dyk2 = _load_halves(dk_ptr + s_idx * dk_s + b_idx * dk_b + g * dk_h + h, kmask, HALF)
        v = dv_ptr + s_idx * dv_s + b_idx * dv_b + g * dv_h + h
        v1 = tl.load(v, mask=kmask, other=0.0)
        v2 = tl.load(v + HALF, mask=kmask, other=0.0)
        dxq1, dxq2 = _rotate_back(dyq1, dyq2, c1, c2, s1, s2)
        dxk1, dxk2 = _rotate_back(dyk1, dyk2, c1, c2, s1, s2)
        dst = dqkv_ptr + (r * G + g) * ((QPG + 2) * D) + h
        _store_halves(dst + j * D, dxq1, dxq2, qmask, HALF)
        _store_halves(dst + QPG * D, dxk1, dxk2, kmask, HALF)
        tl.store(dst + (QPG + 1) * D, v1, mask=kmask)
        tl.store(dst + (QPG + 1) * D + HALF, v2, mask=kmask)
        if AMAX:  # masked lanes hold zeros
            t = dqkv_ptr.dtype.element_ty
            mq = tl.maximum(tl.abs(dxq1.to(t).to(tl.float32)), tl.abs(dxq2.to(t).to(tl.float32)))
            mk = tl.maximum(tl.abs(dxk1.to(t).to(tl.float32)), tl.abs(dxk2.to(t).to(tl.float32)))
            mv = tl.maximum(tl.abs(v1.to(tl.float32)), tl.abs(v2.to(tl.float32)))
            acc = tl.maximum(acc, tl.maximum(tl.max(mq), tl.max(tl.maximum(mk, mv))))
    if AMAX:
        atomic_max_amax(amax_ptr, acc)
