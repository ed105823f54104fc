"""Where and what a conversion writes: the target directory, the target TP and PP sizes, the target dtype.

A directory that already holds a checkpoint (megacoat's or Megatron's: a tracker, `iter_*` or
`release` directories) is refused unless forced, and even forced it is never rewound: writing an
iteration older than the newest one there would move the tracker backwards, and the next `--load`
of that directory would restart the run from the converted weights.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional

import torch

from ..checkpoint.format import METADATA_FILE, TRACKER_FILE, CheckpointError, read_tracker

ITERATION_DIR = re.compile(r"^iter_(\d+)$")
RELEASE_DIR = "release"  # Megatron's iteration-less checkpoint (tracker "release", loaded as iteration 0)
# Files a Hugging Face loader reads weights from; a stale one would shadow the converted model.
HF_WEIGHT_FILE = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin"
                            r"|pytorch_model\.bin\.index\.json)$")
HF_CONFIG_FILE = "config.json"
# Files transformers reads beside the weights: left from a replaced model, they would pair its
# generation settings or tokenizer with the new weights.
HF_COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                      "chat_template.json")


def checkpoint_entries(save_dir: str) -> List[str]:
    """The names in `save_dir` that make it a checkpoint directory (empty: nothing to overwrite)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(n for n in os.listdir(save_dir)
                  if n == TRACKER_FILE or n == RELEASE_DIR or ITERATION_DIR.match(n))


def newest_iteration(save_dir: str) -> Optional[int]:
    """The newest iteration `save_dir` holds: its tracker's or its newest `iter_*` directory's
    (a tracker-less directory still holds its checkpoints); `release` counts as 0."""
    found = [int(m.group(1)) for m in map(ITERATION_DIR.match, os.listdir(save_dir)) if m]
    if os.path.isdir(os.path.join(save_dir, RELEASE_DIR)):
        found.append(0)
    tracked = read_tracker(save_dir)
    if tracked is not None:
        found.append(tracked)
    return max(found) if found else None


def check_checkpoint_target(save_dir: str, iteration: Optional[int], force: bool) -> None:
    """Refuse to write `iteration` (None: not known yet, only the emptiness check runs) into a
    directory that holds a checkpoint unless `force`; refuse always if that would rewind it."""
    if os.path.isfile(os.path.join(save_dir, METADATA_FILE)):
        raise CheckpointError(f"{save_dir} is one checkpoint's iteration directory; give --save-dir its parent "
                              "directory or a new one")
    held = checkpoint_entries(save_dir)
    if not held:
        return
    if not force:
        raise CheckpointError(f"{save_dir} already holds a checkpoint ({_listing(held)}); choose a new "
                              "--save-dir, or pass --force to write into it")
    newest = newest_iteration(save_dir)
    if iteration is not None and newest is not None and newest > iteration:
        raise CheckpointError(f"{save_dir} holds iteration {newest}, newer than the iteration {iteration} this "
                              "conversion writes: its tracker would move backwards and the next --load would "
                              "rewind that run; choose a new --save-dir")


def check_hf_target(save_dir: str, force: bool) -> List[str]:
    """Refuse a directory that already holds a Hugging Face model (its config, weights, tokenizer or
    generation settings) unless `force`; returns those files (forced: the writer replaces them all, so
    no stale shard shadows the new weights and no old tokenizer or generation setting goes with them)."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise CheckpointError(f"--save-dir {save_dir} is a file, not a directory; choose a directory")
    if os.path.isfile(os.path.join(save_dir, METADATA_FILE)):  # deleted with the checkpoint, e.g. by retention
        raise CheckpointError(f"{save_dir} is one megacoat checkpoint's iteration directory; export the model to "
                              "a directory of its own")
    if not os.path.isdir(save_dir):
        return []
    names = set(os.listdir(save_dir))
    weights = sorted(n for n in names if HF_WEIGHT_FILE.match(n))
    config = [HF_CONFIG_FILE] if HF_CONFIG_FILE in names else []
    held = config + weights + [n for n in HF_COMPANION_FILES if n in names]
    if held and not force:
        raise CheckpointError(f"{save_dir} already holds a Hugging Face model ({_listing(held)}); choose a new "
                              "--save-dir, or pass --force to replace it")
    return held


def _listing(names: List[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def check_target_pp(pp: int, num_layers: int) -> None:
    """Checkpoint pieces are keyed by global parameter names (global layer numbers), so the same
    files load at every pipeline size: a target PP only has to be a valid split of the layers."""
    if pp < 1:
        raise CheckpointError("--target-pipeline-parallel-size must be >= 1")
    if num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} does not divide the model's {num_layers} layers "
                              "(uneven splits: load with --decoder-first/last-pipeline-num-layers instead)")


def check_target_tp(tp: int, m) -> None:
    """The files are split the way a run at TP=`tp` splits the weights, and the saved flags say TP=`tp`:
    the heads, query groups and FFN size must split evenly, as a training run at that TP requires."""
    if tp < 1:
        raise CheckpointError("--target-tensor-parallel-size must be >= 1")
    bad = [f"{what} {n}" for what, n in (("attention heads", m.num_attention_heads),
                                          ("query groups", m.num_query_groups), ("FFN size", m.ffn_hidden_size))
           if n % tp]
    if bad:
        fits = [d for d in range(1, m.num_query_groups + 1)
                if not (m.num_attention_heads % d or m.num_query_groups % d or m.ffn_hidden_size % d)]
        raise CheckpointError(f"--target-tensor-parallel-size {tp} does not divide the model's {', '.join(bad)}; "
                              f"choose one of {fits}")


def cast_weights(tensors: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    """The weights in `dtype` (None: as they are). A weight beyond the dtype's range would become inf
    (fp16 ends at 65504): refused, naming it, rather than written as another model."""
    if dtype is None:
        return tensors
    out = {}
    for name, t in tensors.items():
        cast = t.to(dtype)
        if dtype.is_floating_point and not torch.isfinite(cast).all() and torch.isfinite(t).all():
            kind = str(dtype).replace("torch.", "")
            raise CheckpointError(f"{name} holds values up to {t.abs().max().item():.4g}, beyond {kind}'s range "
                                  f"(max {torch.finfo(dtype).max:.0f}): --dtype would make them inf; use bf16 or fp32")
        out[name] = cast
    return out
