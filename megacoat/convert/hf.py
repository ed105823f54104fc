"""Hugging Face directories (config.json + weights) <-> megacoat checkpoints, Llama and GPT-2.

Every unsupported feature raises CheckpointError naming it: a conversion never produces a
silently different model. HF weights that the mapping did not consume are an error too.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from ..checkpoint.format import TOKENIZER_DIR, CheckpointError, iteration_dir_name, resolve_checkpoint_dir
from ..checkpoint.model_io import load_tokenizer, read_model_tensors, write_model_checkpoint
from ..config import MegacoatConfig
from . import hf_gpt2, hf_llama
from .hf_files import HFWeights, read_config, read_weights, staged_hf_dir, unused_weights
from .target import cast_weights, check_checkpoint_target, check_hf_target, check_target_pp, check_target_tp

FAMILIES = {"llama": hf_llama, "gpt2": hf_gpt2}
# Buffers some HF checkpoints carry that are not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SENTENCEPIECE_FILE = "tokenizer.model"  # what the export writes for a SentencePiece tokenizer
OUTPUT_LAYER = "lm_head.weight"
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def family_of_hf(config: dict) -> str:
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise CheckpointError(f"Hugging Face model_type {kind!r} is not supported; megacoat converts "
                              f"{sorted(FAMILIES)} (LlamaForCausalLM, GPT2LMHeadModel)")
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
        raise CheckpointError(f"config.json describes a quantized model (quantization_config, quant_method "
                              f"{method!r}); megacoat converts full-precision weights: convert the original model")
    heads = [a for a in config.get("architectures") or [] if a not in FAMILIES[kind].ARCHITECTURES]
    if heads:  # e.g. LlamaForSequenceClassification: its score head is no language-model output layer
        raise CheckpointError(f"config.json's architectures {heads} is not a language model megacoat converts; "
                              f"it converts {', '.join(FAMILIES[kind].ARCHITECTURES)}")
    return kind


def lm_head_model_weights(config: dict, raw: dict, family) -> dict:
    """The weights as the family's LM-head model names them, its output layer as transformers builds it.

    A base model's file (GPT2Model, LlamaModel: e.g. the original gpt2 upload) names its tensors without
    the LM-head model's prefix. An untied config without lm_head.weight would get a random output layer
    in transformers; a tied config with an lm_head.weight other than the embedding has the output layer
    transformers ignores: both are refused rather than guessed. A tied lm_head.weight equal to the
    embedding is a saved copy and is dropped."""
    if raw and not any(k.startswith(family.BASE_PREFIX) for k in raw):
        raw = {k if k == OUTPUT_LAYER else family.BASE_PREFIX + k: v for k, v in raw.items()}
    tied = config.get("tie_word_embeddings", family.TIED_DEFAULT)
    head, embedding = raw.get(OUTPUT_LAYER), raw.get(family.EMBEDDING)
    if not tied and head is None:
        raise CheckpointError(f"config.json has tie_word_embeddings {tied!r} but the weights have no {OUTPUT_LAYER} "
                              "(transformers would start the output layer from random values); if the output layer "
                              "is the input embedding, set \"tie_word_embeddings\": true in config.json")
    if tied and head is not None:
        if embedding is None or not torch.equal(head, embedding):
            raise CheckpointError(f"config.json ties the output layer to the input embedding (tie_word_embeddings "
                                  f"{tied!r}) but the weights hold a different {OUTPUT_LAYER}, which transformers "
                                  "would ignore; if the model was trained with its own output layer, set "
                                  "\"tie_word_embeddings\": false in config.json")
        raw = {k: v for k, v in raw.items() if k != OUTPUT_LAYER}
    return raw


def family_of_megacoat(m) -> str:
    errors = []
    for name, mod in FAMILIES.items():
        try:
            mod.check_convertible(m)
            return name
        except CheckpointError as e:
            errors.append(str(e))
    raise CheckpointError("no Hugging Face architecture matches this model:\n  " + "\n  ".join(errors))


def hf_to_megacoat(hf_dir: str, save_dir: str, tp: int = 1, pp: int = 1, dtype: Optional[torch.dtype] = None,
                   force: bool = False) -> str:
    """A weights-only megacoat checkpoint (iteration 0) of a Hugging Face Llama or GPT-2 directory."""
    check_checkpoint_target(save_dir, 0, force)
    config = read_config(hf_dir)
    family = family_of_hf(config)
    weights = HFWeights(lm_head_model_weights(config, read_weights(hf_dir), FAMILIES[family]), hf_dir)
    m, vocab_size, tensors = FAMILIES[family].from_hf(config, weights)
    check_target_pp(pp, m.num_layers)
    check_target_tp(tp, m)
    unused = unused_weights(weights, IGNORED_SUFFIXES)
    if unused:
        raise CheckpointError(f"the Hugging Face weights hold tensors the {family} mapping does not understand "
                              f"({', '.join(unused[:5])}); converting would drop them")
    odd = sorted({str(v.dtype).replace("torch.", "") for v in tensors.values() if v.dtype not in WEIGHT_DTYPES})
    if odd:  # e.g. float8 without a quantization_config: the values are not the weights without their scales
        raise CheckpointError(f"the Hugging Face weights hold {', '.join(odd)} tensors; megacoat converts fp32, "
                              "bf16 and fp16 weights: convert the original model")
    tensors = cast_weights(tensors, dtype)
    cfg = MegacoatConfig()
    cfg.model = m
    kind, file = tokenizer_of_hf(hf_dir)
    if kind:
        n = check_tokenizer_fits(hf_dir, vocab_size, kind, file)
        cfg.data.tokenizer_type = kind
        tokenizer_dir = os.path.abspath(os.path.join(save_dir, iteration_dir_name(0), TOKENIZER_DIR))
        cfg.data.tokenizer_model = tokenizer_dir if kind == "HuggingFaceTokenizer" else \
            os.path.join(tokenizer_dir, file)
    else:  # ids only; vocab_size is the embedding's row count
        cfg.data.tokenizer_type, cfg.data.vocab_size = "NullTokenizer", vocab_size - 1

    def copy_tokenizer(partial: str) -> dict:
        if not kind:
            return {"tokenizer": {"type": "NullTokenizer", "vocab_size": vocab_size}}
        os.makedirs(os.path.join(partial, TOKENIZER_DIR), exist_ok=True)
        for f in {file, *TOKENIZER_FILES}:
            if os.path.exists(os.path.join(hf_dir, f)):
                shutil.copyfile(os.path.join(hf_dir, f), os.path.join(partial, TOKENIZER_DIR, f))
        info = {"type": kind, "file": os.path.join(TOKENIZER_DIR, file)}
        return {"tokenizer": info if kind == "HuggingFaceTokenizer" else {**info, "vocab_size": n}}

    return write_model_checkpoint(save_dir, m, vocab_size, tensors, tp=tp, cfg=cfg, extra_files=copy_tokenizer)


def tokenizer_of_hf(hf_dir: str):
    """(megacoat tokenizer type, its file) of a Hugging Face directory's tokenizer, or (None, None): a
    tokenizer.json, else a SentencePiece tokenizer.model (what the export writes for one, with megacoat's
    encoding: no BOS added, end of document = the model's eos)."""
    if os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        return "HuggingFaceTokenizer", "tokenizer.json"
    if os.path.exists(os.path.join(hf_dir, SENTENCEPIECE_FILE)):
        return "GPTSentencePieceTokenizer", SENTENCEPIECE_FILE
    return None, None


def check_tokenizer_fits(hf_dir: str, vocab_size: int, kind: str = "HuggingFaceTokenizer",
                         file: str = "tokenizer.json") -> int:
    """The tokenizer copied into the checkpoint must load and give only ids the embedding has rows for:
    the checkpoint's users (tools/generate.py, training with its flags) refuse it otherwise. Returns its size."""
    from ..data.tokenizer import TokenizerError, build_tokenizer_by_type
    try:
        n = build_tokenizer_by_type(kind, hf_dir if kind == "HuggingFaceTokenizer" else
                                    os.path.join(hf_dir, file)).vocab_size
    except TokenizerError as e:
        raise CheckpointError(f"the tokenizer in {hf_dir} cannot be used ({e}); fix it, or convert a copy without "
                              f"{file} (the checkpoint then takes token ids)") from None
    if n > vocab_size:
        raise CheckpointError(f"the tokenizer in {hf_dir} has {n} ids but the model's embedding only {vocab_size} "
                              "rows: ids past it would index outside the embedding; the tokenizer is not this model's")
    return n


def megacoat_to_hf(checkpoint_dir: str, save_dir: str, dtype: Optional[torch.dtype] = None, force: bool = False,
                   log=print) -> str:
    """A Hugging Face directory (config.json, model.safetensors, tokenizer files) of a megacoat checkpoint."""
    replaced = check_hf_target(save_dir, force)
    m, vocab_size, tensors, meta = read_model_tensors(checkpoint_dir)
    family = family_of_megacoat(m)
    tensors = cast_weights(tensors, dtype)
    dtype = dtype or next(iter(tensors.values())).dtype
    config, hf_tensors = FAMILIES[family].to_hf(m, vocab_size, tensors, dtype)
    from safetensors.torch import save_file
    with staged_hf_dir(save_dir, replaced) as stage:
        save_file(hf_tensors, os.path.join(stage, "model.safetensors"), metadata={"format": "pt"})
        config.update(_export_tokenizer(checkpoint_dir, meta, stage, m.max_position_embeddings, log))
        for special in ("bos_token_id", "eos_token_id"):  # absent, transformers puts its own (GPT-2: 50256)
            config.setdefault(special, None)
        with open(os.path.join(stage, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return save_dir


def _export_tokenizer(checkpoint_dir: str, meta: dict, save_dir: str, max_length: int, log) -> dict:
    """Write the checkpoint's tokenizer in a form AutoTokenizer loads; returns the token ids config.json
    names (end of document as eos, so generate() stops where training's documents ended)."""
    info = (meta.get("extra") or {}).get("tokenizer", {})
    kind = info.get("type")
    if not kind:
        log("note: the checkpoint records no tokenizer; none written (add the one the data was made with)")
        return {}
    tok = load_tokenizer(checkpoint_dir)
    ids = {"eos_token_id": tok.eod}
    src = os.path.join(resolve_checkpoint_dir(checkpoint_dir), info["file"]) if info.get("file") else None
    if kind == "HuggingFaceTokenizer" and src:
        for f in TOKENIZER_FILES:
            if os.path.exists(os.path.join(os.path.dirname(src), f)):
                shutil.copyfile(os.path.join(os.path.dirname(src), f), os.path.join(save_dir, f))
    elif kind == "GPTSentencePieceTokenizer" and src:
        if not _write_sentencepiece_for_hf(tok, src, save_dir, max_length):
            log("note: the SentencePiece model normalizes text (e.g. NFKC, collapsing spaces), which transformers' "
                "LlamaTokenizer does not: the exported tokenizer encodes text that normalization changes differently")
        if tok.bos >= 0:
            ids["bos_token_id"] = tok.bos
    elif kind != "NullTokenizer":
        log(f"note: the {kind} tokenizer has no Hugging Face form here; none written (its files are in "
            f"{os.path.dirname(src) if src else 'the training flags'})")
    return ids


def _write_sentencepiece_for_hf(tok, model_file: str, save_dir: str, max_length: int) -> bool:
    """tokenizer.model + tokenizer_config.json for transformers' LlamaTokenizer, set to encode as
    megacoat does: no BOS or EOS added, and a leading space only where the model adds one itself.
    Returns whether the encoding is exact: LlamaTokenizer applies no normalization rule, so it is
    exact for models that only mark spaces (tools/train_tokenizer.py's default, the default corpus')."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=model_file)
    probe = "a  b\tc\n\u00a0\ufb01\uff21 "  # repeated spaces, tab, newline, NBSP, a ligature, a full-width A
    shutil.copyfile(model_file, os.path.join(save_dir, "tokenizer.model"))
    adds_prefix = sp.encode_as_pieces("a")[0].startswith("\u2581")  # the model's add_dummy_prefix
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
              "add_prefix_space": adds_prefix, "legacy": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length, "eos_token": sp.id_to_piece(tok.eod)}
    for name, i in (("bos_token", sp.bos_id()), ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())):
        if i >= 0:
            config[name] = sp.id_to_piece(i)
    with open(os.path.join(save_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if not hasattr(sp, "normalize"):  # sentencepiece < 0.2 cannot show its normalization: not claimed exact
        return False
    return sp.normalize(probe) == ("\u2581" if adds_prefix else "") + probe.replace(" ", "\u2581")
