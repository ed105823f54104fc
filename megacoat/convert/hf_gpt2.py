"""megacoat <-> Hugging Face `GPT2LMHeadModel` (LayerNorm, GELU tanh, learned positions, biases).

HF GPT-2 uses Conv1D layers: weights are stored [in, out], the transpose of nn.Linear. Its
c_attn output is [q; k; v] (each all heads); megacoat groups rows per head: [q_h, k_h, v_h].
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..checkpoint.format import CheckpointError
from ..config import ModelConfig
from .hf_llama import fuse_qkv, split_qkv

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")  # config.json's architectures it converts
# The LM-head model's names: the base model's under BASE_PREFIX, plus lm_head.weight unless tied
# (config.json's tie_word_embeddings, TIED_DEFAULT where it is absent, as transformers reads it).
BASE_PREFIX, EMBEDDING, TIED_DEFAULT = "transformer.", "transformer.wte.weight", True
GPT2_SHAPE = dict(normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute",
                  add_bias_linear=True)

# Per-layer tensors other than the fused QKV: (megacoat name, HF name, stored transposed in HF).
# One table for both directions, so they cannot drift apart.
_LAYER_TENSORS = [
    ("input_norm.weight", "ln_1.weight", False), ("input_norm.bias", "ln_1.bias", False),
    ("attention.proj.weight", "attn.c_proj.weight", True), ("attention.proj.bias", "attn.c_proj.bias", False),
    ("post_attention_norm.weight", "ln_2.weight", False), ("post_attention_norm.bias", "ln_2.bias", False),
    ("mlp.fc1.weight", "mlp.c_fc.weight", True), ("mlp.fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.fc2.weight", "mlp.c_proj.weight", True), ("mlp.fc2.bias", "mlp.c_proj.bias", False),
]


def _map_layer(t: Dict[str, torch.Tensor], src: str, dst: str, to_hf_names: bool) -> Dict[str, torch.Tensor]:
    out = {}
    for ours, theirs, transposed in _LAYER_TENSORS:
        a, b = (ours, theirs) if to_hf_names else (theirs, ours)
        x = t[f"{src}.{a}"]
        out[f"{dst}.{b}"] = x.t() if transposed else x
    return out


def check_convertible(m: ModelConfig) -> None:
    bad = [f"--{k.replace('_', '-')} {getattr(m, k)} (GPT-2: {v})" for k, v in GPT2_SHAPE.items() if getattr(m, k) != v]
    if m.num_query_groups != m.num_attention_heads:
        bad.append("grouped-query attention (GPT-2 has none)")
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        bad.append(f"--kv-channels {m.kv_channels} (GPT-2: hidden / heads)")
    if bad:
        raise CheckpointError("this model is not GPT-2-shaped: " + "; ".join(bad))


def to_hf(m: ModelConfig, vocab_size: int, t: Dict[str, torch.Tensor], dtype: torch.dtype) -> Tuple[dict, dict]:
    check_convertible(m)
    out = {"transformer.wte.weight": t["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": t["final_norm.weight"], "transformer.ln_f.bias": t["final_norm.bias"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = t["output_layer.weight"]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}", f"transformer.h.{i}"
        qkv_w = torch.cat(split_qkv(t[f"{src}.attention.qkv.weight"], m))
        qkv_b = torch.cat(split_qkv(t[f"{src}.attention.qkv.bias"], m))
        out.update({f"{dst}.attn.c_attn.weight": qkv_w.t(), f"{dst}.attn.c_attn.bias": qkv_b})
        out.update(_map_layer(t, src, dst, to_hf_names=True))
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
              "n_positions": m.max_position_embeddings, "n_embd": m.hidden_size, "n_layer": m.num_layers,
              "n_head": m.num_attention_heads, "n_inner": m.ffn_hidden_size, "activation_function": "gelu_new",
              "layer_norm_epsilon": m.norm_epsilon, "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout,
              "attn_pdrop": m.attention_dropout, "initializer_range": m.init_method_std,
              "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "scale_attn_weights": True,
              "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", "")}
    return config, {k: v.to(dtype).contiguous() for k, v in out.items()}


def from_hf(c: dict, t: Dict[str, torch.Tensor]) -> Tuple[ModelConfig, int, Dict[str, torch.Tensor]]:
    unsupported = [(k, c.get(k)) for k, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                                               ("add_cross_attention", False)) if c.get(k, ok) != ok]
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        unsupported.append(("activation_function", c["activation_function"]))
    if unsupported:
        raise CheckpointError("unsupported GPT-2 features: " + ", ".join(f"{k}={v!r}" for k, v in unsupported))
    h, heads = c["n_embd"], c["n_head"]
    tied = c.get("tie_word_embeddings", TIED_DEFAULT)
    m = ModelConfig(num_layers=c["n_layer"], hidden_size=h, ffn_hidden_size=c.get("n_inner") or 4 * h,
                    num_attention_heads=heads, kv_channels=h // heads, seq_length=c["n_positions"],
                    max_position_embeddings=c["n_positions"], norm_epsilon=c.get("layer_norm_epsilon", 1e-5),
                    untie_embeddings_and_output_weights=not tied, init_method_std=c.get("initializer_range", 0.02),
                    attention_dropout=c.get("attn_pdrop", 0.1), hidden_dropout=c.get("resid_pdrop", 0.1), **GPT2_SHAPE)
    m.num_query_groups = heads
    out = {"embedding.word_embeddings.weight": t["transformer.wte.weight"],
           "embedding.position_embeddings.weight": t["transformer.wpe.weight"],
           "final_norm.weight": t["transformer.ln_f.weight"], "final_norm.bias": t["transformer.ln_f.bias"]}
    if not tied:
        out["output_layer.weight"] = t["lm_head.weight"]
    for i in range(m.num_layers):
        src, dst = f"transformer.h.{i}", f"layers.{i}"
        qkv_w = t[f"{src}.attn.c_attn.weight"].t().chunk(3, dim=0)
        qkv_b = t[f"{src}.attn.c_attn.bias"].chunk(3, dim=0)
        out.update({f"{dst}.attention.qkv.weight": fuse_qkv(*qkv_w, m),
                    f"{dst}.attention.qkv.bias": fuse_qkv(*qkv_b, m)})
        out.update(_map_layer(t, src, dst, to_hf_names=False))
    return m, c["vocab_size"], {k: v.contiguous() for k, v in out.items()}
