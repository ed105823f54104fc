"""Writing a checkpoint: each rank streams its pieces into one raw file; rank 0 commits.

Rank files are raw bytes (pieces aligned to 64 bytes) so that they can be written piece by
piece without holding a second copy of the state, written from a CPU snapshot in the background
(`--async-save`), and read back into any destination without deserialising anything. The
index (offsets, dtypes, CRC32 per piece) lives in metadata.json.
"""
from __future__ import annotations

import dataclasses
import io
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .collect import Piece, dtype_name
from .format import (ALIGN, COMMON_FILE, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, CheckpointError,
                     checksum_threads, chunk_crc_futures, crc32_of, fsync_dir, iteration_dir_name, partial_dir_name,
                     rank_file_name, replace_directory, replaced_dir_name, write_file_atomic, write_json_atomic,
                     write_tracker)
from .layout import TensorLayout


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def plan_offsets(pieces: List[Piece]) -> (List[int], int):
    offsets, pos = [], 0
    for p in pieces:
        offsets.append(pos)
        pos = _aligned(pos + p.tensor.numel() * p.tensor.element_size())
    return offsets, pos


def piece_records(pieces: List[Piece], offsets: List[int], crcs: List[List[int]], file: str) -> List[dict]:
    return [{"kind": p.kind, "name": p.name, "tp_rank": p.tp_rank, "start": p.start, "end": p.end,
             "dtype": dtype_name(p.tensor.dtype), "file": file, "offset": o,
             "nbytes": p.tensor.numel() * p.tensor.element_size(), "crc32": c, **({"group": p.group} if p.group > 1 else {})}
            for p, o, c in zip(pieces, offsets, crcs)]


def write_pieces(path: str, pieces: List[Piece], offsets: List[int]) -> List[List[int]]:
    """Stream pieces into `path` (device tensors are copied to the host one piece at a time).

    Returns each piece's chunk CRC32s, computed on other threads while the piece is written."""
    crcs = []
    with open(path, "wb") as f, ThreadPoolExecutor(checksum_threads()) as pool:
        for p, off in zip(pieces, offsets):
            f.seek(off)
            data = _as_bytes(p.tensor.detach().cpu())
            pending = chunk_crc_futures(data, pool)
            f.write(data)
            crcs.append([c.result() for c in pending])
        f.truncate(_aligned(f.tell()))
        f.flush()
        os.fsync(f.fileno())
    return crcs


class HostSnapshot:
    """One reusable host buffer holding the image of a rank file (pinned on GPU hosts).

    Bounded memory for --async-save: one snapshot exists at a time, reused across saves.
    """

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None

    def take(self, pieces: List[Piece], offsets: List[int], total: int) -> List[Piece]:
        pinned = any(p.tensor.is_cuda for p in pieces)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # free the old one first
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pinned)
        out = []
        for p, off in zip(pieces, offsets):
            n = p.tensor.numel() * p.tensor.element_size()
            dst = self.buffer[off: off + n].view(p.tensor.dtype)
            dst.copy_(p.tensor.detach(), non_blocking=pinned)
            out.append(dataclasses.replace(p, tensor=dst))  # every field but the tensor, per-group ones included
        if pinned:
            torch.cuda.current_stream().synchronize()
        return out


class BackgroundWrite:
    """Writes snapshotted pieces in a thread; `result()` joins and re-raises its error."""

    def __init__(self, path: str, pieces: List[Piece], offsets: List[int]):
        self._crcs: Optional[List[int]] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(path, pieces, offsets), daemon=True,
                                        name="megacoat-checkpoint-writer")
        self._thread.start()

    def _run(self, path, pieces, offsets):
        try:
            self._crcs = write_pieces(path, pieces, offsets)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread by result()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> List[int]:
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"background checkpoint write failed: {self._error}") from self._error
        return self._crcs


@dataclass
class RankSave:
    """Everything one rank contributes to one checkpoint, gathered at commit."""

    rank: int
    layouts: Dict[str, dict]
    dtypes: Dict[str, str]
    records: List[dict] = field(default_factory=list)
    rng: Optional[dict] = None
    error: Optional[str] = None   # this rank could not write its file: nobody publishes


def merge_index(contributions: List[RankSave]) -> (Dict[str, dict], Dict[str, dict]):
    """Per-tensor index {"kind/name": {layout, dtype, pieces}}; checks every element is written."""
    layouts: Dict[str, dict] = {}
    dtypes: Dict[str, str] = {}
    for c in contributions:
        for name, lay in c.layouts.items():
            if layouts.setdefault(name, lay) != lay:
                raise CheckpointError(f"ranks disagree on the layout of {name}: {layouts[name]} vs {lay}")
        dtypes.update(c.dtypes)
    tensors = {key: {"dtype": dt, "pieces": []} for key, dt in dtypes.items()}
    for c in contributions:
        for rec in c.records:
            tensors[f"{rec['kind']}/{rec['name']}"]["pieces"].append(rec)
    for key, entry in tensors.items():
        lay = TensorLayout.from_json(layouts[key.split("/", 1)[1]])
        for tp in range(lay.tp_size):
            spans = [(r["start"], r["end"]) for r in entry["pieces"] if r["tp_rank"] == tp]
            covered = sum(e - s for s, e in spans)
            group = max([r.get("group", 1) for r in entry["pieces"]] or [1])  # per-group state: group counts
            if covered != -(-lay.local_numel // group):  # owned_intervals makes them disjoint: a sum suffices
                raise CheckpointError(f"internal error: pieces of {key} (TP rank {tp}) cover {covered} of "
                                      f"{lay.local_numel} elements; the checkpoint would be incomplete")
    return layouts, tensors


def commit(save_dir: str, iteration: int, mine: RankSave, common: Optional[dict], metadata: Optional[dict],
           extra_files: Callable[[str], dict] = lambda d: {}) -> str:
    """Collective: gather every rank's records; rank 0 writes the index and publishes the checkpoint."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: List = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    final = os.path.join(save_dir, iteration_dir_name(iteration))
    error = None
    failed = [f"rank {c.rank}: {c.error}" for c in everyone if c.error]
    if failed:
        raise CheckpointError(f"saving checkpoint {final} failed, the previous checkpoint stays the latest: "
                              + "; ".join(failed))
    if mine.rank == 0:
        try:
            publish(save_dir, iteration, everyone, common, metadata, extra_files)
        except BaseException as e:  # noqa: BLE001 - every rank must learn that the save failed
            error = e
    raise_if_any_failed(error, f"saving checkpoint {final}")
    return final


def publish(save_dir, iteration, everyone, common, metadata, extra_files):
    partial = os.path.join(save_dir, partial_dir_name(iteration))
    final = os.path.join(save_dir, iteration_dir_name(iteration))
    layouts, tensors = merge_index(everyone)
    common = dict(common or {})
    common["rng"] = {c.rank: c.rng for c in everyone if c.rng is not None}
    buf = io.BytesIO()
    torch.save(common, buf)
    common_bytes = buf.getvalue()
    write_file_atomic(os.path.join(partial, COMMON_FILE), common_bytes)
    meta = dict(metadata or {})
    meta.update(format=FORMAT_NAME, version=FORMAT_VERSION, iteration=iteration, layouts=layouts, tensors=tensors,
                common_crc32=crc32_of(common_bytes), extra=extra_files(partial))
    write_json_atomic(os.path.join(partial, METADATA_FILE), meta)  # last file: marks the directory complete
    fsync_dir(partial)
    if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): never a moment without it
        replace_directory(partial, final, os.path.join(save_dir, replaced_dir_name(iteration)))
    else:
        os.rename(partial, final)
    fsync_dir(save_dir)
    write_tracker(save_dir, iteration)
    for name in os.listdir(save_dir):  # a re-save that stopped half-way left one; the tracker has moved on
        if name.startswith(".iter_") and name.endswith(".replaced"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def raise_if_any_failed(error: Optional[BaseException], what: str) -> None:
    failed = error is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flags: List = [None] * dist.get_world_size()
        dist.all_gather_object(flags, repr(error) if failed else None)
        msgs = [f"rank {r}: {m}" for r, m in enumerate(flags) if m is not None]
    else:
        msgs = [repr(error)] if failed else []
    if msgs:
        if error is not None:
            raise CheckpointError(f"{what} failed: " + "; ".join(msgs)) from error
        raise CheckpointError(f"{what} failed: " + "; ".join(msgs))


def prepare_partial_dir(save_dir: str, iteration: int, rank: int) -> str:
    """Collective: rank 0 clears what a crashed save left behind; every rank then sees an empty dir."""
    partial = os.path.join(save_dir, partial_dir_name(iteration))
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as e:
            error = CheckpointError(f"cannot create {partial}: {e}; check that --save is writable")
    raise_if_any_failed(error, f"preparing {partial}")
    return partial


def rank_file_path(partial: str, rank: int) -> (str, str):
    name = rank_file_name(rank)
    return os.path.join(partial, name), name
