"""megatron-core `GPTModel` weights and args <-> megacoat's model config and canonical tensors.

"Full" Megatron tensors here are a TP=1, PP=1 state dict of the local layer spec with global
layer numbers (`decoder.layers.7.self_attention.linear_qkv.weight`) and the padded vocabulary.
megacoat's layout is Megatron's in everything that matters, so the mapping is names only:
- QKV rows per query group `[q heads of the group, k, v]` in both (TP splits whole groups);
- SwiGLU `linear_fc1` is `[gate; up]` in both; at TP > 1 Megatron's rank r holds `[gate_r; up_r]`;
- RoPE is rotate-half in both (Megatron's default, not `--rotary-interleaved`);
- the vocabulary is padded in Megatron's files, unpadded in megacoat's canonical form.
TransformerEngine layer specs fuse the norms into the next linear (`linear_qkv.layer_norm_weight`
instead of `input_layernorm.weight`); `te_to_local` / `local_to_te` rename them.
"""
from __future__ import annotations

import argparse
import re
from typing import Dict, List, Optional, Tuple

import torch

from ..checkpoint.format import CheckpointError
from ..config import ModelConfig, resolve_model_defaults
from ..model.gpt import padded_vocab_size

# (megacoat suffix, megatron suffix) inside a layer; one table for both directions.
LAYER_NAMES = [
    ("input_norm.weight", "input_layernorm.weight"), ("input_norm.bias", "input_layernorm.bias"),
    ("attention.qkv.weight", "self_attention.linear_qkv.weight"), ("attention.qkv.bias", "self_attention.linear_qkv.bias"),
    ("attention.proj.weight", "self_attention.linear_proj.weight"),
    ("attention.proj.bias", "self_attention.linear_proj.bias"),
    ("post_attention_norm.weight", "pre_mlp_layernorm.weight"), ("post_attention_norm.bias", "pre_mlp_layernorm.bias"),
    ("mlp.fc1.weight", "mlp.linear_fc1.weight"), ("mlp.fc1.bias", "mlp.linear_fc1.bias"),
    ("mlp.fc2.weight", "mlp.linear_fc2.weight"), ("mlp.fc2.bias", "mlp.linear_fc2.bias"),
]
GLOBAL_NAMES = [
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("embedding.position_embeddings.weight", "embedding.position_embeddings.weight"),
    ("final_norm.weight", "decoder.final_layernorm.weight"), ("final_norm.bias", "decoder.final_layernorm.bias"),
    ("output_layer.weight", "output_layer.weight"),
]
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
# TransformerEngine spec name -> local spec name (per layer).
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
LOCAL_TO_TE = {v: k for k, v in TE_NAMES.items()}
# Modules whose `_extra_state` key a strict Megatron load expects (None = no FP8 metadata).
EXTRA_STATE = {"local": ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"],
               "transformer_engine": ["self_attention.linear_qkv", "self_attention.linear_proj",
                                      "self_attention.core_attention", "mlp.linear_fc1", "mlp.linear_fc2"]}

LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def te_to_local(name: str) -> str:
    m = LAYER_KEY.match(name)
    if m and m.group(2) in TE_NAMES:
        return f"decoder.layers.{m.group(1)}.{TE_NAMES[m.group(2)]}"
    return name


def local_to_te(name: str) -> str:
    m = LAYER_KEY.match(name)
    if m and m.group(2) in LOCAL_TO_TE:
        return f"decoder.layers.{m.group(1)}.{LOCAL_TO_TE[m.group(2)]}"
    return name


# ------------------------------------------------------------------------------ args -> config
def _get(args, *names, default=None):
    for n in names:
        v = getattr(args, n, None)
        if v is not None:
            return v
    return default


def unsupported_features(args) -> List[str]:
    """Every Megatron feature in `args` megacoat's model cannot represent exactly (empty: convertible)."""
    a = lambda n, d=None: getattr(args, n, d)  # noqa: E731
    bad = []
    if a("use_legacy_models"):
        bad.append("legacy (non-megatron-core) model classes (--use-legacy-models)")
    if a("num_experts") or a("num_moe_experts"):
        bad.append(f"mixture of experts (--num-experts {a('num_experts') or a('num_moe_experts')})")
    if a("multi_latent_attention"):
        bad.append("multi-latent attention (--multi-latent-attention, MLA)")
    if a("qk_layernorm"):
        bad.append("QK layernorm (--qk-layernorm)")
    if a("mtp_num_layers"):
        bad.append(f"multi-token prediction (--mtp-num-layers {a('mtp_num_layers')})")
    for n, what in (("heterogeneous_layers_config_path", "heterogeneous layers"),
                    ("hybrid_override_pattern", "hybrid Mamba layers"), ("hybrid_layer_pattern", "hybrid Mamba layers"),
                    ("window_size", "sliding-window attention (--window-size)"),
                    ("experimental_attention_variant", "experimental attention variants"),
                    ("rotary_seq_len_interpolation_factor", "RoPE sequence interpolation"),
                    ("no_rope_freq", "layers without RoPE (--no-rope-freq)")):
        if a(n) is not None and a(n) is not False:
            bad.append(f"{what} ({n}={a(n)!r})")
    for n, what in (("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm"),
                    ("apply_layernorm_1p", "zero-centred norm weights (--apply-layernorm-1p)"),
                    ("layernorm_zero_centered_gamma", "zero-centred norm weights"),
                    ("squared_relu", "squared-ReLU MLP (--squared-relu)"), ("quick_geglu", "quick-GeGLU MLP (--quick-geglu)"),
                    ("attention_output_gate", "gated attention output"), ("use_rope_scaling", "Llama-3 RoPE scaling (--use-rope-scaling)"),
                    ("rotary_interleaved", "interleaved RoPE (--rotary-interleaved; megacoat rotates halves)")):
        if a(n):
            bad.append(what)
    if a("softmax_type", "vanilla") not in ("vanilla", None):
        bad.append(f"attention softmax {a('softmax_type')!r}")
    if float(a("rotary_percent", 1.0) or 1.0) != 1.0 and a("position_embedding_type") == "rope":
        bad.append(f"partial RoPE (--rotary-percent {a('rotary_percent')})")
    pos = a("position_embedding_type", "learned_absolute")
    if pos not in ("rope", "learned_absolute"):
        bad.append(f"position embedding {pos!r} (megacoat: rope, learned_absolute)")
    if a("add_qkv_bias") and not a("add_bias_linear", True):
        bad.append("QKV-only biases (--add-qkv-bias without linear biases)")
    if a("normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"):
        bad.append(f"normalization {a('normalization')!r}")
    if not a("swiglu") and not (a("add_bias_linear", True) and a("bias_gelu_fusion", True)):
        bad.append("exact (erf) GELU: Megatron uses the tanh GELU only through its fused bias-GELU (linear biases "
                   "and bias-GELU fusion on); megacoat's GELU is the tanh one")
    return bad


def model_config_from_args(args, full: Dict[str, torch.Tensor]) -> ModelConfig:
    """The `--use-checkpoint-args` model flags, checked against the tensors' shapes."""
    bad = unsupported_features(args)
    if bad:
        raise CheckpointError("this Megatron checkpoint uses features megacoat does not support: " + "; ".join(bad))
    heads = _get(args, "num_attention_heads")
    gqa = bool(_get(args, "group_query_attention", default=False))
    groups = _get(args, "num_query_groups") if gqa else None
    hidden = _get(args, "hidden_size")
    swiglu = bool(_get(args, "swiglu", default=False))
    fc2 = full["decoder.layers.0.mlp.linear_fc2.weight"]
    m = ModelConfig(
        num_layers=_get(args, "num_layers"), hidden_size=hidden, ffn_hidden_size=int(fc2.shape[1]),
        num_attention_heads=heads, group_query_attention=gqa, num_query_groups=groups,
        kv_channels=_get(args, "kv_channels", default=hidden // heads),
        seq_length=_get(args, "seq_length", default=_get(args, "max_position_embeddings")),
        max_position_embeddings=_get(args, "max_position_embeddings"),
        normalization=_get(args, "normalization", default="LayerNorm"),
        norm_epsilon=float(_get(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        position_embedding_type=_get(args, "position_embedding_type", default="learned_absolute"),
        rotary_base=float(_get(args, "rotary_base", default=10000)),
        activation="swiglu" if swiglu else "gelu", add_bias_linear=bool(_get(args, "add_bias_linear", default=True)),
        untie_embeddings_and_output_weights=bool(_get(args, "untie_embeddings_and_output_weights", default=False)),
        init_method_std=float(_get(args, "init_method_std", default=0.02)),
        attention_dropout=float(_get(args, "attention_dropout", default=0.1)),
        hidden_dropout=float(_get(args, "hidden_dropout", default=0.1)),
        make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", default=128)))
    if getattr(args, "disable_bias_linear", None) is not None:  # old spelling, as Megatron's own loader reads it
        m.add_bias_linear = not args.disable_bias_linear
    resolve_model_defaults(m)
    if m.max_position_embeddings < m.seq_length:
        if m.position_embedding_type == "rope":  # RoPE has no position table: only megacoat's cache size
            m.max_position_embeddings = m.seq_length
        else:  # learned positions: the table bounds the sequence
            m.seq_length = m.max_position_embeddings
    _check_shapes(m, full)
    return m


def _check_shapes(m: ModelConfig, full: Dict[str, torch.Tensor]) -> None:
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    want = (m.num_query_groups * (m.num_attention_heads // m.num_query_groups + 2) * m.kv_channels, m.hidden_size)
    if tuple(qkv.shape) != want:
        raise CheckpointError(f"linear_qkv.weight has shape {list(qkv.shape)}, but the saved args (heads "
                              f"{m.num_attention_heads}, query groups {m.num_query_groups}, kv channels "
                              f"{m.kv_channels}, hidden {m.hidden_size}) give {list(want)}")
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    if fc1.shape[0] != (2 if m.activation == "swiglu" else 1) * m.ffn_hidden_size:
        raise CheckpointError(f"linear_fc1.weight has {fc1.shape[0]} rows for ffn {m.ffn_hidden_size}: the saved "
                              f"--swiglu ({m.activation == 'swiglu'}) does not match the weights")
    layers = {int(LAYER_KEY.match(k).group(1)) for k in full if LAYER_KEY.match(k)}
    if layers != set(range(m.num_layers)):
        raise CheckpointError(f"the checkpoint holds layers {sorted(layers)[:3]}..{max(layers)} but --num-layers is "
                              f"{m.num_layers}")


def args_from_model_config(m: ModelConfig, padded_vocab: int, tp: int, pp: int, impl: str,
                           extra: Optional[dict] = None) -> argparse.Namespace:
    """The args Megatron's `--use-checkpoint-args` and `check_checkpoint_args` read."""
    rope = m.position_embedding_type == "rope"
    gelu_needs_bias = m.activation == "gelu" and not m.add_bias_linear
    if gelu_needs_bias:
        raise CheckpointError("Megatron computes the exact (erf) GELU when linear layers have no biases; megacoat's GELU "
                              "is the tanh approximation, so the Megatron model would differ. Convert a model with "
                              "--add-bias-linear or SwiGLU")
    ns = argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=m.num_query_groups != m.num_attention_heads,
        num_query_groups=m.num_query_groups, kv_channels=m.kv_channels, seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings, position_embedding_type=m.position_embedding_type,
        add_position_embedding=not rope, use_rotary_position_embeddings=rope, rotary_base=int(m.rotary_base)
        if float(m.rotary_base).is_integer() else m.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=False, normalization=m.normalization, norm_epsilon=m.norm_epsilon,
        layernorm_epsilon=m.norm_epsilon, swiglu=m.activation == "swiglu", squared_relu=False, quick_geglu=False,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_bias_linear, bias_gelu_fusion=m.add_bias_linear,
        bias_swiglu_fusion=True, untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_layernorm_1p=False, apply_query_key_layer_scaling=False, apply_residual_connection_post_layernorm=False,
        attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout, init_method_std=m.init_method_std,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, padded_vocab_size=padded_vocab,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=1, num_experts=None,
        multi_latent_attention=False, qk_layernorm=False, mtp_num_layers=None, spec=None, use_legacy_models=False,
        transformer_impl=impl, ckpt_format="torch", data_parallel_random_init=False, consumed_train_samples=0,
        consumed_valid_samples=0, iteration=0)
    for k, v in (extra or {}).items():
        setattr(ns, k, v)
    return ns


# ------------------------------------------------------------------------------ names
def megatron_to_megacoat(m: ModelConfig, vocab_size: int, full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Full Megatron tensors -> megacoat canonical tensors; every tensor must be used exactly once."""
    left = dict(full)
    out = {}

    def take(theirs: str, ours: str, required: bool = True) -> None:
        if theirs not in left:
            if required:
                raise CheckpointError(f"the Megatron checkpoint has no {theirs}")
            return
        t = left.pop(theirs)
        out[ours] = t[:vocab_size].contiguous() if theirs in VOCAB_ROWS else t

    bias = m.add_bias_linear
    layer_norm_bias = m.normalization == "LayerNorm"
    for i in range(m.num_layers):
        for ours, theirs in LAYER_NAMES:
            need = (not ours.endswith(".bias")) or (bias if "norm" not in ours else layer_norm_bias)
            if need:
                take(f"decoder.layers.{i}.{theirs}", f"layers.{i}.{ours}")
    take("embedding.word_embeddings.weight", "embedding.word_embeddings.weight")
    if m.position_embedding_type == "learned_absolute":
        take("embedding.position_embeddings.weight", "embedding.position_embeddings.weight")
    take("decoder.final_layernorm.weight", "final_norm.weight")
    if layer_norm_bias:
        take("decoder.final_layernorm.bias", "final_norm.bias")
    if m.untie_embeddings_and_output_weights:
        take("output_layer.weight", "output_layer.weight")
    else:
        left.pop("output_layer.weight", None)  # a pipeline's last-stage copy of the tied embedding
    if left:
        raise CheckpointError(f"the Megatron checkpoint holds tensors megacoat would drop ({', '.join(sorted(left)[:6])}"
                              f"{' ...' if len(left) > 6 else ''}): an unsupported model variant")
    if rows_short := [k for k in VOCAB_ROWS if k in full and full[k].shape[0] < vocab_size]:
        raise CheckpointError(f"{rows_short[0]} has {full[rows_short[0]].shape[0]} rows, fewer than the vocabulary "
                              f"({vocab_size})")
    return out


def megacoat_to_megatron(m: ModelConfig, padded_vocab: int, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """megacoat canonical tensors -> full Megatron tensors (vocabulary padded with zero rows)."""
    ours_to_theirs = dict(GLOBAL_NAMES)
    out = {}
    for name, t in tensors.items():
        lm = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if lm:
            theirs = dict(LAYER_NAMES).get(lm.group(2))
            key = f"decoder.layers.{lm.group(1)}.{theirs}" if theirs else None
        else:
            key = ours_to_theirs.get(name)
        if key is None:
            raise CheckpointError(f"megacoat tensor {name} has no Megatron counterpart")
        if key in VOCAB_ROWS and t.shape[0] < padded_vocab:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        out[key] = t
    return out


# ------------------------------------------------------------------------------ tensor parallel
def tp_rule(name: str, gated: bool) -> Tuple[Optional[int], bool]:
    """(split dim or None if replicated, fused [gate; up] halves) of a Megatron tensor under TP."""
    base = re.sub(r"^decoder\.layers\.\d+\.", "", name)
    if name in VOCAB_ROWS or base in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return 0, False
    if base in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        return 0, gated
    if base in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1, False
    return None, False


def split_tp(name: str, t: torch.Tensor, tp: int, gated: bool) -> List[torch.Tensor]:
    dim, fused = tp_rule(name, gated)
    if dim is None or tp == 1:
        return [t] * tp
    if t.shape[dim] % (tp * (2 if fused else 1)):
        raise CheckpointError(f"{name}: {t.shape[dim]} rows/columns do not split over TP {tp}")
    if fused:
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u]).contiguous() for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return [p.contiguous() for p in t.chunk(tp, dim=dim)]


def merge_tp(name: str, parts: List[torch.Tensor], gated: bool) -> torch.Tensor:
    dim, fused = tp_rule(name, gated)
    if dim is None or len(parts) == 1:
        return parts[0]
    if fused:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def padded_vocab(vocab_size: int, m: ModelConfig, tp: int) -> int:
    return padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
