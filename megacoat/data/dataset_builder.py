"""Flags -> train/valid/test datasets: blends, document splits and sample counts (Megatron rules).

- `--data-path A` or `--data-path 0.3 A 0.7 B`: each prefix's documents are split by `--split`
  (e.g. 949,50,1) into train/valid/test ranges; weighted prefixes are blended per split.
- `--train-data-path/--valid-data-path/--test-data-path`: one (weighted) blend per split, no split.
- Samples per split: train = train_iters * gbs; valid = (train_iters // eval_interval + 1) *
  eval_iters * gbs; test = eval_iters * gbs.
- A train split without documents is refused, naming the prefixes and the split; an empty
  valid or test split gives no dataset (None).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megacoat.config import ConfigError, split_fractions
from megacoat.data.blended_dataset import BlendedDataset, component_sizes, normalize_weights
from megacoat.data.gpt_dataset import EmptySplitError, GPTDataset, MockGPTDataset
from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetError

SPLITS = ("train", "valid", "test")
log = logging.getLogger("megacoat.data")


class DataConfigError(ConfigError):
    """Data flags that cannot be satisfied (names the flags)."""


@dataclass(frozen=True)
class Blend:
    prefixes: Tuple[str, ...]
    weights: Optional[Tuple[float, ...]]  # None: unweighted (one prefix, or mixed by token count)


def parse_blend(tokens: Sequence[str], flag: str = "--data-path") -> Optional[Blend]:
    """'A' | 'A B' (unweighted: mixed in proportion to their tokens) | '0.3 A 0.7 B' (weighted).
    Weights are normalized (they need not sum to 1); a prefix of weight 0 is left out of the blend (Megatron's
    blend never draws from it); a prefix named twice is refused."""
    words = [w for t in tokens for w in str(t).split()]
    if not words:
        return None
    if not _is_number(words[0]):
        if any(_is_number(w) for w in words):
            raise DataConfigError(f"{flag} {' '.join(words)}: give either prefixes only, or pairs "
                                  f"'WEIGHT PREFIX ...' (e.g. {flag} 0.3 A 0.7 B)")
        _refuse_repeated(words, None, flag)
        return Blend(tuple(words), None)
    if len(words) % 2:
        raise DataConfigError(f"{flag} {' '.join(words)}: expected 'PREFIX' or pairs 'WEIGHT PREFIX ...'")
    weights, prefixes = [], []
    for w, p in zip(words[0::2], words[1::2]):
        try:
            weights.append(float(w))
        except ValueError:
            raise DataConfigError(f"{flag}: {w!r} is not a weight; give pairs 'WEIGHT PREFIX ...', e.g. "
                                  f"{flag} 0.3 A 0.7 B") from None
        prefixes.append(p)
    try:
        normalize_weights(weights)
    except ValueError as e:
        raise DataConfigError(f"{flag}: {e}") from None
    _refuse_repeated(prefixes, weights, flag)
    unused = [p for w, p in zip(weights, prefixes) if w == 0]
    if unused:
        log.info(f"{flag}: {' '.join(unused)} weighted 0: left out of the blend")
    kept = [(w, p) for w, p in zip(weights, prefixes) if w > 0]
    return Blend(tuple(p for _, p in kept), tuple(w for w, _ in kept))


def _refuse_repeated(prefixes: Sequence[str], weights: Optional[Sequence[float]], flag: str) -> None:
    """The same prefix twice would be two identically shuffled copies of one dataset in the blend: each sample
    drawn twice, not a larger share of fresh ones (a mistake, or a weight given the wrong way)."""
    seen = {}
    for k, p in enumerate(prefixes):
        key = os.path.normpath(os.path.abspath(p))
        if key in seen:
            fix = (f"give it once with the weights summed ({weights[seen[key]] + weights[k]:g} {p})"
                   if weights is not None else "name it once (weights 'W PREFIX ...' give it a larger share)")
            raise DataConfigError(f"{flag}: {p} is named twice; {fix}")
        seen[key] = k


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def parse_split(split: str) -> List[float]:
    """'949,50,1' -> normalized fractions for train, valid, test (missing ones are 0)."""
    try:
        return split_fractions(split)
    except ConfigError as e:
        raise DataConfigError(str(e)) from None


def split_boundaries(fractions: Sequence[float], num_documents: int) -> List[int]:
    """Document index where each split starts, plus the end (Megatron's rounding)."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num_documents))))
    excess = bounds[-1] - num_documents
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def samples_per_split(train_iters: int, eval_interval: int, eval_iters: int, global_batch_size: int) -> List[int]:
    evaluations = (train_iters // eval_interval + 1) if eval_interval else 1
    return [train_iters * global_batch_size, evaluations * eval_iters * global_batch_size,
            eval_iters * global_batch_size]


def _open(prefix: str, flag: str) -> IndexedDataset:
    try:
        return IndexedDataset(prefix)
    except IndexedDatasetError as e:
        raise DataConfigError(f"{flag} {prefix}: {e}") from e


def _gpt(indexed: IndexedDataset, begin: int, end: int, num_samples: int, split: str, seq_length: int, seed: int,
         cache_dir: str, what: str) -> Optional[GPTDataset]:
    if num_samples == 0 or end <= begin:
        return None
    documents = np.arange(begin, end, dtype=np.int32)
    try:
        return GPTDataset(indexed, documents, seq_length, num_samples, seed, split, cache_dir, log=log.info)
    except EmptySplitError as e:  # documents, but (almost) no tokens: e.g. every input text was empty
        fix = ("check the input given to tools/preprocess_data.py (it reports the documents it wrote)" if split == "train"
               else f"give the {split} split more documents (--split), or skip evaluation with --eval-iters 0")
        raise DataConfigError(f"{what}: {e}; {fix}") from None
    except OSError as e:  # the index files could not be written (a read-only cache that lacks them)
        if e.filename and os.path.abspath(str(e.filename)).startswith(cache_dir + os.sep):
            raise cache_error(e, os.path.dirname(cache_dir)) from None
        raise


def _why_empty(prefix: str, num_samples: int, in_split: int, in_all: int) -> str:
    if in_all == 0:
        return f"{prefix} holds no documents"
    if num_samples == 0:
        return f"{prefix} has blend weight 0"
    return f"{prefix} has {in_split} of its {in_all} documents in this split"


def _blend_of(parts: List[Optional[GPTDataset]], empty: List[str], weights, size: int, what: str, split: str):
    """The split's dataset from its parts (one per prefix); `empty` names the parts without documents.
    Training needs documents in every part; a valid or test split without any is None."""
    if empty and (split == "train" or len(empty) < len(parts)):
        fix = ("check the input given to tools/preprocess_data.py (it reports the documents it wrote)"
               if all(e.endswith("holds no documents") for e in empty) else "give this split a larger share of "
               "--split, or use more documents")
        raise DataConfigError(f"{what}: no {split} documents: {'; '.join(empty)}; {fix}")
    if empty:
        return None
    if len(parts) == 1 and weights is None:
        return parts[0]
    return BlendedDataset(parts, weights, size)


def build_split_datasets(blend: Blend, split: str, sizes: Sequence[int], seq_length: int, seed: int,
                         cache_dir: str) -> List[Optional[object]]:
    """Datasets for train/valid/test from one blend divided by --split."""
    fractions = parse_split(split)
    indexed = [_open(p, "--data-path") for p in blend.prefixes]
    weights = _effective_weights(blend, indexed, "--data-path")
    what = f"--data-path {' '.join(blend.prefixes)} --split {split}"
    per_split: List[List[Optional[GPTDataset]]] = [[], [], []]
    empty: List[List[str]] = [[], [], []]
    for k, (prefix, ds) in enumerate(zip(blend.prefixes, indexed)):
        bounds = split_boundaries(fractions, len(ds))
        for s in range(3):
            n = sizes[s] if weights is None else component_sizes(sizes[s], weights)[k]
            part = _gpt(ds, bounds[s], bounds[s + 1], n, SPLITS[s], seq_length, seed, cache_dir, what)
            per_split[s].append(part)
            if part is None:
                empty[s].append(_why_empty(prefix, n, bounds[s + 1] - bounds[s], len(ds)))
    return [_blend_of(per_split[s], empty[s], weights, sizes[s], what, SPLITS[s]) if sizes[s] else None
            for s in range(3)]


def _effective_weights(blend: Blend, indexed: List[IndexedDataset], flag: str):
    """Normalized blend weights; unweighted lists mix in proportion to their tokens; None for one prefix."""
    if blend.weights is not None:
        return normalize_weights(blend.weights)
    if len(indexed) == 1:
        return None
    tokens = [ds.num_tokens for ds in indexed]
    if sum(tokens) == 0:
        raise DataConfigError(f"{flag} {' '.join(blend.prefixes)}: no prefix holds any token; check the input given "
                              "to tools/preprocess_data.py (it reports the documents it wrote)")
    return normalize_weights(tokens)


def build_blend_dataset(blend: Optional[Blend], split_name: str, size: int, seq_length: int, seed: int,
                        cache_dir: str, flag: str):
    """One dataset from a whole (weighted) blend, no split (the --{split}-data-path flags)."""
    if blend is None or size == 0:
        return None
    indexed = [_open(p, flag) for p in blend.prefixes]
    weights = _effective_weights(blend, indexed, flag)
    sizes = [size] if weights is None else component_sizes(size, weights)
    what = f"{flag} {' '.join(blend.prefixes)}"
    parts = [_gpt(ds, 0, len(ds), n, split_name, seq_length, seed, cache_dir, what) for ds, n in zip(indexed, sizes)]
    empty = [_why_empty(p, n, len(ds), len(ds)) for p, n, ds, part in zip(blend.prefixes, sizes, indexed, parts)
             if part is None]
    return _blend_of(parts, empty, weights, size, what, split_name)


def build_mock_datasets(vocab_size: int, sizes: Sequence[int], seq_length: int, seed: int):
    # Different seeds per split, so validation is not the training data.
    return [MockGPTDataset(vocab_size, seq_length, n, seed + s) if n else None for s, n in enumerate(sizes)]


def cache_root(data_cache_path: Optional[str]) -> str:
    """The --data-cache-path directory (default ~/.cache/megacoat), created if missing."""
    root = os.path.abspath(os.path.expanduser(data_cache_path or os.path.join("~", ".cache", "megacoat")))
    return _make_cache_dir(root, data_cache_path)


def index_cache_dir(data_cache_path: Optional[str]) -> str:
    """Where the GPT datasets' index files are cached (created if missing)."""
    return _make_cache_dir(os.path.join(cache_root(data_cache_path), "index_cache"), data_cache_path)


def _make_cache_dir(path: str, data_cache_path: Optional[str]) -> str:
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError as e:  # a file of that name
        raise cache_error(OSError(e.errno, "a file, not a directory", path), data_cache_path) from None
    except OSError as e:
        raise cache_error(e, data_cache_path) from None
    return path


def cache_error(e: OSError, data_cache_path: Optional[str]) -> DataConfigError:
    """A cache directory that cannot be created or written, named with the flag that sets it."""
    flag = f"--data-cache-path {data_cache_path}" if data_cache_path else "--data-cache-path (default ~/.cache/megacoat)"
    where = f"{e.filename}: " if e.filename else ""
    return DataConfigError(f"{flag}: cannot write the data caches there ({where}{e.strerror or e}); give "
                           "--data-cache-path a writable directory")
