"""Reading a Hugging Face model directory: config.json and the weights (safetensors, one file or
sharded; pytorch_model.bin, one file or sharded, through torch's weights-only unpickler only).

A directory that is not what it should be (no config, a config that is not a JSON object, a
missing or damaged shard, a pickle that holds code) is a CheckpointError naming the file and
the fix, never a traceback. Missing config keys and weights are errors of the same kind when
the mapping asks for them (`HFConfig`, `HFWeights`).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Tuple

import torch

from ..checkpoint.format import CheckpointError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_FILE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class HFConfig(dict):
    """config.json's keys; a key the mapping needs and the file lacks is an error naming the file."""

    def __init__(self, data: dict, path: str):
        super().__init__(data)
        self.path = path

    def __missing__(self, key):
        raise CheckpointError(f"{self.path} has no {key!r}, which the conversion needs; the config is incomplete "
                              "(compare it with the model's original config.json)")


class HFWeights(dict):
    """The weights by name; records which names a mapping read, to find weights it would silently
    drop, and names a weight it needs and the files lack."""

    def __init__(self, data: dict, where: str):
        super().__init__(data)
        self.where, self.used = where, set()

    def __getitem__(self, k):
        self.used.add(k)
        return super().__getitem__(k)

    def __missing__(self, key):
        raise CheckpointError(f"the weights in {self.where} have no {key}: they do not match config.json (e.g. "
                              "fewer layers or other names than it describes)")


def read_config(hf_dir: str) -> HFConfig:
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{hf_dir} is not a directory; point --load-dir at a Hugging Face model directory")
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} has no {CONFIG_FILE}; point --load-dir at a Hugging Face model directory")
    data = _read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object; it is not a model config")
    return HFConfig(data, path)


def read_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """{name: tensor} of every weight file the directory's index (or single file) names."""
    for index, single, read in ((SAFETENSORS_INDEX, SAFETENSORS_FILE, _read_safetensors),
                                (PICKLE_INDEX, PICKLE_FILE, _read_pickle)):
        if os.path.isfile(os.path.join(hf_dir, index)):
            weight_map = _weight_map(os.path.join(hf_dir, index))
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
            if missing:
                raise CheckpointError(f"{hf_dir} lacks {len(missing)} of the {len(files)} shards {index} names "
                                      f"({', '.join(missing[:3])}); download them again")
            tensors: Dict[str, torch.Tensor] = {}
            for f in files:
                tensors.update(read(os.path.join(hf_dir, f)))
            absent = sorted(set(weight_map) - set(tensors))
            if absent:
                raise CheckpointError(f"{index} in {hf_dir} names tensors its shards do not hold "
                                      f"({', '.join(absent[:3])}); the shards are from another download: download "
                                      "the model again")
            return tensors
        if os.path.isfile(os.path.join(hf_dir, single)):
            return read(os.path.join(hf_dir, single))
    raise CheckpointError(f"{hf_dir} has no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {PICKLE_FILE} or {PICKLE_INDEX}; "
                          "it holds no weights")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e}); the file is damaged: download it again") from None


def _weight_map(path: str) -> Dict[str, str]:
    data = _read_json(path)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path} has no \"weight_map\" of tensor names to shard files; the index is damaged: "
                              "download it again")
    return weight_map


def _read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        reason = _first_line(e) or type(e).__name__
        raise CheckpointError(f"{path} is not a readable safetensors file ({reason}); it is truncated or damaged: "
                              "download it again") from None


def _read_pickle(path: str) -> Dict[str, torch.Tensor]:
    """Weights-only: a pickle that names anything but tensors and containers is refused, never run."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler's errors are of many kinds (UnpicklingError, RuntimeError, EOFError)
        raise CheckpointError(f"{path} cannot be read as weights only ({_unpickle_reason(e)}); megacoat never runs "
                              "code from a pickle: save the model as safetensors where you trust it "
                              "(model.save_pretrained(dir)), or download its .safetensors files") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError(f"{path} does not hold a {{name: tensor}} state dict; it is not a model's weights file")
    return data


def _unpickle_reason(e: BaseException) -> str:
    """The line of torch's multi-paragraph weights-only error that says what was refused."""
    msg = str(e)
    named = re.search(r"Unsupported global: GLOBAL (\S+)", msg)
    if named:
        return f"it names {named.group(1)}, which could run code"
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", msg)
    if detail:
        return f"{detail.group(1).strip()}: damaged, or not a weights file"
    first = _first_line(e)
    return f"{type(e).__name__}: {first}" if first else f"{type(e).__name__}: empty or truncated"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def unused_weights(weights: HFWeights, ignored_suffixes: Tuple[str, ...]) -> List[str]:
    return sorted(k for k in set(weights) - weights.used if not k.endswith(ignored_suffixes))
