"""Whole models in one process: build from a checkpoint, read all weights, write a weights-only
checkpoint at any target TP (conversion tools, `megacoat.load_model`, tools/generate.py)."""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional

import torch

from ..config import MegacoatConfig, ModelConfig, config_from_dict, resolve_model_defaults
from ..model.gpt import GPTModel, padded_vocab_size
from ..model.transformer import LayerContext
from .checkpointer import load_model_weights
from .collect import MODEL_KIND, Piece, dtype_name
from .format import CheckpointError, iteration_dir_name, resolve_checkpoint_dir
from .layout import VOCAB_PARAMETERS, TensorLayout, layout_of_parameter
from .reader import CheckpointReader
from .writer import RankSave, piece_records, plan_offsets, prepare_partial_dir, publish, rank_file_path, write_pieces


def open_checkpoint(checkpoint_dir: str) -> CheckpointReader:
    """A reader of a save directory's current checkpoint or of one iteration's directory."""
    return CheckpointReader(resolve_checkpoint_dir(checkpoint_dir))


def model_config_of(reader: CheckpointReader) -> ModelConfig:
    m = config_from_dict({"model": reader.config.get("model", {})}).model
    if not m.group_query_attention:
        m.num_query_groups = None  # saved resolved (= heads); the resolver wants it unset without GQA
    resolve_model_defaults(m)
    return m


def build_model(m: ModelConfig, vocab_size: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> GPTModel:
    """A single-process (TP=1) model; weights are placeholders until loaded."""
    lc = LayerContext(None, False, None, dtype, torch.device(device), 0)
    return GPTModel(m, lc, vocab_size, padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, 1))


def load_full_model(checkpoint_dir: str, device: str = "cpu", dtype: Optional[torch.dtype] = None) -> GPTModel:
    """The checkpoint's model in one process, in eval mode (dtype: the saved weights' by default)."""
    reader = open_checkpoint(checkpoint_dir)
    try:
        m = model_config_of(reader)
        if dtype is None:
            dtype = reader.stored_dtype(MODEL_KIND, "final_norm.weight")
        model = build_model(m, reader.meta["vocab_size"], dtype, device)
        load_model_weights(reader, model, 0, 1)
    finally:
        reader.close()
    return model.eval()


def read_model_tensors(checkpoint_dir: str):
    """(ModelConfig, vocab size, {global name: canonical tensor}, checkpoint metadata)."""
    reader = open_checkpoint(checkpoint_dir)
    try:
        tensors = {name: reader.canonical(MODEL_KIND, name) for name in reader.names()}
        return model_config_of(reader), reader.meta["vocab_size"], tensors, reader.meta
    finally:
        reader.close()


def target_layout(p: torch.nn.Parameter, tp: int, padded_vocab: int, vocab_size: int) -> TensorLayout:
    """The layout `p` (a parameter of a TP=1 model) has at tensor-parallel size `tp`."""
    lay = layout_of_parameter(p, 1, vocab_size)
    if lay.dim is None:
        return lay
    full, sizes = list(lay.full_shape), list(lay.partition_sizes)
    if p.global_name in VOCAB_PARAMETERS:
        full[0], sizes = padded_vocab, [padded_vocab]
    return TensorLayout(tuple(full), tp, lay.dim, sizes, lay.vocab_rows)


def write_model_checkpoint(save_dir: str, m: ModelConfig, vocab_size: int, tensors: Dict[str, torch.Tensor],
                           tp: int = 1, iteration: int = 0, cfg: Optional[MegacoatConfig] = None,
                           extra_files=lambda d: {}, consumed_samples: int = 0) -> str:
    """A weights-only checkpoint laid out for TP=`tp` (one file per TP rank), loadable at any layout."""
    params = _parameter_skeleton(m, vocab_size)
    names = {name for name, _ in params}
    missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
    if missing or extra:
        raise CheckpointError(f"weights do not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    cfg = cfg or MegacoatConfig()
    cfg.model = m
    cfg.parallel.tensor_model_parallel_size = tp
    partial = prepare_partial_dir(save_dir, iteration, 0)
    contributions = []
    for rank in range(tp):
        layouts, dtypes, pieces = {}, {}, []
        for name, p in params:
            t = tensors[name]
            lay = target_layout(p, tp, padded, vocab_size)
            if tuple(t.shape) != tuple(lay.canonical_shape):
                raise CheckpointError(f"{name}: shape {list(t.shape)}, the model expects {list(lay.canonical_shape)}")
            layouts[name] = lay.to_json()
            dtypes[f"{MODEL_KIND}/{name}"] = dtype_name(t.dtype)
            if lay.tp_size > 1 or rank == 0:
                local = lay.local_from_canonical(t, rank).reshape(-1).contiguous()
                pieces.append(Piece(MODEL_KIND, name, rank if lay.tp_size > 1 else 0, 0, local.numel(), local))
        offsets, _ = plan_offsets(pieces)
        path, file_name = rank_file_path(partial, rank)
        crcs = write_pieces(path, pieces, offsets)
        contributions.append(RankSave(rank, layouts, dtypes, piece_records(pieces, offsets, crcs, file_name)))
    common = {"train_state": {"iteration": iteration, "consumed_samples": consumed_samples, "skipped_iters": 0,
                              "nan_iters": 0}}
    metadata = {"config": cfg.to_dict(), "parallel": {"world_size": tp, "tp": tp, "pp": 1, "dp": 1},
                "vocab_size": vocab_size, "padded_vocab_size": padded}
    publish(save_dir, iteration, contributions, common, metadata, extra_files)
    return os.path.join(save_dir, iteration_dir_name(iteration))


def _parameter_skeleton(m: ModelConfig, vocab_size: int):
    """(global name, parameter of a TP=1 model with that name's shape and shard annotations), for every
    parameter; built from a one-layer model (layers share shapes), so converting is cheap in memory."""
    one = dataclasses.replace(m, num_layers=1)
    out = []
    for p in build_model(one, vocab_size).parameters():
        if p.global_name.startswith("layers.0."):
            out += [(f"layers.{i}." + p.global_name[len("layers.0."):], p) for i in range(m.num_layers)]
        else:
            out.append((p.global_name, p))
    return out


def load_tokenizer(checkpoint_dir: str):
    """The tokenizer saved with the checkpoint (its copy inside the checkpoint, else the saved flags)."""
    from ..data.tokenizer import NullTokenizer, build_tokenizer_by_type

    reader = open_checkpoint(checkpoint_dir)
    path, data_flags = reader.path, reader.config.get("data", {})
    info = (reader.meta.get("extra") or {}).get("tokenizer", {})
    reader.close()  # only the metadata was needed
    if info.get("type") == "NullTokenizer":
        return NullTokenizer(info["vocab_size"] - 1)
    if info.get("file"):
        kind = info["type"]
        file = os.path.join(path, info["file"])
        if kind == "GPT2BPETokenizer":
            return build_tokenizer_by_type(kind, vocab_file=file,
                                           merge_file=os.path.join(path, info["companion_files"][0]))
        return build_tokenizer_by_type(kind, os.path.dirname(file) if kind == "HuggingFaceTokenizer" else file)
    from ..data import build_tokenizer
    return build_tokenizer(config_from_dict({"data": data_flags}).data)
