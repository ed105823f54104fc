"""Triton kernels of the vocabulary-parallel cross entropy (reference: megacoat/parallel/cross_entropy.py).

The logits stay in their dtype (bf16 in training): the forward reads each row once and keeps, per
lane, a running max and a sum of exponentials relative to it (online softmax), merged at the end;
the backward recomputes softmax - onehot from the logits and the row's log-sum-exp and writes the
gradient in the logits' dtype. No fp32 copy of the [tokens, vocab] logits is ever made (the eager
version made four passes over one and saved the fp32 softmax for backward).
Columns at or past `valid` (padded vocabulary) take no probability mass and get a zero gradient.
"""
import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _masked_logits(row_ptr, c, V, valid):
    """fp32 logits of columns c, -inf at and past `valid`. Loaded up to the row's length V (a multiple of
    16 under Megatron's vocabulary padding, so the loads vectorize) rather than up to `valid` (the
    unpadded size, often odd: GPT-2's 50257 would make every access scalar)."""
    x = tl.load(row_ptr + c, mask=c < V, other=NEG_INF).to(tl.float32)
    return tl.where(c < valid, x, NEG_INF)


@triton.jit
def row_stats_kernel(x_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, V, valid, stride, BLOCK: tl.constexpr):
    """Row r: m = max of its first `valid` logits (-inf if none), s = sum exp(x - m), t = x[tgt] if
    0 <= tgt < valid else 0. One program per row."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], NEG_INF, tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    nan_vec = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, valid, BLOCK):
        c = v0 + cols
        x = _masked_logits(base, c, V, valid)
        # max(a, NaN) is a (the hardware's max.f32), and the where below would then drop the NaN:
        # NaNs are counted apart so that a row with one gets a NaN loss, as torch's max would give.
        nan_vec += (x != x).to(tl.int32)
        m_new = tl.maximum(m_vec, x)
        # A lane that has seen only -inf keeps s = 0 (exp(-inf - -inf) would be NaN).
        s_vec = tl.where(m_new > NEG_INF, s_vec * tl.exp(m_vec - m_new) + tl.exp(x - m_new), 0.0)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    s = tl.sum(tl.where(m_vec > NEG_INF, s_vec * tl.exp(m_vec - m), 0.0), axis=0)
    s = tl.where(tl.sum(nan_vec, axis=0) > 0, float("nan"), s)
    tgt = tl.load(tgt_ptr + row)
    inside = (tgt >= 0) & (tgt < valid)
    t = tl.load(base + tl.where(inside, tgt, 0), mask=inside, other=0.0).to(tl.float32)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)


@triton.jit
def softmax_grad_kernel(x_ptr, g_ptr, lse_ptr, tgt_ptr, gl_ptr, V, valid, stride_x, stride_g, BLOCK: tl.constexpr):
    """g[r, v] = (exp(x[r, v] - lse[r]) - (v == tgt[r])) * gl[r] for v < valid, 0 for valid <= v < V.
    1-D grid over (rows, column blocks), column blocks fastest: consecutive programs read consecutive
    memory."""
    pid = tl.program_id(0)
    nb = tl.cdiv(V, BLOCK)
    row = (pid // nb).to(tl.int64)
    c = (pid % nb) * BLOCK + tl.arange(0, BLOCK)
    x = _masked_logits(x_ptr + row * stride_x, c, V, valid)
    p = tl.exp(x - tl.load(lse_ptr + row))
    p = tl.where(c == tl.load(tgt_ptr + row), p - 1.0, p)
    # Padding (a target there included): 0 even where lse is -inf or NaN (exp(-inf - lse) would be NaN).
    p = tl.where(c < valid, p, 0.0)
    tl.store(g_ptr + row * stride_g + c, (p * tl.load(gl_ptr + row)).to(g_ptr.dtype.element_ty), mask=c < V)
