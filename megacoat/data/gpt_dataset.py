"""GPT samples over an indexed dataset: document, sample and shuffle indices (Megatron semantics).

A GPT dataset views a range of sequences ("documents") of an IndexedDataset as one token
stream: the documents of each epoch in a seeded random order, epochs one after another. The
stream is cut into samples of seq_length + 1 tokens (input and shifted labels) that cross
document boundaries; consecutive samples share one token. Samples are then visited in a
seeded random order.

- document index: the documents of all epochs, each epoch shuffled (int32)
- sample index:   [num_samples + 1, 2] (position in the document index, token offset) where
                  each sample starts (helpers.build_sample_index)
- shuffle index:  a permutation of the samples

As in Megatron, when the last epoch is needed only for a small part (< 80%) of its samples,
it is shuffled separately from the earlier epochs, so that the few samples taken from it do
not come from a re-shuffle of the whole dataset.
The three arrays are cached as .npy files keyed by a hash of everything that defines them.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Optional, Tuple

import numpy as np

from megacoat.data import helpers
from megacoat.data.file_lock import exclusive_lock, save_npy_atomic, write_text_atomic
from megacoat.data.indexed_dataset import IndexedDataset, index_file_path

INDEX_FORMAT_VERSION = 1  # bump when the index building changes, to invalidate caches
_FINAL_EPOCH_THRESHOLD = 0.80


class EmptySplitError(ValueError):
    """The documents of a split hold too few tokens for one sample."""


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset has no tokens")
    needed = num_samples * seq_length + 1  # +1: the last sample's final label
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffle [0, num_samples) and [num_samples, total_size) separately, then concatenate."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int, seed: int,
                      backend: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) giving at least num_samples samples."""
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[documents].sum())
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_from_final = num_samples - samples_before_final
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = samples_from_final < int(_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = helpers.build_sample_index(sizes, document_index, seq_length, backend=backend)
    total = sample_index.shape[0] - 1
    shuffled = samples_before_final if separate_final_epoch else total
    shuffle_index = build_shuffle_index(shuffled, total, rng)
    return document_index, sample_index, shuffle_index


def _describe(prefix: str, documents: np.ndarray, seq_length: int, num_samples: int, seed: int, split: str) -> dict:
    idx_path = index_file_path(prefix)
    st = os.stat(idx_path)
    return {
        "class": "GPTDataset",
        "format": INDEX_FORMAT_VERSION,
        "prefix": os.path.abspath(prefix),
        # The data itself: changing or regenerating the files invalidates the cache.
        "index_size": st.st_size,
        "index_mtime_ns": st.st_mtime_ns,
        "bin_size": os.path.getsize(prefix + ".bin"),
        "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
        "num_documents": len(documents),
        "seq_length": seq_length,
        "num_samples": num_samples,
        "seed": seed,
        "split": split,
    }


def load_or_build_indices(prefix: str, sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int,
                          seed: int, split: str, cache_dir: Optional[str], log=None):
    """Indices from the cache, or built (under a lock, so concurrent ranks build them once)."""
    description = _describe(prefix, documents, seq_length, num_samples, seed, split)
    if cache_dir is None:
        return build_gpt_indices(sizes, documents, seq_length, num_samples, seed)
    key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    stem = os.path.join(cache_dir, f"{key}-GPTDataset-{split}")
    names = ("document_index", "sample_index", "shuffle_index")
    paths = [f"{stem}-{n}.npy" for n in names]
    if not all(os.path.isfile(p) for p in paths):
        with exclusive_lock(stem + ".lock"):
            if not all(os.path.isfile(p) for p in paths):
                t0 = time.perf_counter()
                arrays = build_gpt_indices(sizes, documents, seq_length, num_samples, seed)
                write_text_atomic(stem + "-description.json", json.dumps(description, indent=2, sort_keys=True))
                for p, a in zip(paths, arrays):
                    save_npy_atomic(p, a)
                if log:
                    log(f"built {split} indices for {prefix} ({len(arrays[1]) - 1} samples) in "
                        f"{time.perf_counter() - t0:.2f}s, cached under {stem}-*.npy")
    return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)


class GPTDataset:
    """Samples of seq_length + 1 tokens (int64) over documents [begin, end) of an indexed dataset."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int, num_samples: int, seed: int,
                 split: str = "train", cache_dir: Optional[str] = None, log=None):
        if len(documents) == 0:
            raise EmptySplitError(f"{indexed.prefix}: the {split} split has no documents")
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples_requested = num_samples
        tokens = int(indexed.sequence_lengths[documents].sum(dtype=np.int64))
        if tokens < 2:
            raise EmptySplitError(f"{indexed.prefix}: the {split} split has {tokens} tokens; a sample needs at least 2")
        self.document_index, self.sample_index, self.shuffle_index = load_or_build_indices(
            indexed.prefix, indexed.sequence_lengths, documents, seq_length, num_samples, seed, split, cache_dir, log)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        i = int(self.shuffle_index[idx])
        (beg, beg_off), (end, end_off) = self.sample_index[i], self.sample_index[i + 1]
        beg, beg_off, end, end_off = int(beg), int(beg_off), int(end), int(end_off)
        doc = self.document_index
        if beg == end:
            tokens = self.indexed.get(int(doc[beg]), beg_off, end_off - beg_off + 1)
            return tokens.astype(np.int64)
        parts = [self.indexed.get(int(doc[beg]), beg_off)]
        parts += [self.indexed.get(int(doc[j])) for j in range(beg + 1, end)]
        parts.append(self.indexed.get(int(doc[end]), 0, end_off + 1))
        return np.concatenate(parts).astype(np.int64, copy=False)


class MockGPTDataset:
    """Random tokens in [0, vocab_size), seeded per sample, for speed measurements."""

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int):
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(idx)])
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
