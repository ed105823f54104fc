"""Transformer layer: norm -> attention -> residual -> norm -> MLP -> residual, on [s, b, h].

Llama-style by default (RMSNorm, RoPE, SwiGLU, optional grouped-query attention, no biases);
GPT-2 style with LayerNorm, GELU (tanh approximation, as GPT-2) and biases.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.layers import ColumnParallelLinear, InitSpec, RowParallelLinear, mark_sequence_parallel, register_replicated
from ..parallel.mappings import group_size
from ..parallel.random import RNGTracker
from ..precision.activations import fp8_activation, fp8_norm
from ..precision.linear import Fp8LinearImpl
from ..precision.recipe import Fp8Recipe
from .recompute import recompute
from .rope import apply_rotary, rope_qkv


@dataclass
class LayerContext:
    """What every layer needs besides its own config: groups, RNG, dtype, device."""

    tp_group: object
    sequence_parallel: bool
    rng: Optional[RNGTracker]
    dtype: torch.dtype
    device: torch.device
    seed: int
    # Weight-gradient GEMMs accumulate straight into the optimizer's main_grad (--no-gradient-accumulation-fusion).
    gradient_accumulation_fusion: bool = True
    # The loss through the fused cross-entropy kernels where they run (--no-cross-entropy-loss-fusion: the torch
    # references of parallel/cross_entropy.py).
    cross_entropy_fusion: bool = True
    # RoPE over the QKV output through the fused op of model/rope.py (--rope-fusion), else torch operations.
    rope_fusion: bool = False
    # FP8 recipe (--fp8-format/--fp8-recipe), None for bf16/fp32: the transformer linears run their GEMMs
    # in FP8 and, under coat, norms/activations save FP8 copies (the output layer and attention stay bf16).
    fp8: Optional[Fp8Recipe] = None

    def linear_impl(self):
        return Fp8LinearImpl(self.fp8, self.device) if self.fp8 is not None else None

    @property
    def coat(self) -> bool:
        return self.fp8 is not None and self.fp8.fp8_activations


class Norm(nn.Module):
    def __init__(self, m: ModelConfig, lc: LayerContext, name: str):
        super().__init__()
        self.kind, self.eps, self.shape = m.normalization, m.norm_epsilon, (m.hidden_size,)
        self.weight = register_replicated(nn.Parameter(torch.ones(m.hidden_size, dtype=lc.dtype, device=lc.device)),
                                          f"{name}.weight")
        self.bias = None
        if self.kind == "LayerNorm":
            self.bias = register_replicated(nn.Parameter(torch.zeros(m.hidden_size, dtype=lc.dtype, device=lc.device)),
                                            f"{name}.bias")
        if lc.sequence_parallel:
            mark_sequence_parallel(self)

    def fp8_forward(self, x, residual=None, grad_amax_token=None):
        """COAT's fused norm: (stream = x (+ residual), y, amax of y); saves the stream as FP8 1x16.
        `grad_amax_token`: the token of the FP8 linear that produced x (see `fp8_norm`)."""
        return fp8_norm(x, self.weight, self.bias, self.eps, self.kind == "RMSNorm", residual=residual,
                        grad_amax_token=grad_amax_token)

    def forward(self, x):
        if self.kind == "RMSNorm":
            # fp32 statistics, output in the input dtype; torch's fused kernel where it has one (it
            # saves only the input and rstd for backward, not fp32 copies).
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def _dropout_region(lc: LayerContext, inside_tp: bool, p: float):
    """The model-parallel RNG stream where TP ranks hold different data, else the default one."""
    if p > 0 and lc.rng is not None and (inside_tp or lc.sequence_parallel) and group_size(lc.tp_group) > 1:
        return lc.rng.fork()
    return contextlib.nullcontext()


class SelfAttention(nn.Module):
    def __init__(self, m: ModelConfig, lc: LayerContext, name: str, layer_number: int):
        super().__init__()
        tp = group_size(lc.tp_group)
        self.lc, self.m = lc, m
        self.head_dim = m.kv_channels
        self.heads_local = m.num_attention_heads // tp
        self.groups_local = m.num_query_groups // tp
        self.q_per_group = m.num_attention_heads // m.num_query_groups
        qkv_out = m.num_query_groups * (self.q_per_group + 2) * self.head_dim
        std = m.init_method_std
        # QKV rows are laid out per query group: [q heads of the group, k, v] (Megatron's layout),
        # so a contiguous TP split hands each rank whole groups.
        self.qkv = ColumnParallelLinear(m.hidden_size, qkv_out, tp_group=lc.tp_group, name=f"{name}.qkv",
                                        init=InitSpec(lc.seed, std), bias=m.add_bias_linear,
                                        sequence_parallel=lc.sequence_parallel, dtype=lc.dtype, device=lc.device,
                                        gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                        linear_impl=lc.linear_impl())
        self.proj = RowParallelLinear(m.num_attention_heads * self.head_dim, m.hidden_size, tp_group=lc.tp_group,
                                      name=f"{name}.proj", init=InitSpec(lc.seed, std / math.sqrt(2 * m.num_layers)),
                                      bias=m.add_bias_linear, sequence_parallel=lc.sequence_parallel,
                                      dtype=lc.dtype, device=lc.device,
                                      gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                      linear_impl=lc.linear_impl())
        self.recompute_core = False  # --recompute-granularity selective (set by the trainer)

    def forward(self, x, rope, attention_mask, x_amax=None, grad_amax_token=False):
        """`grad_amax_token=True`: returns (output, the projection's token or None) (RowParallelLinear)."""
        s, b = x.shape[0] * (group_size(self.lc.tp_group) if self.lc.sequence_parallel else 1), x.shape[1]
        recompute_core = self.recompute_core and self.training and torch.is_grad_enabled()
        # The fused RoPE computes the whole QKV gradient: its backward hands the FP8 QKV linear that gradient's
        # amax (no amax pass there). Not through the selective recompute (the token would have to cross it).
        token = None
        if rope is not None and self.lc.rope_fusion and not recompute_core and torch.is_grad_enabled():
            qkv, token = self.qkv(x, x_amax=x_amax, grad_amax_token=True)
        else:
            qkv = self.qkv(x, x_amax=x_amax)
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.head_dim)
        if recompute_core:
            # --recompute-granularity selective: keep only the QKV output for backward
            o = recompute(lambda t: self._core(t, rope, attention_mask), qkv, rng=self.lc.rng)
        else:
            o = self._core(qkv, rope, attention_mask, token)
        return self.proj(o, grad_amax_token=grad_amax_token)

    def _core(self, qkv, rope, attention_mask, qkv_token=None):
        """QKV output [s, b, groups, q_per_group + 2, d] -> attention output [s, b, heads * d]. `qkv_token`: the
        QKV linear's token (the fused RoPE returns max |dqkv| as its gradient)."""
        s, b = qkv.shape[0], qkv.shape[1]
        if rope is not None and self.lc.rope_fusion:  # q, k rotated and v copied in one pass
            q, k, v = rope_qkv(qkv, *rope, grad_amax_token=qkv_token)
        else:
            q = qkv[:, :, :, : self.q_per_group].reshape(s, b, self.heads_local, self.head_dim)
            k = qkv[:, :, :, self.q_per_group]
            # A copy, not a view: attention saves v for backward, and a view would keep the whole QKV
            # output (3x its size) alive until then.
            v = qkv[:, :, :, self.q_per_group + 1].contiguous()
            if rope is not None:
                cos, sin = rope
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # [s, b, n, d] -> [b, n, s, d] for SDPA.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.q_per_group > 1:
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        p = self.m.attention_dropout if self.training else 0.0
        with _dropout_region(self.lc, inside_tp=True, p=p):
            if attention_mask is None:
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p)
        return o.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)


class MLP(nn.Module):
    def __init__(self, m: ModelConfig, lc: LayerContext, name: str):
        super().__init__()
        self.swiglu = m.activation == "swiglu"
        self.lc = lc
        ffn = m.ffn_hidden_size
        std = m.init_method_std
        blocks = [ffn, ffn] if self.swiglu else [ffn]  # [gate; up] each split over TP
        self.fc1 = ColumnParallelLinear(m.hidden_size, sum(blocks), tp_group=lc.tp_group, name=f"{name}.fc1",
                                        init=InitSpec(lc.seed, std), bias=m.add_bias_linear, partition_sizes=blocks,
                                        sequence_parallel=lc.sequence_parallel, dtype=lc.dtype, device=lc.device,
                                        gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                        linear_impl=lc.linear_impl())
        self.fc2 = RowParallelLinear(ffn, m.hidden_size, tp_group=lc.tp_group, name=f"{name}.fc2",
                                     init=InitSpec(lc.seed, std / math.sqrt(2 * m.num_layers)),
                                     bias=m.add_bias_linear, sequence_parallel=lc.sequence_parallel,
                                     dtype=lc.dtype, device=lc.device,
                                     gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                     linear_impl=lc.linear_impl())

    def forward(self, x, x_amax=None, grad_amax_token=False):
        """`grad_amax_token=True` (coat): returns (output, fc2's token or None) (RowParallelLinear)."""
        if self.lc.coat:
            # Fused FP8 activations: save FP8 1x16 copies, hand fc2 the product and its amax. The SwiGLU
            # runs inside fc1's autograd node, which then gets its output gradient's amax for free.
            if self.swiglu:
                p, p_amax = self.fc1(x, x_amax=x_amax, activation="swiglu")
            else:
                p, p_amax = fp8_activation(self.fc1(x, x_amax=x_amax), "gelu")
            return self.fc2(p, x_amax=p_amax, grad_amax_token=grad_amax_token)
        h = self.fc1(x, x_amax=x_amax)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)


class TransformerLayer(nn.Module):
    def __init__(self, m: ModelConfig, lc: LayerContext, layer_number: int):
        super().__init__()
        name = f"layers.{layer_number}"
        self.lc, self.hidden_dropout = lc, m.hidden_dropout
        self.input_norm = Norm(m, lc, f"{name}.input_norm")
        self.attention = SelfAttention(m, lc, f"{name}.attention", layer_number)
        self.post_attention_norm = Norm(m, lc, f"{name}.post_attention_norm")
        self.mlp = MLP(m, lc, f"{name}.mlp")
        # coat: return (stream, mlp output, fc2's token) un-added, for the next layer's input norm to add in its
        # kernel (set by the model for every layer but the last of its chunk).
        self.defer_residual = False

    def _residual_dropout(self, h, residual):
        if self.training and self.hidden_dropout > 0:
            with _dropout_region(self.lc, inside_tp=False, p=self.hidden_dropout):
                h = F.dropout(h, self.hidden_dropout, training=True)
        return residual + h

    def _dropout(self, h):
        if self.training and self.hidden_dropout > 0:
            with _dropout_region(self.lc, inside_tp=False, p=self.hidden_dropout):
                h = F.dropout(h, self.hidden_dropout, training=True)
        return h

    def _forward_coat(self, x, rope, attention_mask):
        """COAT: the norms save FP8 1x16 copies of the residual stream, emit their output with its amax
        for the FP8 GEMM; the residual adds are fused into them (the first norm's when the previous layer
        deferred its add: x is then (stream, branch, token)). Without dropout, each residual branch's FP8
        linear (projection, fc2) hands its token to the norm that adds its output, whose backward returns the
        amax of that linear's output gradient: no amax pass for either."""
        tokens = self.hidden_dropout == 0
        if isinstance(x, tuple):
            stream, branch, token = x
            x, y, y_amax = self.input_norm.fp8_forward(branch, residual=stream, grad_amax_token=token)
        else:
            _, y, y_amax = self.input_norm.fp8_forward(x)
        h, token = self._branch(self.attention(y, rope, attention_mask, x_amax=y_amax, grad_amax_token=tokens),
                                tokens)
        x, y, y_amax = self.post_attention_norm.fp8_forward(h, residual=x, grad_amax_token=token)
        if self.defer_residual:
            h, token = self._branch(self.mlp(y, x_amax=y_amax, grad_amax_token=tokens), tokens)
            return x, h, token
        return x + self._dropout(self.mlp(y, x_amax=y_amax))

    def _branch(self, out, tokens: bool):
        """A residual branch's (output, token or None), dropout applied (no token then)."""
        return out if tokens else (self._dropout(out), None)

    def forward(self, x, rope=None, attention_mask=None):
        """x: [s, b, h], or under coat the previous layer's deferred (stream, branch, token). Returns [s, b, h],
        or that triple when `defer_residual`."""
        if self.lc.coat:
            return self._forward_coat(x, rope, attention_mask)
        x = self._residual_dropout(self.attention(self.input_norm(x), rope, attention_mask), x)
        return self._residual_dropout(self.mlp(self.post_attention_norm(x)), x)
