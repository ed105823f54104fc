"""Transformer layer: norm -> attention -> residual -> norm -> MLP -> residual, on [s, b, h].

Llama-style by default (RMSNorm, RoPE, SwiGLU, optional grouped-query attention, no biases);
GPT-2 style with LayerNorm, GELU (tanh approximation, as GPT-2) and biases.

One forward for every precision recipe: the norms, residual adds and the MLP activation are the recipe's operations
(`LayerContext.ops`, precision/layer_ops.py), and so is each linear's FP8 implementation. What an FP8 recipe hands
from one operation to the next besides the tensor (an amax, a grad-amax token, a residual add left to the next norm:
precision/handoff.py) passes through the layer untouched.
"""
from __future__ import annotations

import contextlib
import functools
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
from ..precision.handoff import value_of
from ..precision.layer_ops import RESIDUAL, ROPE, LayerOps, layer_ops
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

    @functools.cached_property
    def ops(self) -> LayerOps:
        """The recipe's norms, residual adds, activations and linear implementations (precision/layer_ops.py);
        one object shared by every layer (compiled layers reuse one graph)."""
        return layer_ops(self.fp8, self.device)


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

    @property
    def rms(self) -> bool:
        return self.kind == "RMSNorm"

    def forward(self, x):
        if self.rms:
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
        fused_rope = lc.rope_fusion and m.position_embedding_type == "rope"
        # QKV rows are laid out per query group: [q heads of the group, k, v] (Megatron's layout),
        # so a contiguous TP split hands each rank whole groups.
        self.qkv = ColumnParallelLinear(m.hidden_size, qkv_out, tp_group=lc.tp_group, name=f"{name}.qkv",
                                        init=InitSpec(lc.seed, std), bias=m.add_bias_linear,
                                        sequence_parallel=lc.sequence_parallel, dtype=lc.dtype, device=lc.device,
                                        gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                        linear_impl=lc.ops.linear_impl(ROPE if fused_rope else None))
        self.proj = RowParallelLinear(m.num_attention_heads * self.head_dim, m.hidden_size, tp_group=lc.tp_group,
                                      name=f"{name}.proj", init=InitSpec(lc.seed, std / math.sqrt(2 * m.num_layers)),
                                      bias=m.add_bias_linear, sequence_parallel=lc.sequence_parallel,
                                      dtype=lc.dtype, device=lc.device,
                                      gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                      linear_impl=lc.ops.linear_impl(_residual_branch(m)))
        self.recompute_core = False  # --recompute-granularity selective (set by the trainer)

    def forward(self, x, rope, attention_mask):
        qkv = self.qkv(x)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # --recompute-granularity selective: keep only the QKV output for backward (a token of its FP8 linear
            # gets its gradient amax outside the recomputed core)
            o = recompute(lambda t: self._core(t, rope, attention_mask), value_of(qkv), rng=self.lc.rng)
        else:
            o = self._core(qkv, rope, attention_mask)
        return self.proj(o)

    def _core(self, qkv, rope, attention_mask):
        """QKV output [s, b, groups * (q_per_group + 2) * d] -> attention output [s, b, heads * d]. With the fused RoPE
        under an FP8 recipe the QKV output is a Handoff whose token the RoPE's backward fills."""
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.head_dim)
        if rope is not None and self.lc.rope_fusion:  # q, k rotated and v copied in one pass
            q, k, v = rope_qkv(qkv, *rope)
        else:
            qkv = value_of(qkv)
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


def _residual_branch(m: ModelConfig) -> Optional[str]:
    """What takes a residual branch's last linear output: the residual add itself, unless dropout comes between."""
    return RESIDUAL if m.hidden_dropout == 0 else None


class MLP(nn.Module):
    def __init__(self, m: ModelConfig, lc: LayerContext, name: str):
        super().__init__()
        self.activation = m.activation
        self.ops = lc.ops
        ffn = m.ffn_hidden_size
        std = m.init_method_std
        blocks = [ffn, ffn] if m.activation == "swiglu" else [ffn]  # [gate; up] each split over TP
        self.fc1 = ColumnParallelLinear(m.hidden_size, sum(blocks), tp_group=lc.tp_group, name=f"{name}.fc1",
                                        init=InitSpec(lc.seed, std), bias=m.add_bias_linear, partition_sizes=blocks,
                                        sequence_parallel=lc.sequence_parallel, dtype=lc.dtype, device=lc.device,
                                        gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                        linear_impl=lc.ops.linear_impl())
        self.fc2 = RowParallelLinear(ffn, m.hidden_size, tp_group=lc.tp_group, name=f"{name}.fc2",
                                     init=InitSpec(lc.seed, std / math.sqrt(2 * m.num_layers)),
                                     bias=m.add_bias_linear, sequence_parallel=lc.sequence_parallel,
                                     dtype=lc.dtype, device=lc.device,
                                     gradient_accumulation_fusion=lc.gradient_accumulation_fusion,
                                     linear_impl=lc.ops.linear_impl(_residual_branch(m)))

    def forward(self, x):
        return self.fc2(self.ops.linear_activation(self.fc1, x, self.activation))


class TransformerLayer(nn.Module):
    def __init__(self, m: ModelConfig, lc: LayerContext, layer_number: int):
        super().__init__()
        name = f"layers.{layer_number}"
        self.lc, self.ops, self.hidden_dropout = lc, lc.ops, m.hidden_dropout
        self.input_norm = Norm(m, lc, f"{name}.input_norm")
        self.attention = SelfAttention(m, lc, f"{name}.attention", layer_number)
        self.post_attention_norm = Norm(m, lc, f"{name}.post_attention_norm")
        self.mlp = MLP(m, lc, f"{name}.mlp")
        # The last residual add goes into the next layer's input norm: a recipe whose norm adds it (coat) returns it
        # un-added (a PendingAdd for that norm). Set by the model for every layer but the last of its chunk.
        self.defer_residual = False

    def _dropout(self, h):
        if self.training and self.hidden_dropout > 0:
            with _dropout_region(self.lc, inside_tp=False, p=self.hidden_dropout):
                h = F.dropout(h, self.hidden_dropout, training=True)
        return h

    def forward(self, x, rope=None, attention_mask=None):
        """x: [s, b, h], or the previous layer's output with its last residual add left to this layer's input norm.
        Returns [s, b, h], or with `defer_residual` what the recipe leaves to the next layer's input norm."""
        x, h = self.ops.norm(self.input_norm, x)
        x = self.ops.residual_add(x, self._dropout(self.attention(h, rope, attention_mask)), into_norm=True)
        x, h = self.ops.norm(self.post_attention_norm, x)
        return self.ops.residual_add(x, self._dropout(self.mlp(h)), into_norm=self.defer_residual)
