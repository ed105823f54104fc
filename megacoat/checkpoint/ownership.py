"""Who owns a --save directory: one run at a time, and only its own checkpoints are pruned.

A run holds an exclusive `flock` on `<save>/.megacoat-save.lock` for as long as it may write
there, with its host, pid and run id in the file. The kernel drops the lock when the process
dies, however it dies, so a lock file whose lock is free belongs to a run that ended: the next
run takes it over (and says so when the previous owner did not release it cleanly).

Every checkpoint records the id of the run that wrote it (`run_id` in metadata.json). A resumed
run keeps the id of the checkpoint it loaded, so "this run" spans preemptions; a run that did not
resume from a directory's checkpoints may not write there, and retention (`--save-retain`) only
ever deletes checkpoints carrying this run's id.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from typing import Callable, Dict, Optional

from .format import METADATA_FILE, CheckpointError, complete_iterations, iteration_dir_name

LOCK_FILE = ".megacoat-save.lock"
# Filesystems without flock support (some network mounts): the run goes on unlocked, with a warning.
_NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _describe(owner: dict) -> str:
    return (f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, "
            f"started {owner.get('started', '?')}")


class SaveDirLock:
    """An exclusive lock on a save directory, held until `release()` or the process ends. `flag` names the
    directory in messages (pretrain_gpt.py's --save, convert.py's --save-dir)."""

    def __init__(self, save_dir: str, run_id: str, log: Callable[[str], None] = print, flag: str = "--save"):
        self.path = os.path.join(save_dir, LOCK_FILE)
        self._fd: Optional[int] = None
        try:
            os.makedirs(save_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot create {self.path}: {e}; check that {flag} {save_dir} is writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read_owner(fd)
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise CheckpointError(
                    f"{flag} {save_dir} is in use by another run ({_describe(owner)}): two runs writing one "
                    f"directory destroy each other's checkpoints. Stop that run, or pass another {flag} directory"
                ) from None
            if e.errno in _NO_LOCKING:
                log(f"warning: the filesystem of {save_dir} does not support file locks ({e.strerror}); nothing "
                    "stops a second run from writing this --save directory")
                return
            raise CheckpointError(f"cannot lock {self.path}: {e}") from None
        previous = _read_owner(fd)
        if previous:
            log(f"taking over {flag} {save_dir} from a run that ended without releasing it ({_describe(previous)})")
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._fd = fd

    def __enter__(self) -> "SaveDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Clear the owner (a clean end: the next run takes over silently) and unlock."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # closing the only descriptor drops the flock
        self._fd = None


def _read_owner(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"host": "unknown (unreadable lock file)"}


def run_ids_of_checkpoints(save_dir: str) -> Dict[int, Optional[str]]:
    """{iteration: run id} of the complete checkpoints in `save_dir` (None: saved without one)."""
    out = {}
    for it in complete_iterations(save_dir):
        path = os.path.join(save_dir, iteration_dir_name(it), METADATA_FILE)
        try:
            with open(path) as f:
                out[it] = json.load(f).get("run_id")
        except (OSError, ValueError):
            out[it] = None  # unreadable: not ours, never pruned
    return out


def check_save_dir_is_ours(save_dir: str, run_id: str, resumed_at: Optional[int],
                           finetuned_here: bool = False) -> Dict[int, Optional[str]]:
    """Refuse a --save directory whose checkpoints of another run this run could overwrite; returns
    its {iteration: run id}. `resumed_at`: the iteration this run loaded from `save_dir` (None when it
    did not load from there). Another run's checkpoints older than that are left alone.
    `finetuned_here`: this run loaded `save_dir`'s weights under --finetune (a new run from iteration 0)."""
    found = run_ids_of_checkpoints(save_dir)
    foreign = sorted(it for it, rid in found.items()
                     if rid != run_id and (resumed_at is None or it > resumed_at))
    if foreign:
        shown = ", ".join(map(str, foreign[-4:]))
        if finetuned_here:
            raise CheckpointError(
                f"--finetune starts a new run at iteration 0 from the weights in {save_dir}, whose checkpoints "
                f"(iteration {shown}) its saves would overwrite or hide: give --save another directory (--load "
                f"{save_dir} stays as it is)")
        how = (f"Pass --load {save_dir} to continue that run" if resumed_at is None else
               f"Move them away or pass --load {save_dir} (its newest checkpoint) to continue that run")
        raise CheckpointError(
            f"--save {save_dir} holds checkpoints of another run (iteration {shown}) that this run's saves would "
            f"overwrite or hide. {how}, or choose an empty --save directory")
    return found
