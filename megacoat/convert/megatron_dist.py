"""Megatron-LM's `torch_dist` checkpoint format, read without megatron-core or torch.distributed.

    <iter dir>/metadata.json      {"sharded_backend": "torch_dist", ...}
    <iter dir>/common.pt          args, iteration, ... (torch.save)
    <iter dir>/.metadata          PyTorch distributed-checkpoint metadata (key -> global shape, chunks)
    <iter dir>/__R_I.distcp       chunks, each a torch.save'd tensor at (offset, length)
Keys are megatron-core's sharded keys: global tensors (the TP=1 layout: fused SwiGLU fc1 is
[gate of all ranks; up of all ranks]), TransformerEngine names for the norms whatever the spec,
and the layers stacked on a leading axis (`decoder.layers.mlp.linear_fc1.weight` [L, 2F, H]).
Optimizer states, RNG states and extra states are skipped.
"""
from __future__ import annotations

import json
import os
from typing import Dict

import torch

from ..checkpoint.format import CheckpointError
from .megatron_model import te_to_local
from .megatron_pickle import load_dcp_metadata, load_tensor_bytes, load_torch_file, record_fields

SKIPPED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state", "modelopt_state")


def is_dist_format(iter_dir: str) -> bool:
    return os.path.isfile(os.path.join(iter_dir, ".metadata")) or os.path.isfile(os.path.join(iter_dir, "metadata.json"))


def _read_items(iter_dir: str, wanted) -> Dict[str, torch.Tensor]:
    meta = record_fields(load_dcp_metadata(os.path.join(iter_dir, ".metadata")))
    tensors: Dict[str, torch.Tensor] = {}
    for key, md in meta["state_dict_metadata"].items():
        if not wanted(key):
            continue
        f = record_fields(md)
        if "chunks" not in f:
            continue  # bytes (objects), not a tensor
        dtype = record_fields(f["properties"]).get("dtype") or record_fields(f["properties"])["_state"][0]
        tensors[key] = torch.empty(tuple(f["size"]), dtype=dtype)
    seen = {k: 0 for k in tensors}
    handles = {}
    try:
        for index, info in meta["storage_data"].items():
            idx, st = record_fields(index), record_fields(info)
            key = idx["fqn"]
            if key not in tensors:
                continue
            if st.get("transform_descriptors"):
                raise CheckpointError(f"{key}: stored with transforms {st['transform_descriptors']} (e.g. "
                                      "compression), which megacoat does not read")
            path = os.path.join(iter_dir, st["relative_path"])
            if path not in handles:
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path} is missing")
                handles[path] = open(path, "rb")
            fh = handles[path]
            fh.seek(st["offset"])
            chunk = load_tensor_bytes(fh.read(st["length"]))
            view = tensors[key]
            for d, (o, n) in enumerate(zip(idx["offset"], chunk.shape)):
                view = view.narrow(d, o, n)
            view.copy_(chunk)
            seen[key] += chunk.numel()
    finally:
        for fh in handles.values():
            fh.close()
    short = [k for k, n in seen.items() if n < tensors[k].numel()]
    if short:
        raise CheckpointError(f"{iter_dir}: chunks missing for {short[:4]}")
    return tensors


def read_dist_checkpoint(iter_dir: str):
    """(common state, full TP=1 Megatron tensors with local-spec names and per-layer keys)."""
    mj = os.path.join(iter_dir, "metadata.json")
    if os.path.isfile(mj):
        backend = json.load(open(mj)).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{iter_dir}: sharded backend {backend!r}; megacoat reads torch_dist (and torch)")
    common_path = os.path.join(iter_dir, "common.pt")
    common = load_torch_file(common_path) if os.path.isfile(common_path) else {}
    wanted = lambda k: not k.startswith(SKIPPED_PREFIXES) and "_extra_state" not in k  # noqa: E731
    stacked = _read_items(iter_dir, wanted)
    full: Dict[str, torch.Tensor] = {}
    pending_glu: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in stacked.items():
        if key.startswith("model."):
            key = key[len("model."):]
        if key.endswith(("linear_fc1.weight_w", "linear_fc1.weight_v", "linear_fc1.bias_w", "linear_fc1.bias_v")):
            pending_glu.setdefault(key[:-2], {})[key[-1]] = t  # singleton local shards: gate (w), up (v)
            continue
        _put(full, key, t)
    for key, parts in pending_glu.items():
        _put(full, key, torch.cat([parts["w"], parts["v"]], dim=1 if key.startswith("decoder.layers.") else 0))
    return common, full


def _put(full: Dict[str, torch.Tensor], key: str, t: torch.Tensor) -> None:
    if key.startswith("decoder.layers."):
        rest = key[len("decoder.layers."):]
        for i in range(t.shape[0]):
            full[te_to_local(f"decoder.layers.{i}.{rest}")] = t[i].clone()
    else:
        full[key] = t
