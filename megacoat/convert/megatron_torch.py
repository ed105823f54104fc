"""Megatron-LM's `torch` checkpoint format, any TP and PP (and virtual pipeline stages).

    <dir>/latest_checkpointed_iteration.txt         "N" or "release"
    <dir>/iter_000000N/mp_rank_TT/model_optim_rng.pt         PP = 1
    <dir>/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt     PP > 1
Each file: {"args": Namespace, "checkpoint_version": 3.0, "iteration": N, "model": state dict
(or "model0", "model1", ... per virtual stage), "optimizer", "rng_state", ...}. Layers are
numbered from 0 on every stage; stage (chunk v, rank p) holds global layers after those of every
(chunk, rank) before it in (v, p) order (Megatron's interleaving), so offsets come from counting.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from ..checkpoint.format import CheckpointError, fsync_dir, fsync_file, replace_directory, write_file_atomic
from .megatron_model import EXTRA_STATE, LAYER_KEY, local_to_te, merge_tp, split_tp, te_to_local
from .megatron_pickle import load_torch_file

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def resolve_iteration_dir(path: str) -> str:
    """A Megatron --save directory (tracker) or one iter_*/release directory -> the iteration directory."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
        if not os.path.isdir(os.path.join(path, name)):
            raise CheckpointError(f"{tracker} names {text!r} but {os.path.join(path, name)} does not exist; write "
                                  "an existing iteration into the tracker, or give that iter_* directory")
        path = os.path.join(path, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no Megatron checkpoint here (no {TRACKER}, not an iter_* directory)")
    return path


def is_torch_format(iter_dir: str) -> bool:
    return any(RANK_DIR.match(d) for d in os.listdir(iter_dir))


def _rank_files(iter_dir: str) -> Dict[Tuple[int, int], str]:
    files = {}
    for d in sorted(os.listdir(iter_dir)):
        m = RANK_DIR.match(d)
        if not m:
            continue
        if m.group(3) is not None:
            raise CheckpointError(f"{iter_dir}/{d}: expert-parallel ranks (mixture of experts) are not supported")
        path = os.path.join(iter_dir, d, FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing")
        files[(int(m.group(1)), int(m.group(2) or 0))] = path
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise CheckpointError(f"{iter_dir}: rank directories missing for (tp, pp) {missing[:4]}")
    return files


def _model_chunks(state: dict, path: str) -> List[dict]:
    if "model" in state:
        return [state["model"]]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointError(f"{path} holds no model weights (keys: {sorted(state)[:8]})")
    return [state[k] for k in keys]


def _clean(sd: dict) -> Dict[str, torch.Tensor]:
    """Weights only, local-spec names: drops `_extra_state` (FP8 metadata, None for local layers)."""
    out = {}
    for k, v in sd.items():
        k = k[len("module."):] if k.startswith("module.") else k
        if k.endswith("._extra_state") or k.endswith(".inv_freq"):
            continue
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"model entry {k} is a {type(v).__name__}, not a tensor")
        out[te_to_local(k)] = v
    return out


def read_torch_checkpoint(iter_dir: str):
    """(common state of rank 0 without the weights, full TP=1 Megatron tensors, layer spec, (tp, pp))."""
    files = _rank_files(iter_dir)
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    states = {k: load_torch_file(f) for k, f in files.items()}
    common = {k: v for k, v in states[(0, 0)].items() if not k.startswith("model")}
    args = common.get("args")
    gated = bool(getattr(args, "swiglu", False)) if args is not None else False
    spec = "transformer_engine" if any(k.endswith("layer_norm_weight") for s in states.values()
                                       for sd in _model_chunks(s, iter_dir) for k in sd) else "local"
    chunks = {k: [_clean(sd) for sd in _model_chunks(s, files[k])] for k, s in states.items()}
    vp = len(chunks[(0, 0)])
    full, offset = {}, 0
    for v in range(vp):  # Megatron's order of virtual stages: chunk-major, then pipeline rank
        for p in range(pp):
            per_tp = [chunks[(t, p)][v] for t in range(tp)]
            names = set(per_tp[0])
            if any(set(sd) != names for sd in per_tp):
                raise CheckpointError(f"{iter_dir}: TP ranks of pipeline stage {p} hold different tensors")
            local_layers = sorted({int(LAYER_KEY.match(n).group(1)) for n in names if LAYER_KEY.match(n)})
            if local_layers != list(range(len(local_layers))):
                raise CheckpointError(f"{iter_dir}: stage {p} chunk {v} has layers {local_layers}, expected 0..n-1")
            for n in names:
                lm = LAYER_KEY.match(n)
                key = f"decoder.layers.{int(lm.group(1)) + offset}.{lm.group(2)}" if lm else n
                if key in full and not lm:
                    continue  # e.g. a tied embedding copy on the last stage: the first stage's wins
                full[key] = merge_tp(n, [sd[n] for sd in per_tp], gated)
            offset += len(local_layers)
    return common, full, spec, (tp, pp)


def stage_layers(num_layers: int, pp: int) -> List[range]:
    if num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} does not divide the {num_layers} layers")
    n = num_layers // pp
    return [range(p * n, (p + 1) * n) for p in range(pp)]


def write_torch_checkpoint(save_dir: str, full: Dict[str, torch.Tensor], num_layers: int, tp: int, pp: int,
                           common: dict, gated: bool, tied: bool, spec: str, iteration: Optional[int]) -> str:
    """One model_optim_rng.pt per (tp, pp) rank, split the way Megatron splits; `iteration` None writes a
    `release` checkpoint (Megatron then starts at iteration 0 and skips optimizer and RNG state).
    An existing directory of that iteration is replaced whole, so no rank file of another layout stays."""
    if spec not in EXTRA_STATE:
        raise CheckpointError(f"unknown Megatron layer spec {spec!r}; choose {sorted(EXTRA_STATE)}")
    name = "release" if iteration is None else f"iter_{iteration:07d}"
    final_dir = os.path.join(save_dir, name)
    iter_dir = os.path.join(save_dir, f".{name}.partial")
    shutil.rmtree(iter_dir, ignore_errors=True)
    for p, layers in enumerate(stage_layers(num_layers, pp)):
        first, last = p == 0, p == pp - 1
        stage: Dict[str, object] = {}
        for key, t in full.items():
            lm = LAYER_KEY.match(key)
            if lm:
                i = int(lm.group(1))
                if i in layers:
                    stage[f"decoder.layers.{i - layers.start}.{lm.group(2)}"] = t
            elif key.startswith("embedding.") and first:
                stage[key] = t
            elif key.startswith("decoder.final_layernorm") and last:
                stage[key] = t
            elif key == "output_layer.weight" and last:
                stage[key] = t
        if last and tied and pp > 1:  # the last stage keeps its own copy of the tied embedding
            stage["output_layer.weight"] = full["embedding.word_embeddings.weight"]
        for t_rank in range(tp):
            sd = {}
            for key, t in stage.items():
                sd[local_to_te(key) if spec == "transformer_engine" else key] = split_tp(key, t, tp, gated)[t_rank]
            for i in range(len(layers)):
                for mod in EXTRA_STATE[spec]:
                    sd[f"decoder.layers.{i}.{mod}._extra_state"] = None
            if last:
                sd["output_layer._extra_state"] = None
            rank_dir = os.path.join(iter_dir, f"mp_rank_{t_rank:02d}" if pp == 1 else f"mp_rank_{t_rank:02d}_{p:03d}")
            os.makedirs(rank_dir, exist_ok=True)
            state = dict(common, model=sd)
            torch.save(state, os.path.join(rank_dir, FILE))
    for root, _, files in os.walk(iter_dir):
        for f in files:
            fsync_file(os.path.join(root, f))
        fsync_dir(root)
    if os.path.exists(final_dir):  # the old directory stays whole until the new one takes its place
        replace_directory(iter_dir, final_dir, os.path.join(save_dir, f".{name}.replaced"))
    else:
        os.rename(iter_dir, final_dir)
    fsync_dir(save_dir)
    write_file_atomic(os.path.join(save_dir, TRACKER), b"release" if iteration is None else str(iteration).encode())
    return final_dir
