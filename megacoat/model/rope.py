"""Rotary position embeddings (the rotate-half layout used by Megatron and HF Llama)."""
from __future__ import annotations

from typing import Tuple

import torch

from ..precision.fp8 import is_compiling
from ..precision.handoff import Activation, split


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables [max_pos, head_dim] in fp32; looks them up by position id."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device=None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        pos = torch.arange(max_positions, dtype=torch.float64, device=device)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Buffers, not parameters: recomputed from the config, never checkpointed.
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids [b, s] -> cos, sin shaped [s, b, 1, d] for [s, b, heads, d] tensors."""
        cos = self.cos[position_ids].transpose(0, 1).unsqueeze(2).to(dtype)
        sin = self.sin[position_ids].transpose(0, 1).unsqueeze(2).to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d]."""
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------- fused RoPE over the QKV output
def rope_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """qkv [s, b, groups, heads per group + 2, d] (Megatron's per-group layout) -> (q [s, b, heads, d] and
    k [s, b, groups, d] rotated, v [s, b, groups, d] copied), contiguous, computed in fp32 (or fp64) and rounded
    once."""
    s, b, g, slots, d = qkv.shape
    acc = torch.promote_types(qkv.dtype, torch.float32)
    x = qkv[:, :, :, : slots - 1].to(acc)
    c, sn = cos.to(acc).unsqueeze(3), sin.to(acc).unsqueeze(3)
    y = (x * c + rotate_half(x) * sn).to(qkv.dtype)
    q = y[:, :, :, : slots - 2].reshape(s, b, g * (slots - 2), d)
    return q, y[:, :, :, slots - 2].contiguous(), qkv[:, :, :, slots - 1].contiguous()


def rope_qkv_backward_reference(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, with_amax: bool = False):
    """(The gradient of the QKV output [s, b, groups, heads per group + 2, d] from dq [s, b, heads, d], dk and dv
    [s, b, groups, d]: the rotation transposed (dx = dy cos + rotate_half^T(dy sin)), fp32 (or fp64), rounded
    once; its max |.| as an fp32 scalar if `with_amax`, else an empty tensor)."""
    s, b, n, d = dq.shape
    g = dk.shape[2]
    acc = torch.promote_types(dq.dtype, torch.float32)
    dy = torch.cat([dq.to(acc).reshape(s, b, g, n // g, d), dk.to(acc).unsqueeze(3)], dim=3)
    w = dy * sin.to(acc).unsqueeze(3)
    w1, w2 = w.chunk(2, dim=-1)
    dx = dy * cos.to(acc).unsqueeze(3) + torch.cat([w2, -w1], dim=-1)
    dqkv = torch.cat([dx.to(dq.dtype), dv.unsqueeze(3).to(dq.dtype)], dim=3)
    amax = dqkv.abs().amax().float() if with_amax else dqkv.new_empty((0,), dtype=torch.float32)
    return dqkv, amax


def _rope_kernel_ok(cos: torch.Tensor, sin: torch.Tensor, *tensors) -> bool:
    """The Triton kernels take these: CUDA, Triton importable, non-empty, cos and sin in one layout with d
    contiguous (the launchers' tables)."""
    from ..kernels import triton_available
    every = (cos, sin, *tensors)
    return (all(t.is_cuda and t.numel() > 0 for t in every) and triton_available() and cos.stride(-1) == 1
            and cos.stride() == sin.stride())


def _rope_qkv_impl(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    if _rope_kernel_ok(cos, sin, qkv):
        from ..kernels import rope as kernels
        return kernels.rope_qkv(qkv, cos, sin)
    return rope_qkv_reference(qkv, cos, sin)


def _rope_qkv_backward_impl(dq, dk, dv, cos, sin, with_amax):
    if _rope_kernel_ok(cos, sin, dq, dk, dv):
        from ..kernels import rope as kernels
        return kernels.rope_qkv_backward(dq, dk, dv, cos, sin, with_amax)
    return rope_qkv_backward_reference(dq, dk, dv, cos, sin, with_amax)


@torch.library.triton_op("megacoat::rope_qkv", mutates_args=())
def _rope_qkv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    return _rope_qkv_impl(qkv, cos, sin)


@_rope_qkv_op.register_fake
def _(qkv, cos, sin):
    s, b, g, slots, d = qkv.shape
    return (qkv.new_empty((s, b, g * (slots - 2), d)), qkv.new_empty((s, b, g, d)), qkv.new_empty((s, b, g, d)))


@torch.library.triton_op("megacoat::rope_qkv_backward", mutates_args=())
def _rope_qkv_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, with_amax: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _rope_qkv_backward_impl(dq, dk, dv, cos, sin, with_amax)


@_rope_qkv_backward_op.register_fake
def _(dq, dk, dv, cos, sin, with_amax):
    s, b, n, d = dq.shape
    g = dk.shape[2]
    return dq.new_empty((s, b, g, n // g + 2, d)), dq.new_empty(() if with_amax else (0,), dtype=torch.float32)


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, grad_amax_token):
        ctx.save_for_backward(cos, sin)
        out = (_rope_qkv_op if is_compiling() else _rope_qkv_impl)(qkv, cos, sin)
        ctx.out_meta = [(t.shape, t.dtype) for t in out]
        ctx.has_token = grad_amax_token is not None
        return out

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        # An output that did not reach the loss has no gradient: zeros of its shape.
        dq, dk, dv = (t if t is not None else torch.zeros(shape, dtype=dtype, device=cos.device)
                      for t, (shape, dtype) in zip((dq, dk, dv), ctx.out_meta))
        dqkv, amax = (_rope_qkv_backward_op if is_compiling() else _rope_qkv_backward_impl)(
            dq, dk, dv, cos, sin, ctx.has_token)
        return dqkv, None, None, (amax if ctx.has_token else None)


def rope_qkv(qkv: Activation, cos: torch.Tensor, sin: torch.Tensor):
    """The fused RoPE over the QKV output (--rope-fusion): qkv [s, b, groups, heads per group + 2, d], cos and sin
    [s, b, 1, d] -> (q [s, b, heads, d], k [s, b, groups, d]) rotated and v [s, b, groups, d], in one pass (one
    Triton kernel on CUDA, one back); the same values as `apply_rotary` on each head, rounded once from fp32.
    `qkv` may be a `Handoff` with the token of the FP8 linear that produced it (precision/handoff.py): the backward
    returns max |dqkv| as the token's gradient, and the linear casts dqkv with it instead of an amax pass."""
    qkv, _, token = split(qkv)
    if qkv.dim() != 5 or qkv.shape[3] < 3 or qkv.shape[-1] % 2:
        raise ValueError(f"fused RoPE needs the QKV output as [s, b, groups, heads per group + 2, d] with an even d, "
                         f"got {tuple(qkv.shape)}")
    return _RopeQKV.apply(qkv, cos, sin, token)
