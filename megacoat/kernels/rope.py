"""Launchers of the fused RoPE kernels (kernels/triton/rope.py). Same signatures as the references in
`megacoat.model.rope`, which decides when to call them. Triton is imported lazily."""
from __future__ import annotations

from functools import lru_cache

import torch

from . import TraceableKernels
from .fp8 import pow2_at_least, triton_cdiv

# (rows, groups per program, warps); rows x groups x (heads per group + 2) x d elements per program
# (benchmarks/rope_bench.py --sweep times the choices)
TILES = {"rope_fwd": (16, 1, 4), "rope_bwd": (16, 1, 4)}


@lru_cache(maxsize=None)
def _k():
    from .triton import rope
    return TraceableKernels(rope)


MAX_QUERY_TILE_ROWS = 64  # rows x query slots a program holds at once (its fp32 q tile, both halves, in registers)


def _launch(kernel, name: str, rows: int, g: int, *args, qpg: int, d: int, **flags):
    r, groups, warps = TILES[name]
    qslots = pow2_at_least(qpg)
    # Many query heads per group (GQA 8+, MQA): fewer rows per program, so the q tile stays in registers (the
    # tiles were measured at 1 and 4 heads per group; the bound keeps those: 16 x 4 = 64).
    r = max(1, min(r, MAX_QUERY_TILE_ROWS // qslots))
    kernel[(triton_cdiv(rows, r), triton_cdiv(g, groups))](
        *args, QPG=qpg, HALF=d // 2, BLOCK_H=pow2_at_least(d // 2), QSLOTS=qslots, ROWS=r, GROUPS=groups,
        num_warps=warps, **flags)


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
    _launch(_k().rope_qkv_fwd_kernel, "rope_fwd", rows, g, qkv, cos, sin, q, k, v, rows, b, g, cs_s, cs_b,
            qpg=qpg, d=d)
    return q, k, v


def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      with_amax: bool = False):
    """dq [s, b, heads, d], dk and dv [s, b, groups, d] (any strides, contiguous last dim) -> (the gradient of the
    QKV output [s, b, groups, heads per group + 2, d], its max |.| as an fp32 scalar if `with_amax` (else an empty
    tensor))."""
    s, b, n, d = dq.shape
    g = dk.shape[2]
    qpg = n // g
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    dqkv = dq.new_empty((s, b, g, qpg + 2, d))
    amax = (torch.zeros((), dtype=torch.float32, device=dq.device) if with_amax
            else dq.new_empty((0,), dtype=torch.float32))
    cs_s, cs_b = _table_strides(cos, sin)
    rows = s * b
    _launch(_k().rope_qkv_bwd_kernel, "rope_bwd", rows, g, dq, dk, dv, cos, sin, dqkv, amax, rows, b, g, cs_s, cs_b,
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), qpg=qpg, d=d, AMAX=with_amax)
    return dqkv, amax
