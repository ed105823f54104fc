"""Hugging Face model directories: reading config.json and the weights (safetensors, one file or
sharded; pytorch_model.bin, one file or sharded, through torch's weights-only unpickler only), and
writing a model so that an interrupted write never looks like a model (`staged_hf_dir`).

A directory that is not what it should be (no config, a config that is not a JSON object, a
missing or damaged shard, a pickle that holds code) is a CheckpointError naming the file and
the fix, never a traceback. Missing config keys and weights are errors of the same kind when
the mapping asks for them (`HFConfig`, `HFWeights`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Dict, Iterator, List, Tuple

import torch

from ..checkpoint.format import CheckpointError, fsync_dir, fsync_file

CONFIG_FILE = "config.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_FILE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
STAGE_DIR = ".megacoat-export.partial"  # inside the target: same filesystem, so files move in by rename


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


@contextlib.contextmanager
def staged_hf_dir(save_dir: str, replaced: List[str]) -> Iterator[str]:
    """Yields a directory to write a model's files into; on success they move into `save_dir`.

    Until the new files are all written, `save_dir` is untouched (a forced replacement keeps the old
    model whole). Then config.json, which makes a directory a model for transformers, goes first; the
    `replaced` files of the old model go; the new files move in by rename; config.json comes last. An
    interruption at any point leaves the old model, or a directory without config.json, which no
    loader takes for a model (and a new conversion into it needs --force)."""
    stage = os.path.join(save_dir, STAGE_DIR)
    try:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)  # what an interrupted export left
        os.makedirs(stage)
    except OSError as e:
        raise CheckpointError(f"cannot create {stage}: {e.strerror}; check that --save-dir {save_dir} is writable") \
            from None
    try:
        try:
            yield stage
            written = sorted(os.listdir(stage))
            for name in written:
                fsync_file(os.path.join(stage, name))
        except OSError as e:
            raise CheckpointError(f"writing the model into {stage} failed ({e.strerror}: {e.filename}); {save_dir} "
                                  "is as it was: free space or fix permissions and convert again") from None
        try:
            for name in [CONFIG_FILE] + [n for n in replaced if n != CONFIG_FILE]:
                if os.path.lexists(os.path.join(save_dir, name)):
                    os.remove(os.path.join(save_dir, name))
            fsync_dir(save_dir)
            for name in [n for n in written if n != CONFIG_FILE] + [CONFIG_FILE]:
                os.replace(os.path.join(stage, name), os.path.join(save_dir, name))
            fsync_dir(save_dir)
        except OSError as e:
            raise CheckpointError(f"moving the model into {save_dir} failed ({e.strerror}: {e.filename}); it holds "
                                  "no complete model (no config.json): fix permissions and convert again with "
                                  "--force") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)

