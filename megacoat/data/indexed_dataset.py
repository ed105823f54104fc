"""Megatron's memory-mapped indexed dataset (`.bin` tokens + `.idx` index), read and written.

Layout of `{prefix}.idx` (little endian), the MMIDIDX format of Megatron-LM:
    magic           9 bytes  b"MMIDIDX\\x00\\x00"
    version         <Q       1
    dtype code      <B       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count  <Q       S
    document count  <Q       D (= number of documents + 1)
    sequence lengths  int32[S]   tokens per sequence
    sequence pointers int64[S]   byte offset of each sequence in `.bin`
    document indices  int64[D]   sequence index where each document starts, from 0, ending at S
`{prefix}.bin` is the tokens of all sequences concatenated, in the dtype above.

The reader validates everything it can cheaply check, so that a corrupt, truncated or
mismatched pair of files fails at open with the file and the problem named, and never hands
out tokens read from outside the data.
"""
from __future__ import annotations

import os
import shutil
import struct
from array import array
from typing import Iterable, Optional, Sequence

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A `.bin/.idx` pair is missing, corrupt, truncated or inconsistent."""


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        raise IndexedDatasetError(
            f"dtype {dt} cannot be stored in a Megatron indexed dataset; use one of "
            f"{', '.join(str(d) for d in DTYPE_CODES.values())}")
    return _CODE_OF_DTYPE[dt]


def best_token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 tokens below 65,500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Streams sequences into `{prefix}.bin` and writes `{prefix}.idx` on finalize().

    Usage: add_document(tokens) per document (one sequence), or add_item(tokens) per
    sequence followed by end_document(); add_index(other_prefix) appends a whole dataset.
    Writes go to temporary names that are renamed into place by finalize(), so a reader
    never sees a half-written dataset.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # fail early on unsupported dtypes
        self._tmp_suffix = f".tmp{os.getpid()}"
        self._bin_tmp = data_file_path(prefix) + self._tmp_suffix
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array("q")  # kept int64 while building; checked to fit int32 at finalize
        self._document_indices = array("q", [0])
        self._finalized = False

    # -- writing -------------------------------------------------------------------------
    def add_item(self, tokens) -> None:
        """Append one sequence (does not end the document)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.dtype != self.dtype:
            cast = arr.astype(self.dtype)
            if arr.size and arr.dtype.kind in "iu" and not np.array_equal(cast, arr):
                raise IndexedDatasetError(
                    f"token ids do not fit the dataset dtype {self.dtype} (max id {arr.max()}); "
                    "write with a wider dtype (int32) or a smaller vocabulary")
            arr = cast
        self._bin.write(np.ascontiguousarray(arr).tobytes(order="C"))
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens, lengths: Optional[Sequence[int]] = None) -> None:
        """Append one document: a single sequence, or several when `lengths` splits it."""
        arr = np.asarray(tokens).reshape(-1)
        if lengths is None:
            self.add_item(arr)
        else:
            if sum(lengths) != arr.size:
                raise IndexedDatasetError(f"lengths sum to {sum(lengths)} but the document has {arr.size} tokens")
            start = 0
            for n in lengths:
                self.add_item(arr[start:start + n])
                start += n
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Merge: append every sequence and document of the dataset at `prefix`."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {index_file_path(prefix)}: its dtype {other.dtype} differs from the builder's {self.dtype}")
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())
        other.close()
        with open(data_file_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, length=16 << 20)

    # -- finishing -----------------------------------------------------------------------
    def finalize(self) -> None:
        if self._finalized:
            return
        if self._document_indices[-1] != len(self._lengths):
            self.end_document()  # close a document left open, as Megatron's finalize does not
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if len(self._lengths) else np.zeros(0, np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise IndexedDatasetError("a sequence longer than 2^31-1 tokens cannot be indexed (int32 lengths)")
        write_index(index_file_path(self.prefix), self.dtype, lengths,
                    np.frombuffer(self._document_indices, dtype=np.int64))
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        """Drop a partial dataset (on errors)."""
        if not self._bin.closed:
            self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)
        self._finalized = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def sequence_pointers(lengths: np.ndarray, dtype) -> np.ndarray:
    """Byte offset of each sequence: the exclusive cumulative sum of lengths * itemsize."""
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    return pointers


def write_index(path: str, dtype, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a `.idx` file atomically (temporary name, then rename)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(dtype), len(lengths), len(document_indices)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(sequence_pointers(lengths, dtype).astype("<i8").tobytes(order="C"))
        f.write(document_indices.astype("<i8").tobytes(order="C"))
    os.replace(tmp, path)


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin/.idx` pair; validated at open."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._bin_mmap = None
        self._read_index()
        self._check_data_file()

    # -- opening and validation ----------------------------------------------------------
    def _read_index(self) -> None:
        path = index_file_path(self.prefix)
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"{path}: index file not found (is --data-path a prefix without .bin/.idx?)")
        size = os.path.getsize(path)
        if size < _HEADER.size:
            raise IndexedDatasetError(f"{path}: truncated header ({size} bytes, need {_HEADER.size})")
        with open(path, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != INDEX_MAGIC:
            raise IndexedDatasetError(f"{path}: bad magic {magic!r}, not a Megatron MMIDIDX index")
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version} (only {INDEX_VERSION} is known)")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code} (valid: 1-8)")
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size != expected:
            raise IndexedDatasetError(
                f"{path}: size {size} bytes disagrees with its header ({n_seq} sequences, {n_doc} document "
                f"indices need {expected} bytes): the file is truncated or has trailing data")
        self.dtype = DTYPE_CODES[code]
        mm = np.memmap(path, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=off)
        self._index_mmap = mm
        di = self.document_indices
        if n_doc < 1 or di[0] != 0 or di[-1] != n_seq or (n_doc > 1 and np.any(np.diff(di) < 0)):
            raise IndexedDatasetError(
                f"{path}: document indices are inconsistent (must start at 0, never decrease and end at the "
                f"sequence count {n_seq})")
        if n_seq and self.sequence_lengths.min() < 0:
            raise IndexedDatasetError(f"{path}: negative sequence length")

    def _check_data_file(self) -> None:
        path = data_file_path(self.prefix)
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"{path}: data file not found next to {index_file_path(self.prefix)}")
        size = os.path.getsize(path)
        itemsize = self.dtype.itemsize
        if len(self.sequence_lengths):
            ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * itemsize
            if self.sequence_pointers.min() < 0 or (self.sequence_pointers % itemsize).any():
                raise IndexedDatasetError(f"{index_file_path(self.prefix)}: invalid sequence pointers")
            expected = int(ends.max())
        else:
            expected = 0
        if size != expected:
            problem = "truncated" if size < expected else "longer than its index says"
            raise IndexedDatasetError(
                f"{path}: {size} bytes but the index points to {expected} bytes: the data file is {problem} "
                f"or belongs to another index")
        self._bin_size = size

    def _data(self) -> np.ndarray:
        # Opened lazily so that datasets pickle cheaply into DataLoader workers.
        if self._bin_mmap is None:
            if self._bin_size == 0:
                self._bin_mmap = np.zeros(0, dtype=np.uint8)
            else:
                self._bin_mmap = np.memmap(data_file_path(self.prefix), mode="r", dtype=np.uint8)
        return self._bin_mmap

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def close(self) -> None:
        self._bin_mmap = None
        self._index_mmap = None

    # -- access --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence idx (a read-only view of the mapping)."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {seq_len}")
        ptr = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data(), dtype=self.dtype, count=length, offset=ptr)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def document(self, doc: int) -> Iterable[np.ndarray]:
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(lo, hi)]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))
