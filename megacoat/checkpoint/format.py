"""On-disk layout of a checkpoint, and the crash-safe file primitives it is written with.

    <save>/latest_checkpointed_iteration.txt     Megatron's tracker: the last complete iteration
    <save>/iter_0000100/metadata.json           index: config, layout, every tensor's pieces
    <save>/iter_0000100/common.pt               train state, scheduler, optimizer scalars, RNG per rank
    <save>/iter_0000100/rank_00003.bin          raw bytes of the pieces rank 3 wrote
    <save>/iter_0000100/tokenizer/              a copy of the tokenizer model (when it is a file)

A checkpoint is written under `.iter_0000100.partial/`, every file fsynced, then renamed to
`iter_0000100/` (re-saving an existing iteration exchanges the two directories atomically, see
`replace_directory`); the tracker is replaced (write, fsync, rename) last. `metadata.json` is the last
file written inside the directory, so a directory without it is never a checkpoint.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import zlib
from typing import Callable, List, Optional

from ..config import ConfigError

FORMAT_NAME = "megacoat-checkpoint"
FORMAT_VERSION = 1
TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
COMMON_FILE = "common.pt"
TOKENIZER_DIR = "tokenizer"
ALIGN = 64  # byte alignment of pieces inside a rank file


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or read as asked; the message names the problem and the fix."""


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def partial_dir_name(iteration: int) -> str:
    return f".{iteration_dir_name(iteration)}.partial"


def replaced_dir_name(iteration: int) -> str:
    """Where a re-saved iteration's old directory waits while the new one moves in (only where
    directories cannot be exchanged atomically); the reader falls back to it."""
    return f".{iteration_dir_name(iteration)}.replaced"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.bin"


CRC_CHUNK = 16 << 20  # pieces are checksummed in chunks of 16 MiB, in parallel (zlib releases the GIL)


def crc32_of(buffer) -> int:
    return zlib.crc32(buffer) & 0xFFFFFFFF


def chunk_crc_futures(buffer: memoryview, pool) -> list:
    """Start CRC32s of the buffer's CRC_CHUNK-sized chunks on a thread pool."""
    return [pool.submit(crc32_of, buffer[i: i + CRC_CHUNK]) for i in range(0, max(len(buffer), 1), CRC_CHUNK)]


def checksum_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 2)))


def fsync_dir(path: str) -> None:
    """Make a rename or file creation inside `path` durable (POSIX needs the directory synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a written file to disk (before a rename publishes it)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def copy_file_durably(src: str, dst: str) -> None:
    """Copy and fsync: the copy is on disk before anything that refers to it is published."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())


def write_file_atomic(path: str, data: bytes) -> None:
    """Write, flush, fsync, rename: readers see the old file or the whole new one, never a part."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE). False where the OS or
    the filesystem cannot do it; other failures raise OSError."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def replace_directory(new: str, final: str, replaced: str) -> None:
    """Put directory `new` at the existing directory `final`, so that a crash at any moment leaves a
    complete directory at `final`, or (without an atomic exchange) at `replaced`, which
    resolve_checkpoint_dir falls back to. `new` is consumed; the old contents are deleted."""
    parent = os.path.dirname(os.path.abspath(final))
    if exchange_paths(new, final):  # `final` is the old or the new directory at every instant
        fsync_dir(parent)
        shutil.rmtree(new)  # now the old contents
        return
    shutil.rmtree(replaced, ignore_errors=True)  # stale: `final` exists, so nothing refers to it
    os.rename(final, replaced)
    fsync_dir(parent)
    os.rename(new, final)
    fsync_dir(parent)
    shutil.rmtree(replaced)


def write_tracker(save_dir: str, iteration: int) -> None:
    write_file_atomic(os.path.join(save_dir, TRACKER_FILE), f"{iteration}\n".encode())


def read_tracker(load_dir: str) -> Optional[int]:
    """The iteration named by the tracker, None when there is no tracker; errors for a bad one."""
    path = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text:
        raise CheckpointError(f"tracker file {path} is empty (a save was interrupted before megacoat wrote it "
                              "atomically, or it was edited): write the iteration to load into it, e.g. "
                              f"`echo 100 > {path}`, or delete it to start from scratch")
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"tracker file {path} holds {text!r}, not an iteration number") from None


def write_json_atomic(path: str, obj: dict) -> None:
    write_file_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


def complete_iterations(save_dir: str) -> List[int]:
    """Iterations of the complete checkpoints (iter_* directories with their metadata.json) in `save_dir`, sorted."""
    if not os.path.isdir(save_dir):
        return []
    found = (_ITERATION_DIR.match(n) for n in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found
                  if m and os.path.isfile(os.path.join(save_dir, m.group(0), METADATA_FILE)))


def resolve_checkpoint_dir(load_dir: str, log: Optional[Callable[[str], None]] = None) -> str:
    """`load_dir` may be a save directory (with a tracker) or one iteration's directory. A save
    directory whose tracker is missing (a crash between publishing a checkpoint and writing the
    tracker, or a copy without it) loads its newest complete checkpoint, and says so through `log`.
    A Hugging Face model or a Megatron-LM checkpoint given instead is named, with its conversion."""
    try:
        return _resolve_checkpoint_dir(load_dir, log)
    except CheckpointError:
        foreign = foreign_format_hint(load_dir)
        if foreign:
            raise CheckpointError(f"{load_dir} is {foreign}") from None
        raise


def _resolve_checkpoint_dir(load_dir: str, log: Optional[Callable[[str], None]]) -> str:
    if os.path.exists(load_dir) and not os.path.isdir(load_dir):
        raise CheckpointError(f"{load_dir} is a file, not a checkpoint directory; check --load")
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist; check --load")
    if os.path.exists(os.path.join(load_dir, METADATA_FILE)):
        return load_dir
    iteration = read_tracker(load_dir)
    if iteration is None:
        found = complete_iterations(load_dir)
        if not found:
            raise CheckpointError(f"{load_dir} holds no checkpoint: neither {TRACKER_FILE} nor {METADATA_FILE} "
                                  "nor a complete iter_* directory is there; point --load at a directory megacoat "
                                  "saved to")
        path = os.path.join(load_dir, iteration_dir_name(found[-1]))
        (log or print)(f"{load_dir} has no {TRACKER_FILE}: loading its newest complete checkpoint {path}")
        return path
    path = os.path.join(load_dir, iteration_dir_name(iteration))
    replaced = os.path.join(load_dir, replaced_dir_name(iteration))
    if not os.path.isdir(path) and os.path.exists(os.path.join(replaced, METADATA_FILE)):
        return replaced  # a re-save of this iteration stopped half-way: its previous version is complete
    if not os.path.isdir(path):
        raise CheckpointError(f"the tracker in {load_dir} names iteration {iteration} but {path} does not exist; "
                              f"edit {TRACKER_FILE} to name an existing iter_* directory")
    return path


_CONVERT = "tools/checkpoint/convert.py"


def foreign_format_hint(path: str) -> Optional[str]:
    """What `path` is when it is not a megacoat checkpoint but a format the converter reads (a Hugging
    Face model, a Megatron-LM checkpoint or one of its iterations), with the command that converts it."""
    if not os.path.isdir(path):
        return None
    names = set(os.listdir(path))
    if "config.json" in names and any(n.endswith((".safetensors", ".bin", ".safetensors.index.json")) for n in names):
        return (f"a Hugging Face model directory, not a megacoat checkpoint: convert it first with {_CONVERT} "
                f"--load-format hf --load-dir {path} --save-format megacoat --save-dir NEW_DIR")
    iteration_dirs = [os.path.join(path, n) for n in names if n == "release" or n.startswith("iter_")]
    for d in [path] + [d for d in iteration_dirs if os.path.isdir(d)]:
        inside = os.listdir(d)
        if ".metadata" in inside or any(n.startswith("mp_rank_") for n in inside):
            return (f"a Megatron-LM checkpoint, not a megacoat one: convert it first with {_CONVERT} "
                    f"--load-format megatron --load-dir {path} --save-format megacoat --save-dir NEW_DIR")
    return None
