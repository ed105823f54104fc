"""Fused RoPE over the QKV projection's output (reference: megacoat/model/rope.py `rope_qkv_reference`).

The QKV output is [rows = s * b, groups, heads per group + 2, d] (Megatron's per-group layout: the group's query
heads, then k, then v). Forward: one pass reads it and writes the rotated q [rows, heads, d], the rotated k and a
copy of v [rows, groups, d] (three kernels before, each reading its part). Backward: one pass reads dq, dk, dv (any
strides with a contiguous last dim: they come from the attention backward) and writes the QKV output's gradient,
rotated back. Rotate-half layout on the halves of d: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; fp32 math, one
rounding. Programs take ROWS rows of one group; the cos/sin tables are [s, b, d] with any strides (d contiguous).
"""
import triton
import triton.language as tl


@triton.jit
def _tables(cos_ptr, sin_ptr, rows, B, cs_s, cs_b, h, HALF: tl.constexpr, mask):
    """cos and sin halves in fp32 of rows r = s_index * B + b_index: [ROWS, BLOCK_H] each."""
    base = ((rows // B) * cs_s + (rows % B) * cs_b)[:, None] + h[None, :]
    c1 = tl.load(cos_ptr + base, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + base, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _tile(R, ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's rows [ROWS] (int64), half-dim lanes [BLOCK_H] and mask [ROWS, BLOCK_H]; grid (row blocks,
    groups)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    h = tl.arange(0, BLOCK_H)
    return rows, h, (rows < R)[:, None] & (h < HALF)[None, :]


@triton.jit
def rope_qkv_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, R, B, G, cs_s, cs_b, QPG: tl.constexpr,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """qkv [R, G, QPG + 2, D] -> q [R, G * QPG, D] and k [R, G, D] rotated, v [R, G, D] copied."""
    g = tl.program_id(1)
    rows, h, mask = _tile(R, ROWS, HALF, BLOCK_H)
    D: tl.constexpr = 2 * HALF
    c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, rows, B, cs_s, cs_b, h, HALF, mask)
    src = qkv_ptr + ((rows * G + g) * ((QPG + 2) * D))[:, None] + h[None, :]
    for j in tl.static_range(QPG + 1):  # the group's query heads, then its key head
        x1 = tl.load(src + j * D, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + j * D + HALF, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c1 + (-x2) * s1
        y2 = x2 * c2 + x1 * s2
        if j < QPG:
            dst = q_ptr + ((rows * G + g) * QPG + j)[:, None] * D + h[None, :]
        else:
            dst = k_ptr + ((rows * G + g) * D)[:, None] + h[None, :]
        tl.store(dst, y1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(q_ptr.dtype.element_ty), mask=mask)
    vdst = v_ptr + ((rows * G + g) * D)[:, None] + h[None, :]
    tl.store(vdst, tl.load(src + (QPG + 1) * D, mask=mask), mask=mask)
    tl.store(vdst + HALF, tl.load(src + (QPG + 1) * D + HALF, mask=mask), mask=mask)


@triton.jit
def rope_qkv_bwd_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, dqkv_ptr, R, B, G, cs_s, cs_b,
                        dq_s, dq_b, dq_h, dk_s, dk_b, dk_h, dv_s, dv_b, dv_h, QPG: tl.constexpr,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """dq [s, b, G * QPG, D], dk and dv [s, b, G, D] (by their strides) -> dqkv [R, G, QPG + 2, D], R = s * b."""
    g = tl.program_id(1)
    rows, h, mask = _tile(R, ROWS, HALF, BLOCK_H)
    D: tl.constexpr = 2 * HALF
    c1, c2, s1, s2 = _tables(cos_ptr, sin_ptr, rows, B, cs_s, cs_b, h, HALF, mask)
    s_idx = rows // B
    b_idx = rows % B
    dst = dqkv_ptr + ((rows * G + g) * ((QPG + 2) * D))[:, None] + h[None, :]
    for j in tl.static_range(QPG + 1):
        if j < QPG:
            src = dq_ptr + (s_idx * dq_s + b_idx * dq_b + (g * QPG + j) * dq_h)[:, None] + h[None, :]
        else:
            src = dk_ptr + (s_idx * dk_s + b_idx * dk_b + g * dk_h)[:, None] + h[None, :]
        dy1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        dy2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dx1 = dy1 * c1 + dy2 * s2
        dx2 = dy2 * c2 + (-dy1) * s1
        tl.store(dst + j * D, dx1.to(dqkv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + j * D + HALF, dx2.to(dqkv_ptr.dtype.element_ty), mask=mask)
    src = dv_ptr + (s_idx * dv_s + b_idx * dv_b + g * dv_h)[:, None] + h[None, :]
    tl.store(dst + (QPG + 1) * D, tl.load(src, mask=mask), mask=mask)
    tl.store(dst + (QPG + 1) * D + HALF, tl.load(src + HALF, mask=mask), mask=mask)
