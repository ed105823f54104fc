"""Index builders for the GPT and blended datasets: C++ (megacoat._data_helpers) or numpy.

Both backends return identical arrays; the C++ one is preferred when it was built, and
`backend="numpy"` / `backend="cpp"` forces one (tests compare them).

build_sample_index(sizes, document_index, seq_length) -> int64 [num_samples + 1, 2]
    Row i is (position in document_index, token offset) where sample i starts. Samples hold
    seq_length + 1 tokens, so consecutive samples overlap by one token (the last label of a
    sample is the first input of the next); a sample whose end falls exactly at the end of a
    document ends there. The last partial sample is dropped (Megatron semantics).
build_blending_indices(weights, size) -> (dataset_index int16 [size], dataset_sample_index int64 [size])
    Greedy: sample i comes from the dataset that is furthest behind its share weights * i.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

try:
    from megacoat import _data_helpers as _cpp
except ImportError:  # the compiled helper is optional
    _cpp = None


def cpp_available() -> bool:
    return _cpp is not None


def _pick(backend: Optional[str]):
    if backend is None:
        return "cpp" if _cpp is not None else "numpy"
    if backend == "cpp" and _cpp is None:
        raise RuntimeError("megacoat._data_helpers is not built; run `pip install -e .` (needs a C++ compiler)")
    if backend not in ("cpp", "numpy"):
        raise ValueError(f"unknown backend {backend!r}: use 'cpp' or 'numpy'")
    return backend


def num_samples_in(total_tokens: int, seq_length: int) -> int:
    """Full samples of seq_length + 1 tokens in a stream of total_tokens (samples share one token)."""
    return max(int(total_tokens) - 1, 0) // seq_length


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       backend: Optional[str] = None) -> np.ndarray:
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    document_index = np.ascontiguousarray(document_index, dtype=np.int32)
    if seq_length < 1:
        raise ValueError("seq_length must be >= 1")
    if _pick(backend) == "cpp":
        return _cpp.build_sample_index(sizes, document_index, int(seq_length))
    return _build_sample_index_numpy(sizes, document_index, seq_length)


def _build_sample_index_numpy(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    doc_lengths = sizes[document_index].astype(np.int64)
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)  # token position where each document begins
    np.cumsum(doc_lengths, out=starts[1:])
    num_samples = num_samples_in(starts[-1], seq_length)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document holding position p is the last one starting at or before p (empty ones are skipped).
    doc = np.searchsorted(starts, positions, side="right") - 1
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    out[:, 0] = doc
    out[:, 1] = positions - starts[doc]
    out[0] = 0  # sample 0 starts at the first entry, even if that document is empty
    return out


def build_blending_indices(weights, size: int, backend: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if len(weights) > np.iinfo(np.int16).max:
        raise ValueError("at most 32767 datasets can be blended")
    if _pick(backend) == "cpp":
        return _cpp.build_blending_indices(weights, int(size))
    return _build_blending_indices_numpy(weights, int(size))


def _build_blending_indices_numpy(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    # The greedy choice depends on every earlier choice, so this stays a loop; it mirrors the
    # C++ code operation for operation (same float64 arithmetic) so results are identical.
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    counts = np.zeros(len(weights), dtype=np.int64)
    w = weights.tolist()
    c = [0] * len(w)
    for i in range(size):
        x = float(max(i, 1))
        best, best_err = 0, w[0] * x - c[0]
        for d in range(1, len(w)):
            err = w[d] * x - c[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = c[best]
        c[best] += 1
    counts[:] = c
    return dataset_index, dataset_sample_index
