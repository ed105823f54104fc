"""Megatron-LM checkpoints <-> megacoat checkpoints (behind tools/checkpoint/convert.py).

Megatron -> megacoat: reads the `torch` format (any TP/PP/virtual PP, local or TransformerEngine
layer spec) or the `torch_dist` format, takes the model flags from the saved args (what
Megatron's `--use-checkpoint-args` does), refuses variants megacoat cannot represent, and
writes a weights-only megacoat checkpoint whose config carries the model and tokenizer flags and
whose metadata records the source (`extra.source`: Megatron format and layer spec).
megacoat -> Megatron: writes the `torch` format at a target TP/PP with args that Megatron's
`--use-checkpoint-args` reads, in the layer spec asked for, else the one recorded at import, else
TransformerEngine's (Megatron's default).
Iteration and consumed samples are carried over only when asked (`carry_iteration`); otherwise
Megatron gets a `release` checkpoint and megacoat iteration 0.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch

from ..checkpoint.checkpointer import copy_tokenizer, point_at_tokenizer_copy
from ..checkpoint.collect import MODEL_KIND
from ..checkpoint.format import FORMAT_NAME, METADATA_FILE, CheckpointError, iteration_dir_name
from ..checkpoint.model_io import model_config_of, open_checkpoint, write_model_checkpoint
from ..config import MegacoatConfig
from .megatron_dist import is_dist_format, read_dist_checkpoint
from .megatron_model import EXTRA_STATE, args_from_model_config, megacoat_to_megatron as to_megatron_names, \
    megatron_to_megacoat as to_megacoat_names, model_config_from_args, padded_vocab
from .megatron_torch import is_torch_format, read_torch_checkpoint, resolve_iteration_dir, write_torch_checkpoint
from .target import cast_weights, check_checkpoint_target, check_target_pp, check_target_tp

# Megatron tokenizer types megacoat builds itself (same names, same semantics).
SHARED_TOKENIZERS = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                     "GPTSentencePieceTokenizer", "NullTokenizer")


@dataclass
class TokenizerFlags:
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None  # NullTokenizer: ids 0..N-1, eod N


DEFAULT_SPEC = "transformer_engine"  # Megatron's default --transformer-impl


def read_megatron(load_dir: str):
    """(common state with 'args', full TP=1 Megatron tensors, format name, layer spec or None if unknown)."""
    iter_dir = resolve_iteration_dir(load_dir)
    if _is_megacoat_checkpoint(iter_dir):  # the same tracker file name and a metadata.json, as torch_dist has
        raise CheckpointError(f"{load_dir} is a megacoat checkpoint, not a Megatron-LM one: convert it with "
                              "--load-format megacoat")
    if is_torch_format(iter_dir):
        common, full, spec, _ = read_torch_checkpoint(iter_dir)  # the spec its parameter names belong to
        fmt = "torch"
    elif is_dist_format(iter_dir):
        common, full = read_dist_checkpoint(iter_dir)
        fmt = "torch_dist"
        spec = getattr(common.get("args"), "transformer_impl", None)  # torch_dist keys use TE names for both specs
        spec = spec if spec in EXTRA_STATE else None
    else:
        raise CheckpointError(f"{iter_dir}: neither mp_rank_* directories (torch format) nor a distributed "
                              "checkpoint (.metadata, torch_dist format)")
    if common.get("args") is None:
        raise CheckpointError(f"{iter_dir}: the checkpoint saved no args; megacoat takes the model flags from them")
    return common, full, fmt, spec


def _is_megacoat_checkpoint(iter_dir: str) -> bool:
    try:
        with open(os.path.join(iter_dir, METADATA_FILE)) as f:
            return json.load(f).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):  # no such file, not JSON, not an object: not megacoat's
        return False


def recorded_spec(meta: dict) -> Optional[str]:
    """The Megatron layer spec a megacoat checkpoint was imported from (None: not from Megatron, or unknown)."""
    spec = ((meta.get("extra") or {}).get("source") or {}).get("megatron_transformer_impl")
    return spec if spec in EXTRA_STATE else None


# File names of the tokenizer copy recent Megatron versions keep in <iteration dir>/tokenizer/.
SAVED_TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab.json", "merges.txt"), "SentencePieceTokenizer": "tokenizer.model",
                         "GPTSentencePieceTokenizer": "tokenizer.model", "HuggingFaceTokenizer": ""}


def _saved_tokenizer(kind: str, args, iter_dir: str) -> TokenizerFlags:
    """The args' tokenizer files; where they do not exist here, the copy inside the checkpoint."""
    f = TokenizerFlags(kind, getattr(args, "tokenizer_model", None), getattr(args, "vocab_file", None),
                       getattr(args, "merge_file", None), getattr(args, "vocab_size", None))
    inside = os.path.join(iter_dir, "tokenizer")
    names = SAVED_TOKENIZER_FILES.get(kind)
    if names is None or not os.path.isdir(inside):
        return f
    if kind == "GPT2BPETokenizer":
        if not (f.vocab_file and os.path.isfile(f.vocab_file) and f.merge_file and os.path.isfile(f.merge_file)):
            f.vocab_file, f.merge_file = (os.path.join(inside, n) for n in names)
    elif not (f.tokenizer_model and os.path.exists(f.tokenizer_model)):
        f.tokenizer_model = os.path.join(inside, names) if names else inside
    return f


def _tokenizer_from(flags: TokenizerFlags, args, log, iter_dir: str = ""):
    """The tokenizer given on the command line, else the one the Megatron args name if its files exist here
    (or in the checkpoint's own tokenizer/ copy)."""
    from ..data.tokenizer import TokenizerError, build_tokenizer_by_type
    f = flags
    if f.tokenizer_type is None:
        kind = getattr(args, "tokenizer_type", None)
        f = _saved_tokenizer(kind, args, iter_dir)
        if kind not in SHARED_TOKENIZERS:
            if kind is not None:
                log(f"note: Megatron tokenizer {kind!r} has no megacoat equivalent; pass --tokenizer-type and its "
                    "files to convert.py, or train with ids only (NullTokenizer)")
            return None
        try:
            return build_tokenizer_by_type(f.tokenizer_type, f.tokenizer_model, f.vocab_size, f.vocab_file, f.merge_file)
        except TokenizerError as e:
            log(f"note: the checkpoint's tokenizer ({kind}) is not usable here ({e}); pass --tokenizer-* flags to "
                "copy it into the converted checkpoint")
            return None
    return build_tokenizer_by_type(f.tokenizer_type, f.tokenizer_model, f.vocab_size, f.vocab_file, f.merge_file)


def megatron_to_megacoat(load_dir: str, save_dir: str, tp: int = 1, dtype: Optional[torch.dtype] = None,
                         tokenizer: TokenizerFlags = TokenizerFlags(), true_vocab_size: Optional[int] = None,
                         carry_iteration: bool = False, log=print, force: bool = False, pp: int = 1) -> str:
    """A megacoat checkpoint of a Megatron one, laid out for TP=`tp` (any layout loads it; `pp` is only checked)."""
    check_checkpoint_target(save_dir, None, force)  # fail before reading a large checkpoint
    common, full, fmt, spec = read_megatron(load_dir)
    args = common["args"]
    m = model_config_from_args(args, full)
    check_target_tp(tp, m)
    check_target_pp(pp, m.num_layers)
    tok = _tokenizer_from(tokenizer, args, log, resolve_iteration_dir(load_dir))
    rows = full["embedding.word_embeddings.weight"].shape[0]
    vocab = true_vocab_size or getattr(args, "true_vocab_size", None) or (tok.vocab_size if tok else None)
    if vocab is None:
        vocab = rows
        log(f"note: vocabulary size unknown (no tokenizer): keeping all {rows} embedding rows, Megatron's padding "
            "included; pass --true-vocab-size or the tokenizer flags to drop the padding")
    if vocab > rows:
        raise CheckpointError(f"the vocabulary ({vocab}) is larger than the checkpoint's embedding ({rows} rows): "
                              "the tokenizer or --true-vocab-size does not belong to this checkpoint")
    tensors = to_megacoat_names(m, vocab, full)
    tensors = cast_weights(tensors, dtype)
    iteration = int(common.get("iteration", 0) or 0) if carry_iteration else 0
    check_checkpoint_target(save_dir, iteration, force)
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0) if carry_iteration else 0
    cfg = MegacoatConfig()
    cfg.model = m
    if tok is None:
        cfg.data.tokenizer_type, cfg.data.vocab_size = "NullTokenizer", vocab - 1
    else:
        point_at_tokenizer_copy(cfg.data, tok, os.path.join(save_dir, iteration_dir_name(iteration)))

    source = {"megatron_format": fmt, "megatron_transformer_impl": spec}  # read back by megacoat_to_megatron

    def extra(partial: str) -> dict:
        if tok is None:
            return {"tokenizer": {"type": "NullTokenizer", "vocab_size": vocab}, "source": source}
        return dict(copy_tokenizer(tok, partial), source=source)

    out = write_model_checkpoint(save_dir, m, vocab, tensors, tp=tp, iteration=iteration, cfg=cfg,
                                 extra_files=extra, consumed_samples=consumed)
    log(f"Megatron {fmt} checkpoint ({spec or 'unknown'} layer spec) -> megacoat: {m.num_layers} layers, "
        f"hidden {m.hidden_size}, vocab {vocab}"
        + (f", iteration {iteration}, consumed samples {consumed}" if carry_iteration else ""))
    return out


def _megatron_tokenizer_args(info: dict, ckpt_dir: str, save_dir: str) -> dict:
    """Megatron's tokenizer args for the tokenizer saved in a megacoat checkpoint (files copied to save_dir)."""
    kind = info.get("type")
    if kind == "NullTokenizer":
        return {"tokenizer_type": "NullTokenizer", "vocab_size": info["vocab_size"] - 1}
    if kind not in SHARED_TOKENIZERS or not info.get("file"):
        return {}
    dst = os.path.join(os.path.abspath(save_dir), "tokenizer")
    os.makedirs(dst, exist_ok=True)
    src_dir = os.path.dirname(os.path.join(ckpt_dir, info["file"]))
    for name in os.listdir(src_dir):
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst, name))
    main = os.path.join(dst, os.path.basename(info["file"]))
    if kind == "GPT2BPETokenizer":
        return {"tokenizer_type": kind, "vocab_file": main,
                "merge_file": os.path.join(dst, os.path.basename(info["companion_files"][0]))}
    return {"tokenizer_type": kind, "tokenizer_model": dst if kind == "HuggingFaceTokenizer" else main}


def megacoat_to_megatron(load_dir: str, save_dir: str, tp: int = 1, pp: int = 1, dtype: Optional[torch.dtype] = None,
                         spec: Optional[str] = None, carry_iteration: bool = False, log=print,
                         force: bool = False) -> str:
    """`spec` (local or transformer_engine): the layer spec whose parameter names Megatron gets; None
    keeps the one the checkpoint was imported from Megatron with, else Megatron's default."""
    check_checkpoint_target(save_dir, None, force)
    reader = open_checkpoint(load_dir)
    ckpt_dir = reader.path
    try:
        m = model_config_of(reader)
        vocab = reader.meta["vocab_size"]
        tensors = {name: reader.canonical(MODEL_KIND, name) for name in reader.names()}
        train_state = reader.common().get("train_state", {})
        tok_info = (reader.meta.get("extra") or {}).get("tokenizer", {})
        recorded = recorded_spec(reader.meta)
    finally:
        reader.close()
    if spec is None:
        spec, why = (recorded, "recorded when the checkpoint was imported") if recorded else \
            (DEFAULT_SPEC, "Megatron's default; --megatron-transformer-impl local for the local spec")
    else:
        why = "asked for"
    check_target_tp(tp, m)
    check_target_pp(pp, m.num_layers)
    tensors = cast_weights(tensors, dtype)
    dtype = dtype or next(iter(tensors.values())).dtype
    padded = padded_vocab(vocab, m, tp)
    full = {k: v.to(dtype) for k, v in to_megatron_names(m, padded, tensors).items()}
    iteration = int(train_state.get("iteration", 0)) if carry_iteration else None
    check_checkpoint_target(save_dir, iteration or 0, force)
    extra = dict(_megatron_tokenizer_args(tok_info, ckpt_dir, save_dir), true_vocab_size=vocab,
                 params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                 iteration=iteration or 0,
                 consumed_train_samples=int(train_state.get("consumed_samples", 0)) if carry_iteration else 0)
    args = args_from_model_config(m, padded, tp, pp, spec, extra)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration or 0}
    out = write_torch_checkpoint(save_dir, full, m.num_layers, tp, pp, common, gated=m.activation == "swiglu",
                                 tied=not m.untie_embeddings_and_output_weights, spec=spec, iteration=iteration)
    log(f"megacoat -> Megatron torch format, {spec} layer spec ({why}), TP {tp}, PP {pp}: {out}")
    return out
