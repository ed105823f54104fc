"""Model FLOPs for throughput and MFU figures.

Counted per token for forward + backward (3x the forward):
- every matrix multiply with a weight: 6 * (weight elements), output layer included,
  embedding lookups excluded (they are not multiplies);
- causal attention: QK^T and AV are 2 * 2 * s * d_attn per token forward, halved because
  only the lower triangle is computed: 6 * s * d_attn * layers for forward + backward.
This is the usual convention (6 * params * tokens + attention term), with the embedding table left
out because no FLOPs are spent on it.
"""
from __future__ import annotations

from ..config import ModelConfig


def matmul_params(m: ModelConfig, padded_vocab: int) -> int:
    h, d = m.hidden_size, m.kv_channels
    q = m.num_attention_heads * d
    kv = 2 * m.num_query_groups * d
    attn = h * (q + kv) + q * h
    mlp_in = h * m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    mlp = mlp_in + m.ffn_hidden_size * h
    return m.num_layers * (attn + mlp) + padded_vocab * h


def flops_per_token(m: ModelConfig, padded_vocab: int, seq_length: int) -> float:
    attn = 6.0 * seq_length * m.num_attention_heads * m.kv_channels * m.num_layers
    return 6.0 * matmul_params(m, padded_vocab) + attn
