"""Reading a checkpoint into any layout: pieces -> (the same TP-local range | canonical -> new local).

The reader checks everything it can before data reaches the model: the directory is complete
(metadata present, every rank file present and long enough), each piece's dtype and CRC32, and
that the tensor asked for has the same canonical shape as the stored one.
"""
from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from .collect import MODEL_KIND, OPTIM_PREFIX, dtype_from_name
from .format import (COMMON_FILE, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, CheckpointError, checksum_threads,
                     chunk_crc_futures, crc32_of, foreign_format_hint)
from .layout import TensorLayout


class CheckpointReader:
    def __init__(self, path: str):
        self.path = path
        meta_path = os.path.join(path, METADATA_FILE)
        if not os.path.exists(meta_path):
            foreign = foreign_format_hint(path)
            if foreign:
                raise CheckpointError(f"{path} is {foreign}")
            raise CheckpointError(f"{path} is not a complete checkpoint ({METADATA_FILE} missing: the save was "
                                  "interrupted); load the previous iteration or fix the tracker")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{meta_path} is unreadable ({e}); the checkpoint is corrupted") from None
        if not isinstance(self.meta, dict):
            raise CheckpointError(f"{meta_path} holds a JSON {type(self.meta).__name__}, not an object; the checkpoint "
                                  "is corrupted: load another iteration")
        if self.meta.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path} is not a megacoat checkpoint (format {self.meta.get('format')!r}); "
                                  "Hugging Face directories are converted with tools/checkpoint/convert.py")
        if self.meta.get("version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{path} was written by a newer megacoat (format version {self.meta['version']} > "
                                  f"{FORMAT_VERSION}); upgrade megacoat to load it")
        lacking = [k for k in ("iteration", "layouts", "tensors", "vocab_size") if k not in self.meta]
        if lacking:
            raise CheckpointError(f"{meta_path} lacks {', '.join(lacking)}; the checkpoint is corrupted (or the file "
                                  "was edited): load another iteration")
        self.layouts = {n: TensorLayout.from_json(d) for n, d in self.meta["layouts"].items()}
        self.tensors: Dict[str, dict] = self.meta["tensors"]
        self._files: Dict[str, io.BufferedReader] = {}
        self._pool = ThreadPoolExecutor(checksum_threads())
        self._check_files()

    # ----------------------------------------------------------------------------- queries
    @property
    def iteration(self) -> int:
        return self.meta["iteration"]

    @property
    def config(self) -> dict:
        return self.meta.get("config", {})

    def names(self) -> List[str]:
        return sorted(self.layouts)

    def optimizer_states(self, name: str) -> List[str]:
        return sorted(k.split("/", 1)[0][len(OPTIM_PREFIX):] for k in self.tensors
                      if k.startswith(OPTIM_PREFIX) and k.split("/", 1)[1] == name)

    @property
    def has_optimizer(self) -> bool:
        return any(k.startswith(OPTIM_PREFIX) for k in self.tensors)

    def stored_dtype(self, kind: str, name: str) -> torch.dtype:
        return dtype_from_name(self._entry(kind, name)["dtype"])

    def common(self) -> dict:
        path = os.path.join(self.path, COMMON_FILE)
        if not os.path.exists(path):
            raise CheckpointError(f"missing {path}; the checkpoint is incomplete")
        data = open(path, "rb").read()
        if crc32_of(data) != self.meta.get("common_crc32"):
            raise CheckpointError(f"{path} is corrupted (CRC32 mismatch); load another iteration")
        return torch.load(io.BytesIO(data), weights_only=True)

    # ------------------------------------------------------------------------------ reads
    def read_into(self, kind: str, name: str, target: TensorLayout, tp_rank: int, start: int, end: int,
                  out: torch.Tensor) -> None:
        """Fill `out` (1-D, end - start elements) with elements [start, end) of TP rank `tp_rank`'s
        local tensor at layout `target`; casts to out's dtype."""
        src = self._layout(name)
        if tuple(src.canonical_shape) != tuple(target.canonical_shape):
            raise CheckpointError(f"{name}: the checkpoint holds shape {list(src.canonical_shape)} but this model "
                                  f"expects {list(target.canonical_shape)}; the model flags differ from the saved "
                                  "ones (compare with the checkpoint's metadata.json, or pass --use-checkpoint-args)")
        if src.same_local_layout(target):
            out.copy_(self._read_local(kind, name, tp_rank if src.tp_size > 1 else 0, start, end))
            return
        canonical = self.canonical(kind, name)
        out.copy_(target.local_from_canonical(canonical, tp_rank).reshape(-1)[start:end])

    def canonical(self, kind: str, name: str) -> torch.Tensor:
        """The whole tensor without vocabulary padding (reads every TP rank's pieces)."""
        src = self._layout(name)
        locals_ = [self._read_local(kind, name, tp, 0, src.local_numel) for tp in range(src.tp_size)]
        return src.canonical_from_locals(locals_)

    def read_groups(self, kind: str, name: str, tp_rank: int, g0: int, g1: int, out: torch.Tensor) -> None:
        """Per-group state [g0, g1) of a TP rank's local tensor, saved at the same TP layout."""
        src = self._layout(name)
        out.copy_(self._read_local(kind, name, tp_rank if src.tp_size > 1 else 0, g0, g1))

    def canonical_per_element(self, kind: str, name: str, group: int) -> torch.Tensor:
        """A per-group state repeated over each group's elements, as a canonical tensor (for
        resharding across TP sizes, where groups change)."""
        src = self._layout(name)
        n = src.local_numel
        locals_ = [self._read_local(kind, name, tp, 0, -(-n // group)).repeat_interleave(group)[:n]
                   for tp in range(src.tp_size)]
        return src.canonical_from_locals(locals_)

    def same_local_layout(self, name: str, target: TensorLayout) -> bool:
        return self._layout(name).same_local_layout(target)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._pool.shutdown()

    # ---------------------------------------------------------------------------- helpers
    def _entry(self, kind: str, name: str) -> dict:
        key = f"{kind}/{name}"
        if key not in self.tensors:
            what = "model weight" if kind == MODEL_KIND else f"optimizer state {kind[len(OPTIM_PREFIX):]!r}"
            raise CheckpointError(f"{self.path} has no {what} for {name}; the model or optimizer flags differ from "
                                  "the saved ones (or load with --no-load-optim / --finetune for weights only)")
        return self.tensors[key]

    def _layout(self, name: str) -> TensorLayout:
        if name not in self.layouts:
            raise CheckpointError(f"{self.path} has no tensor {name}; the model flags differ from the saved ones "
                                  f"(e.g. --num-layers; the checkpoint's flags are in {METADATA_FILE})")
        return self.layouts[name]

    def _read_local(self, kind: str, name: str, tp: int, start: int, end: int) -> torch.Tensor:
        entry = self._entry(kind, name)
        dtype = dtype_from_name(entry["dtype"])
        out = torch.empty(end - start, dtype=dtype)
        filled = 0
        for rec in entry["pieces"]:
            if rec["tp_rank"] != tp or rec["end"] <= start or rec["start"] >= end:
                continue
            data = self._read_piece(rec, dtype)
            a, b = max(start, rec["start"]), min(end, rec["end"])
            out[a - start: b - start] = data[a - rec["start"]: b - rec["start"]]
            filled += b - a
        if filled != end - start:
            raise CheckpointError(f"{self.path}: pieces of {kind}/{name} (TP rank {tp}) cover {filled} of the "
                                  f"{end - start} elements needed; the checkpoint is incomplete")
        return out

    def _read_piece(self, rec: dict, dtype: torch.dtype) -> torch.Tensor:
        if rec["dtype"] != str(dtype).replace("torch.", ""):
            raise CheckpointError(f"{rec['file']}: piece of {rec['kind']}/{rec['name']} has dtype {rec['dtype']} "
                                  f"but the tensor is {dtype}; the metadata is inconsistent (corrupted checkpoint)")
        f = self._file(rec["file"])
        f.seek(rec["offset"])
        buf = torch.empty(rec["nbytes"], dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")
        if f.readinto(view) != rec["nbytes"]:
            raise CheckpointError(f"{os.path.join(self.path, rec['file'])} is truncated; the checkpoint is corrupted")
        if [c.result() for c in chunk_crc_futures(view, self._pool)] != rec["crc32"]:
            raise CheckpointError(f"{os.path.join(self.path, rec['file'])} is corrupted: CRC32 mismatch in "
                                  f"{rec['kind']}/{rec['name']} [{rec['start']}:{rec['end']}]; load another iteration")
        return buf.view(dtype)

    def _file(self, name: str):
        if name not in self._files:
            self._files[name] = open(os.path.join(self.path, name), "rb")
        return self._files[name]

    def _check_files(self) -> None:
        need: Dict[str, int] = {}
        for entry in self.tensors.values():
            for rec in entry["pieces"]:
                need[rec["file"]] = max(need.get(rec["file"], 0), rec["offset"] + rec["nbytes"])
        for name, size in sorted(need.items()):
            path = os.path.join(self.path, name)
            if not os.path.exists(path):
                raise CheckpointError(f"missing shard {path} (written by rank {_rank_of(name)}); the checkpoint is "
                                      "incomplete: copy the file back or load another iteration")
            if os.path.getsize(path) < size:
                raise CheckpointError(f"shard {path} is truncated ({os.path.getsize(path)} < {size} bytes); "
                                      "the checkpoint is corrupted")


def _rank_of(file_name: str) -> Optional[int]:
    try:
        return int(file_name.split("_")[1].split(".")[0])
    except (IndexError, ValueError):
        return None
