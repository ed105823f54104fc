"""Launchers of the fused RoPE kernels (kernels/triton/rope.py). Same signatures as the references in
`megacoat.model.rope`, which decides when to call them. Triton is imported lazily."""
from __future__ import annotations

from functools import lru_cache

import torch

from . import TraceableKernels
from .fp8 import triton_cdiv

ROWS = 16  # rows (tokens) per program: 16 x (heads per group + 2) x d elements per program


@lru_cache(maxsize=None)
def _k():
    from .triton import rope
    return TraceableKernels(rope)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _table_strides(cos: torch.Tensor, sin: torch.Tensor):
    """cos and sin [s, b, 1, d] with one layout and a contiguous last dim -> their (s, b) strides."""
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("fused RoPE: cos and sin need the same strides and a contiguous last dim")
    return cos.stride(0), cos.stride(1)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """qkv [s, b, groups, heads per group + 2, d] -> (q [s, b, heads, d], k, v [s, b, groups, d]), contiguous."""
    s, b, g, slots, d = qkv.shape
    qpg = slots - 2
    qkv = qkv.contiguous()
    q = qkv.new_empty((s, b, g * qpg, d))
    k = qkv.new_empty((s, b, g, d))
    v = qkv.new_empty((s, b, g, d))
    cs_s, cs_b = _table_strides(cos, sin)
    rows = s * b
    _k().rope_qkv_fwd_kernel[(triton_cdiv(rows, ROWS), g)](
        qkv, cos, sin, q, k, v, rows, b, g, cs_s, cs_b, QPG=qpg, HALF=d // 2, BLOCK_H=_pow2(d // 2), ROWS=ROWS)
    return q, k, v


def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """dq [s, b, heads, d], dk and dv [s, b, groups, d] (any strides, contiguous last dim) -> the gradient of the
    QKV output [s, b, groups, heads per group + 2, d]."""
    s, b, n, d = dq.shape
    g = dk.shape[2]
    qpg = n // g
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    dqkv = dq.new_empty((s, b, g, qpg + 2, d))
    cs_s, cs_b = _table_strides(cos, sin)
    rows = s * b
    _k().rope_qkv_bwd_kernel[(triton_cdiv(rows, ROWS), g)](
        dq, dk, dv, cos, sin, dqkv, rows, b, g, cs_s, cs_b, dq.stride(0), dq.stride(1), dq.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        QPG=qpg, HALF=d // 2, BLOCK_H=_pow2(d // 2), ROWS=ROWS)
    return dqkv
