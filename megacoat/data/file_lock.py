"""Cross-process exclusive lock on a file, and atomic file writes.

Several ranks (or several jobs sharing a cache) may try to build the same cached file at
once. They serialize on a lock file (fcntl.flock, released by the kernel if a process dies),
re-check whether the result appeared while they waited, and publish results by rename, so a
reader never sees a half-written file.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator

import numpy as np


@contextlib.contextmanager
def exclusive_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def temporary_name(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


def save_npy_atomic(path: str, array: np.ndarray) -> None:
    tmp = temporary_name(path)
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
    tmp = temporary_name(path)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
