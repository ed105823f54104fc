"""megacoat -> megacoat: a weights-only copy of a checkpoint, split into files for a target TP.
The copy keeps what the source says about itself: its tokenizer (the copy inside the checkpoint, so
tools/generate.py and further conversions need nothing else) and where its weights came from."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..checkpoint.checkpointer import copy_tokenizer, point_at_tokenizer_copy
from ..checkpoint.format import iteration_dir_name
from ..checkpoint.model_io import load_tokenizer, read_model_tensors, write_model_checkpoint
from ..config import MegacoatConfig, config_from_dict
from .target import cast_weights, check_checkpoint_target, check_target_pp, check_target_tp


def megacoat_to_megacoat(load_dir: str, save_dir: str, tp: int = 1, pp: int = 1, dtype: Optional[torch.dtype] = None,
                         force: bool = False) -> str:
    """Iteration 0 of `save_dir`, laid out for TP=`tp` (any layout loads it; `pp` is only checked)."""
    check_checkpoint_target(save_dir, 0, force)
    m, vocab, tensors, meta = read_model_tensors(load_dir)
    check_target_pp(pp, m.num_layers)
    check_target_tp(tp, m)
    tensors = cast_weights(tensors, dtype)
    extra = meta.get("extra") or {}
    source = extra.get("source")  # where the weights came from (e.g. Megatron's layer spec)
    tokenizer = load_tokenizer(load_dir) if extra.get("tokenizer") else None
    cfg = MegacoatConfig()
    cfg.data = config_from_dict({"data": (meta.get("config") or {}).get("data", {})}).data  # the tokenizer flags
    if tokenizer is not None:
        point_at_tokenizer_copy(cfg.data, tokenizer, os.path.join(save_dir, iteration_dir_name(0)))

    def carried(partial: str) -> dict:
        out = copy_tokenizer(tokenizer, partial) if tokenizer is not None else {}
        return dict(out, source=source) if source else out

    return write_model_checkpoint(save_dir, m, vocab, tensors, tp=tp, cfg=cfg, extra_files=carried)
