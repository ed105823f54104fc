"""Data pipeline: tokenizers, Megatron indexed datasets, GPT samples, blending, DP-aware loading.

The training loop needs three calls:

    tokenizer = build_tokenizer(cfg.data)
    datasets = build_datasets(cfg, tokenizer)  # refuses empty training data (before the model is built)
    iters = build_data_iterators(cfg, tokenizer, dp_rank=r, dp_size=d, consumed_samples=0, datasets=datasets)
    batch = next(iters.train)   # tokens, labels, loss_mask, position_ids, document_ids

See megacoat/data/README.md for the modules and the exact semantics.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import numpy as np

from megacoat.config import DEFAULT_SPLIT, global_batch_size_at
from megacoat.data.dataset_builder import (DataConfigError, build_blend_dataset, build_mock_datasets,
                                           build_split_datasets, cache_error, cache_root, index_cache_dir,
                                           parse_blend, samples_per_split)
from megacoat.data.default_corpus import prepare_default_corpus
from megacoat.data.sampler import GlobalOrderBatchSampler
from megacoat.data.tokenizer import (GPTSentencePieceTokenizer, NullTokenizer, TokenizerError,
                                     build_tokenizer_by_type, check_vocab_size)

__all__ = ["build_tokenizer", "build_datasets", "build_data_iterators", "Datasets", "DataIterators", "DataConfigError",
           "TokenizerError", "check_vocab_size", "DEFAULT_MOCK_VOCAB_SIZE"]

DEFAULT_MOCK_VOCAB_SIZE = 32000
log = logging.getLogger("megacoat.data")


def _uses_default_corpus(data_cfg) -> bool:
    return not (data_cfg.mock_data or data_cfg.data_path or data_cfg.train_data_path)


def _default_corpus(data_cache_path: Optional[str]):
    """The default corpus under --data-cache-path; a cache that cannot be written is named with the flag."""
    root = cache_root(data_cache_path)
    try:
        return prepare_default_corpus(root, log=log.info)
    except OSError as e:
        if e.filename and os.path.abspath(str(e.filename)).startswith(root + os.sep):
            raise cache_error(e, data_cache_path) from None
        raise


def build_tokenizer(data_cfg):
    """The tokenizer named by the data flags (cfg.data).

    No --tokenizer-type: with --mock-data, ids 0..V-1 with V = --vocab-size (default 32000) and
    eod = V-1; otherwise the default corpus' SentencePiece model (trained and cached at first use).
    """
    if data_cfg.tokenizer_type is None:
        if data_cfg.mock_data:
            vocab = data_cfg.vocab_size or DEFAULT_MOCK_VOCAB_SIZE
            if vocab < 2:
                raise TokenizerError("--vocab-size must be >= 2 for --mock-data")
            return NullTokenizer(vocab - 1)  # vocab_size == vocab, eod == vocab - 1
        if not _uses_default_corpus(data_cfg):
            raise TokenizerError("--data-path/--train-data-path need --tokenizer-type (and --tokenizer-model) "
                                 "naming the tokenizer the data was preprocessed with")
        corpus = _default_corpus(data_cfg.data_cache_path)
        return GPTSentencePieceTokenizer(corpus.tokenizer_model)
    return build_tokenizer_by_type(data_cfg.tokenizer_type, data_cfg.tokenizer_model, data_cfg.vocab_size,
                                   data_cfg.vocab_file, data_cfg.merge_file)


@dataclass
class Datasets:
    train: Any
    valid: Optional[Any]  # None: the split has no documents (or no samples are asked of it)
    test: Optional[Any]


@dataclass
class DataIterators:
    train: Optional[Iterator[Dict[str, Any]]]
    valid: Optional[Iterator[Dict[str, Any]]]
    test: Optional[Iterator[Dict[str, Any]]]
    train_dataset: Any = None
    valid_dataset: Any = None
    test_dataset: Any = None


def _build_datasets(cfg, tokenizer, train_samples: Optional[int]):
    d, seq, seed = cfg.data, cfg.model.seq_length, cfg.train.seed
    t = cfg.train
    sizes = samples_per_split(t.train_iters, t.eval_interval, t.eval_iters, t.global_batch_size)
    if train_samples is not None:
        sizes[0] = max(sizes[0], train_samples)
    if d.mock_data:
        return build_mock_datasets(tokenizer.vocab_size, sizes, seq, seed)
    cache = index_cache_dir(d.data_cache_path)
    if d.train_data_path or d.valid_data_path or d.test_data_path:
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        blends = [parse_blend(p, f) for p, f in zip((d.train_data_path, d.valid_data_path, d.test_data_path), flags)]
        return [build_blend_dataset(b, name, n, seq, seed, cache, f)
                for b, name, n, f in zip(blends, ("train", "valid", "test"), sizes, flags)]
    if d.data_path:
        blend = parse_blend(d.data_path)
    else:
        corpus = _default_corpus(d.data_cache_path)
        model = getattr(tokenizer, "model_file", None)
        if model != corpus.tokenizer_model:
            raise DataConfigError("the default corpus is tokenized with its own SentencePiece model; drop "
                                  "--tokenizer-type/--tokenizer-model, or pass --data-path with data made by "
                                  "tools/preprocess_data.py for your tokenizer")
        blend = parse_blend([corpus.data_prefix])
    return build_split_datasets(blend, d.split or DEFAULT_SPLIT, sizes, seq, seed, cache)


def _no_validation_data(d) -> str:
    """Why the validation split is empty, naming the flags."""
    if d.train_data_path or d.valid_data_path or d.test_data_path:
        return f"--valid-data-path {' '.join(d.valid_data_path)} holds no documents" if d.valid_data_path else \
            "no --valid-data-path"
    source = f"--data-path {' '.join(d.data_path)}" if d.data_path else "the default corpus"
    return f"--split {d.split or DEFAULT_SPLIT} leaves no documents of {source} for validation"


def build_datasets(cfg, tokenizer, train_samples: Optional[int] = None) -> Datasets:
    """The train/valid/test datasets of the flags; indices are built (or read from the cache) here.
    The train split holds at least --train-iters x --global-batch-size samples, or `train_samples`
    if more (a run resumed from a checkpoint of a larger global batch reads further).

    Refuses (DataConfigError, naming the data and the split) a train split without documents and data
    made with another tokenizer, so that a run fails before its model is built. A validation split
    without documents while --eval-iters > 0 skips evaluation with a warning (as Megatron skips it)."""
    train, valid, test = _build_datasets(cfg, tokenizer, train_samples)
    if train is None:  # the builders refuse empty train splits naming the prefixes; this is the last guard
        raise DataConfigError("no training data: give --data-path or --train-data-path with documents to train on")
    for name, ds in (("train", train), ("valid", valid), ("test", test)):
        if ds is not None:
            _check_token_ids(ds, tokenizer.vocab_size, name)
    if valid is None and cfg.train.eval_iters > 0:
        log.warning(f"warning: {_no_validation_data(cfg.data)}: evaluation is skipped (--eval-iters 0 says so and "
                    "silences this warning)")
    return Datasets(train, valid, test)


def _check_token_ids(dataset, vocab_size: int, what: str, probes: int = 4) -> None:
    """Cheap guard against data made with another tokenizer: the first samples' ids must fit."""
    for i in range(min(probes, len(dataset))):
        top = int(np.max(dataset[i]))
        if top >= vocab_size:
            raise DataConfigError(
                f"{what} data holds token id {top} but the tokenizer has {vocab_size} ids; the data was made with "
                "another tokenizer: pass the --tokenizer-type/--tokenizer-model used by tools/preprocess_data.py")


def ignore_sigterm(worker_id: int) -> None:
    """DataLoader worker init under --exit-signal-handler: SLURM and torchrun signal every process
    of the task's process group, and torch's worker handler dies of a SIGTERM that its parent did
    not send, which fails the trainer's next batch before it can save. Ignored here, the worker
    lives until the trainer shuts the loader down (or exits: workers watch their parent)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _loader(dataset, sampler, num_workers: int, survive_sigterm: bool):
    import torch

    from megacoat.data.batch import stack_samples

    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=stack_samples,
                                       num_workers=num_workers, persistent_workers=num_workers > 0, pin_memory=False,
                                       worker_init_fn=ignore_sigterm if survive_sigterm and num_workers else None,
                                       # its own generator: starting a loader must not draw from the global RNG
                                       # (dropout's stream), or a resumed run would diverge from an uninterrupted one
                                       generator=torch.Generator())


def _micro_batches(loader, batch_builder) -> Iterator:
    """Starts the loader (and its worker processes) on the first next(), not at build time."""
    for stacked in loader:
        yield batch_builder(stacked)


def build_data_iterators(cfg, tokenizer, dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0,
                         consumed_valid_samples: int = 0, datasets: Optional[Datasets] = None) -> DataIterators:
    """Micro-batch iterators for this data-parallel rank (see sampler.py for the order) over
    `datasets` (default: build_datasets(cfg, tokenizer)).

    train starts at `consumed_samples` (any number: a resumed run reads on from the next unread sample)
    and stops after its samples; valid starts at
    `consumed_valid_samples` (a resumed run continues its validation stream); valid and test
    cycle forever (None when the split is empty).
    """
    from megacoat.data.batch import BatchBuilder  # torch is imported here, not by the preprocessing tools

    datasets = datasets or build_datasets(cfg, tokenizer)
    train_ds, valid_ds, test_ds = datasets.train, datasets.valid, datasets.test
    collate = BatchBuilder(eod=tokenizer.eod, vocab_size=tokenizer.vocab_size, eod_mask_loss=cfg.data.eod_mask_loss,
                           reset_position_ids=cfg.data.reset_position_ids,
                           reset_attention_mask=cfg.data.reset_attention_mask)
    mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
    iters = []
    for name, ds in (("train", train_ds), ("valid", valid_ds), ("test", test_ds)):
        if ds is None:
            iters.append(None)
            continue
        start = {"train": consumed_samples, "valid": consumed_valid_samples}.get(name, 0)
        # Training steps grow with --rampup-batch-size; evaluation reads full global batches.
        ramp = (lambda consumed: global_batch_size_at(cfg, consumed)) if name == "train" else None
        sampler = GlobalOrderBatchSampler(len(ds), start, mbs, gbs, dp_rank, dp_size, cyclic=name != "train",
                                          batch_size_at=ramp)
        loader = _loader(ds, sampler, cfg.data.num_workers, cfg.train.exit_signal_handler)
        iters.append(_micro_batches(loader, collate))
    return DataIterators(*iters, train_dataset=train_ds, valid_dataset=valid_ds, test_dataset=test_ds)
