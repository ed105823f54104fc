"""Hugging Face directories (config.json + safetensors) <-> megacoat checkpoints, Llama and GPT-2.

Every unsupported feature raises CheckpointError naming it: a conversion never produces a
silently different model. HF weights that the mapping did not consume are an error too.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from ..checkpoint.format import TOKENIZER_DIR, CheckpointError, resolve_checkpoint_dir
from ..checkpoint.model_io import read_model_tensors, write_model_checkpoint
from ..config import MegacoatConfig
from . import hf_gpt2, hf_llama
from .target import check_checkpoint_target, check_hf_target, check_target_pp

FAMILIES = {"llama": hf_llama, "gpt2": hf_gpt2}
# Buffers some HF checkpoints carry that are not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class _Tracked(dict):
    """Records which keys a mapping read, to find weights it would silently drop."""

    def __init__(self, *a):
        super().__init__(*a)
        self.used = set()

    def __getitem__(self, k):
        self.used.add(k)
        return super().__getitem__(k)


def read_hf_dir(hf_dir: str):
    """(config dict, {name: tensor}) from a Hugging Face model directory."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{hf_dir} has no config.json; point --load-dir at a Hugging Face model directory")
    config = json.load(open(cfg_path))
    from safetensors.torch import load_file  # optional dependency: `pip install safetensors`
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.exists(os.path.join(hf_dir, "pytorch_model.bin")):
        return config, torch.load(os.path.join(hf_dir, "pytorch_model.bin"), weights_only=True, map_location="cpu")
    else:
        raise CheckpointError(f"{hf_dir} has no model.safetensors, safetensors index or pytorch_model.bin")
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(hf_dir, f)))
    return config, tensors


def family_of_hf(config: dict) -> str:
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise CheckpointError(f"Hugging Face model_type {kind!r} is not supported; megacoat converts "
                              f"{sorted(FAMILIES)} (LlamaForCausalLM, GPT2LMHeadModel)")
    return kind


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
    config, raw = read_hf_dir(hf_dir)
    family = family_of_hf(config)
    tracked = _Tracked(raw)
    m, vocab_size, tensors = FAMILIES[family].from_hf(config, tracked)
    check_target_pp(pp, m.num_layers)
    unused = sorted(k for k in set(raw) - tracked.used if not k.endswith(IGNORED_SUFFIXES))
    if unused:
        raise CheckpointError(f"the Hugging Face weights hold tensors the {family} mapping does not understand "
                              f"({', '.join(unused[:5])}); converting would drop them")
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    cfg = MegacoatConfig()
    cfg.model = m
    has_tokenizer = os.path.exists(os.path.join(hf_dir, "tokenizer.json"))
    if has_tokenizer:
        cfg.data.tokenizer_type = "HuggingFaceTokenizer"
        cfg.data.tokenizer_model = os.path.abspath(os.path.join(save_dir, f"iter_{0:07d}", TOKENIZER_DIR))
    else:  # ids only; vocab_size is the embedding's row count
        cfg.data.tokenizer_type, cfg.data.vocab_size = "NullTokenizer", vocab_size - 1

    def copy_tokenizer(partial: str) -> dict:
        if not has_tokenizer:
            return {"tokenizer": {"type": "NullTokenizer", "vocab_size": vocab_size}}
        os.makedirs(os.path.join(partial, TOKENIZER_DIR), exist_ok=True)
        for f in TOKENIZER_FILES:
            if os.path.exists(os.path.join(hf_dir, f)):
                shutil.copyfile(os.path.join(hf_dir, f), os.path.join(partial, TOKENIZER_DIR, f))
        return {"tokenizer": {"type": "HuggingFaceTokenizer", "file": os.path.join(TOKENIZER_DIR, "tokenizer.json")}}

    return write_model_checkpoint(save_dir, m, vocab_size, tensors, tp=tp, cfg=cfg, extra_files=copy_tokenizer)


def megacoat_to_hf(checkpoint_dir: str, save_dir: str, dtype: Optional[torch.dtype] = None, force: bool = False) -> str:
    """A Hugging Face directory (config.json, model.safetensors, tokenizer files) of a megacoat checkpoint."""
    stale = check_hf_target(save_dir, force)
    m, vocab_size, tensors, meta = read_model_tensors(checkpoint_dir)
    family = family_of_megacoat(m)
    dtype = dtype or next(iter(tensors.values())).dtype
    config, hf_tensors = FAMILIES[family].to_hf(m, vocab_size, tensors, dtype)
    from safetensors.torch import save_file
    os.makedirs(save_dir, exist_ok=True)
    for name in stale:  # forced: an old shard or index would be read instead of the new weights
        os.remove(os.path.join(save_dir, name))
    save_file(hf_tensors, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tok = (meta.get("extra") or {}).get("tokenizer", {})
    if tok.get("type") == "HuggingFaceTokenizer" and tok.get("file"):
        src_dir = os.path.join(resolve_checkpoint_dir(checkpoint_dir), os.path.dirname(tok["file"]))
        for f in TOKENIZER_FILES:
            if os.path.exists(os.path.join(src_dir, f)):
                shutil.copyfile(os.path.join(src_dir, f), os.path.join(save_dir, f))
    return save_dir
