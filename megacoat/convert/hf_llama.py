"""megacoat <-> Hugging Face `LlamaForCausalLM` (RMSNorm, RoPE rotate-half, SwiGLU, GQA, no biases).

Both sides use rotate-half RoPE, so no row permutation is needed; only the fused tensors change
shape: megacoat's QKV rows are grouped per query group `[q heads of the group, k, v]`, HF keeps
q_proj/k_proj/v_proj apart; megacoat's fc1 is `[gate; up]`.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..checkpoint.format import CheckpointError
from ..config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "LlamaModel")  # config.json's architectures it converts
# The LM-head model's names: the base model's under BASE_PREFIX, plus lm_head.weight unless tied
# (config.json's tie_word_embeddings, TIED_DEFAULT where it is absent, as transformers reads it).
BASE_PREFIX, EMBEDDING, TIED_DEFAULT = "model.", "model.embed_tokens.weight", False
LLAMA_SHAPE = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False)


def check_convertible(m: ModelConfig) -> None:
    bad = [f"--{k.replace('_', '-')} {getattr(m, k)} (Llama: {v})" for k, v in LLAMA_SHAPE.items() if getattr(m, k) != v]
    if bad:
        raise CheckpointError("this model is not Llama-shaped: " + "; ".join(bad))


def split_qkv(qkv: torch.Tensor, m: ModelConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megacoat fused QKV (rows or bias) -> HF q, k, v."""
    g, per, d = m.num_query_groups, m.num_attention_heads // m.num_query_groups, m.kv_channels
    x = qkv.reshape(g, per + 2, d, *qkv.shape[1:])
    q = x[:, :per].reshape(g * per * d, *qkv.shape[1:])
    k = x[:, per].reshape(g * d, *qkv.shape[1:])
    v = x[:, per + 1].reshape(g * d, *qkv.shape[1:])
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    g, per, d = m.num_query_groups, m.num_attention_heads // m.num_query_groups, m.kv_channels
    rest = q.shape[1:]
    x = torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return x.reshape(g * (per + 2) * d, *rest)


def to_hf(m: ModelConfig, vocab_size: int, t: Dict[str, torch.Tensor], dtype: torch.dtype) -> Tuple[dict, dict]:
    check_convertible(m)
    out = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"], "model.norm.weight": t["final_norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = t["output_layer.weight"]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        q, k, v = split_qkv(t[f"{src}.attention.qkv.weight"], m)
        gate, up = t[f"{src}.mlp.fc1.weight"].chunk(2, dim=0)
        out.update({f"{dst}.input_layernorm.weight": t[f"{src}.input_norm.weight"],
                    f"{dst}.self_attn.q_proj.weight": q, f"{dst}.self_attn.k_proj.weight": k,
                    f"{dst}.self_attn.v_proj.weight": v,
                    f"{dst}.self_attn.o_proj.weight": t[f"{src}.attention.proj.weight"],
                    f"{dst}.post_attention_layernorm.weight": t[f"{src}.post_attention_norm.weight"],
                    f"{dst}.mlp.gate_proj.weight": gate, f"{dst}.mlp.up_proj.weight": up,
                    f"{dst}.mlp.down_proj.weight": t[f"{src}.mlp.fc2.weight"]})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
              "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
              "num_key_value_heads": m.num_query_groups, "head_dim": m.kv_channels, "hidden_act": "silu",
              "max_position_embeddings": m.max_position_embeddings, "rms_norm_eps": m.norm_epsilon,
              "rope_theta": m.rotary_base, "rope_parameters": {"rope_theta": m.rotary_base, "rope_type": "default"},
              "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_bias": False,
              "mlp_bias": False, "attention_dropout": m.attention_dropout, "initializer_range": m.init_method_std,
              "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", "")}
    return config, {k: v.to(dtype).contiguous() for k, v in out.items()}


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"RoPE type {rope_type!r} ({params}) is not supported by megacoat (plain RoPE only); "
                              "converting would give a silently different model")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def from_hf(c: dict, t: Dict[str, torch.Tensor]) -> Tuple[ModelConfig, int, Dict[str, torch.Tensor]]:
    unsupported = [(k, c.get(k)) for k, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
                   if c.get(k, ok) != ok]
    if unsupported:
        raise CheckpointError("unsupported Llama features: " + ", ".join(f"{k}={v!r}" for k, v in unsupported))
    heads, groups = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    tied = c.get("tie_word_embeddings", TIED_DEFAULT)
    max_pos = c.get("max_position_embeddings", 2048)
    m = ModelConfig(num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
                    num_attention_heads=heads, group_query_attention=groups != heads,
                    num_query_groups=groups if groups != heads else None, kv_channels=head_dim,
                    seq_length=min(max_pos, 4096), max_position_embeddings=max_pos, norm_epsilon=c.get("rms_norm_eps", 1e-6),
                    rotary_base=_rope_theta(c), untie_embeddings_and_output_weights=not tied,
                    init_method_std=c.get("initializer_range", 0.02),
                    attention_dropout=c.get("attention_dropout", 0.0), hidden_dropout=0.0, **LLAMA_SHAPE)
    m.num_query_groups = groups
    out = {"embedding.word_embeddings.weight": t["model.embed_tokens.weight"], "final_norm.weight": t["model.norm.weight"]}
    if not tied:
        out["output_layer.weight"] = t["lm_head.weight"]
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        a = f"{src}.self_attn"
        out.update({f"{dst}.input_norm.weight": t[f"{src}.input_layernorm.weight"],
                    f"{dst}.attention.qkv.weight": fuse_qkv(t[f"{a}.q_proj.weight"], t[f"{a}.k_proj.weight"],
                                                            t[f"{a}.v_proj.weight"], m),
                    f"{dst}.attention.proj.weight": t[f"{a}.o_proj.weight"],
                    f"{dst}.post_attention_norm.weight": t[f"{src}.post_attention_layernorm.weight"],
                    f"{dst}.mlp.fc1.weight": torch.cat([t[f"{src}.mlp.gate_proj.weight"], t[f"{src}.mlp.up_proj.weight"]]),
                    f"{dst}.mlp.fc2.weight": t[f"{src}.mlp.down_proj.weight"]})
    return m, c["vocab_size"], out
