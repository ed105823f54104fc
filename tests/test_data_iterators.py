"""The contract the training loop uses: build_tokenizer + build_data_iterators."""
import itertools
import multiprocessing
import os

import numpy as np
import pytest
import torch

from megacoat.model.masks import block_causal_mask

from megacoat.config import parse_args, validate_config
from megacoat.data import DataConfigError, build_data_iterators, build_tokenizer
from megacoat.data.batch import BatchBuilder
from megacoat.data.default_corpus import prepare_default_corpus
from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def make_cfg(tmp_path, *flags, world=1):
    cfg = parse_args(["--data-cache-path", str(tmp_path / "cache"), "--seq-length", "32", "--micro-batch-size", "2",
                      "--global-batch-size", "8", "--train-iters", "20", "--eval-interval", "10", "--eval-iters", "2",
                      "--num-workers", "0", *flags])
    validate_config(cfg, world)
    return cfg


def null_data(tmp_path, name, n_docs=60, vocab=1000, seed=0):
    """A NullTokenizer dataset (eod = vocab) with varied document lengths."""
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / name)
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        for _ in range(n_docs):
            b.add_document(np.append(rng.integers(0, vocab, size=int(rng.integers(1, 90))), vocab))
    return prefix


def take(iterator, n):
    return list(itertools.islice(iterator, n))


def global_batches(cfg, tokenizer, dp_size, n_iters, consumed=0):
    """Concatenate every rank's micro-batches of each iteration in rank order."""
    per_rank = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
    streams = [build_data_iterators(cfg, tokenizer, r, dp_size, consumed).train for r in range(dp_size)]
    out = []
    for _ in range(n_iters):
        parts = [mb["tokens"] for s in streams for mb in take(s, per_rank)]
        out.append(torch.cat(parts))
    return out


@pytest.fixture
def blended_cfg(tmp_path):
    a, b = null_data(tmp_path, "a", seed=1), null_data(tmp_path, "b", seed=2)
    return make_cfg(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                    "--data-path", "0.4", a, "0.6", b, "--split", "90,8,2")


def test_batch_fields(blended_cfg):
    tok = build_tokenizer(blended_cfg.data)
    it = build_data_iterators(blended_cfg, tok, 0, 1)
    mb = next(it.train)
    assert set(mb) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    assert mb["tokens"].shape == (2, 32) and mb["tokens"].dtype == torch.int64
    assert mb["labels"].dtype == torch.int64 and mb["loss_mask"].dtype == torch.float32
    assert mb["document_ids"] is None
    sample = torch.from_numpy(it.train_dataset[0])
    assert torch.equal(mb["tokens"][0], sample[:-1]) and torch.equal(mb["labels"][0], sample[1:])
    assert torch.equal(mb["position_ids"][1], torch.arange(32))
    assert next(it.valid)["tokens"].shape == (2, 32) and next(it.test)["tokens"].shape == (2, 32)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_any_dp_size_sees_the_same_global_order(blended_cfg, dp_size):
    tok = build_tokenizer(blended_cfg.data)
    reference = global_batches(blended_cfg, tok, 1, 10)
    ds = build_data_iterators(blended_cfg, tok, 0, 1).train_dataset
    for i, batch in enumerate(reference):  # global batch i is samples [i*gbs, (i+1)*gbs)
        expected = np.stack([ds[j][:-1] for j in range(i * 8, (i + 1) * 8)])
        assert torch.equal(batch, torch.from_numpy(expected))
    for a, b in zip(reference, global_batches(blended_cfg, tok, dp_size, 10)):
        assert torch.equal(a, b)


def test_resume_at_consumed_samples(blended_cfg):
    tok = build_tokenizer(blended_cfg.data)
    full = global_batches(blended_cfg, tok, 2, 8)
    resumed = global_batches(blended_cfg, tok, 2, 5, consumed=3 * 8)
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_resume_between_global_batches_reads_on_from_the_next_sample(blended_cfg, dp_size):
    """A checkpoint of another --global-batch-size (or saved during a batch-size ramp) leaves consumed
    samples that are no multiple of this run's batch: the run goes on with the next unread sample, as
    Megatron's sampler does (it stopped with a ValueError traceback)."""
    tok = build_tokenizer(blended_cfg.data)
    ds = build_data_iterators(blended_cfg, tok, 0, 1).train_dataset
    resumed = global_batches(blended_cfg, tok, dp_size, 3, consumed=12)
    for i, batch in enumerate(resumed):
        expected = np.stack([ds[j][:-1] for j in range(12 + 8 * i, 12 + 8 * (i + 1))])
        assert torch.equal(batch, torch.from_numpy(expected))


def test_rampup_steps_take_consecutive_samples_for_any_dp_size(tmp_path):
    """--rampup-batch-size: each step reads the next global-batch-size samples in order (split into one
    block per DP rank), so the samples of a step, and where a resumed run starts, do not depend on DP."""
    from megacoat.config import global_batch_size_at
    from megacoat.data.sampler import GlobalOrderBatchSampler

    cfg = parse_args(["--mock-data", "--vocab-size", "50", "--micro-batch-size", "1", "--global-batch-size", "8",
                      "--train-samples", "40", "--rampup-batch-size", "2", "2", "12"])
    validate_config(cfg, 2)
    sizes = [global_batch_size_at(cfg, c) for c in (0, 2, 4, 8, 14)]
    assert sizes == [2, 2, 4, 6, 8]

    def steps(dp_size, consumed):
        samplers = [iter(GlobalOrderBatchSampler(40, consumed, 1, 8, r, dp_size,
                                                 batch_size_at=lambda c: global_batch_size_at(cfg, c)))
                    for r in range(dp_size)]
        out, c = [], consumed
        while c + global_batch_size_at(cfg, c) <= 40:
            per_rank = global_batch_size_at(cfg, c) // dp_size
            out.append([i for s in samplers for _ in range(per_rank) for i in next(s)])
            c += global_batch_size_at(cfg, c)
        assert all(next(s, None) is None for s in samplers)  # the stream ends with the last whole step
        return out

    one = steps(1, 0)
    assert one[:5] == [[0, 1], [2, 3], [4, 5, 6, 7], list(range(8, 14)), list(range(14, 22))]
    assert steps(2, 0) == one
    assert steps(2, 4) == one[2:]  # resumed during the ramp at 4 consumed samples (2 x 8 would be 16)


def test_train_stops_valid_cycles(blended_cfg):
    tok = build_tokenizer(blended_cfg.data)
    it = build_data_iterators(blended_cfg, tok, 0, 1)
    assert len(it.train_dataset) == 20 * 8
    assert len(list(it.train)) == 20 * 4
    valid = [mb["tokens"] for mb in take(it.valid, 3 * len(it.valid_dataset) // 2)]  # wraps around
    per_pass = len(it.valid_dataset) // 8 * 4
    assert torch.equal(valid[0], valid[per_pass])


def test_workers_give_the_same_batches(tmp_path, blended_cfg):
    tok = build_tokenizer(blended_cfg.data)
    serial = take(build_data_iterators(blended_cfg, tok, 1, 2).train, 6)
    blended_cfg.data.num_workers = 2
    parallel = take(build_data_iterators(blended_cfg, tok, 1, 2).train, 6)
    for a, b in zip(serial, parallel):
        assert torch.equal(a["tokens"], b["tokens"])


def test_deterministic_across_builds(tmp_path, blended_cfg):
    tok = build_tokenizer(blended_cfg.data)
    a = take(build_data_iterators(blended_cfg, tok, 0, 1).train, 5)
    blended_cfg.data.data_cache_path = str(tmp_path / "other_cache")  # rebuilt from scratch
    b = take(build_data_iterators(blended_cfg, tok, 0, 1).train, 5)
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"])


def test_separate_split_paths(tmp_path):
    a, b, c = (null_data(tmp_path, n, seed=s) for s, n in enumerate("abc"))
    cfg = make_cfg(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                   "--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", c)
    it = build_data_iterators(cfg, build_tokenizer(cfg.data), 0, 1)
    assert it.test is None and it.valid is not None
    assert next(it.train)["tokens"].shape == (2, 32)


def test_tokenizer_data_mismatch_is_caught(tmp_path):
    prefix = null_data(tmp_path, "a", vocab=1000)
    cfg = make_cfg(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--data-path", prefix)
    with pytest.raises(DataConfigError, match="another tokenizer"):
        build_data_iterators(cfg, build_tokenizer(cfg.data), 0, 1)
    cfg = make_cfg(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-path",
                   str(tmp_path / "missing"))
    with pytest.raises(DataConfigError, match="--data-path"):
        build_data_iterators(cfg, build_tokenizer(cfg.data), 0, 1)


def test_mock_data(tmp_path):
    cfg = make_cfg(tmp_path, "--mock-data", "--vocab-size", "512")
    tok = build_tokenizer(cfg.data)
    a = take(build_data_iterators(cfg, tok, 0, 1).train, 3)
    b = take(build_data_iterators(cfg, tok, 0, 1).train, 3)
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"])
        assert int(x["tokens"].max()) < 512
    assert global_batches(cfg, tok, 2, 2)[1].shape == (8, 32)


def reference_masks(tokens, eod):
    """Megatron's get_ltor_masks_and_position_ids, loop form (True = may attend here)."""
    b, s = tokens.shape
    attend = torch.tril(torch.ones(b, s, s)).bool()
    pos = torch.arange(s).repeat(b, 1)
    for k in range(b):
        prev = 0
        for i in (tokens[k] == eod).nonzero().flatten().tolist():
            attend[k, i + 1:, :i + 1] = False
            pos[k, i + 1:] -= i + 1 - prev
            prev = i + 1
    return attend.unsqueeze(1), pos


def test_eod_masks_and_resets():
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 5, size=41) for _ in range(6)]  # eod = 4: many documents
    samples[0][0] = 4
    samples[1][-2] = 4
    batch = BatchBuilder(eod=4, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)(samples)
    attend, pos = reference_masks(batch["tokens"], 4)
    mask = block_causal_mask(batch["document_ids"])
    assert mask.dtype == torch.bool and mask.shape == (6, 1, 40, 40)
    assert torch.equal(mask, attend)
    assert torch.equal(batch["position_ids"], pos)
    assert torch.equal(batch["loss_mask"], (batch["tokens"] != 4).float())
    plain = BatchBuilder(eod=4)(samples)
    assert plain["document_ids"] is None and bool((plain["loss_mask"] == 1).all())
    assert torch.equal(plain["position_ids"], torch.arange(40).repeat(6, 1))


# -- the default corpus ---------------------------------------------------------------------------

def _prepare(cache, queue):
    queue.put(prepare_default_corpus(cache).directory)


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    """Prepare the default corpus from two processes at once: both must get the same, whole result."""
    cache = str(tmp_path_factory.mktemp("default_corpus_cache"))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(cache, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    dirs = {queue.get(timeout=5) for _ in procs}
    assert len(dirs) == 1
    root = os.path.dirname(dirs.pop())
    assert not [n for n in os.listdir(root) if ".tmp" in n]  # no staging left behind
    return cache


@pytest.mark.slow
def test_default_corpus(tmp_path, default_cache):
    cfg = make_cfg(tmp_path, "--data-cache-path", default_cache)
    tok = build_tokenizer(cfg.data)
    assert tok.vocab_size == 8000
    it = build_data_iterators(cfg, tok, 0, 1)
    mb = next(it.train)
    assert mb["tokens"].shape == (2, 32) and int(mb["tokens"].max()) < 8000
    assert it.valid is not None and it.test is not None
    corpus = prepare_default_corpus(default_cache)
    ds = IndexedDataset(corpus.data_prefix)
    assert ds.dtype == np.uint16 and ds.num_documents > 100
    first_file = open(corpus.directory + "/SOURCES.txt").read().splitlines()[1]
    text = open(first_file, encoding="utf-8", errors="replace").read()
    ids = ds.get(0).tolist()
    assert ids[-1] == tok.eod and tok.detokenize(ids[:-1]) == text


def test_default_corpus_refuses_another_tokenizer(tmp_path, default_cache):
    cfg = make_cfg(tmp_path, "--data-cache-path", default_cache, "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", "10")
    with pytest.raises(DataConfigError, match="default corpus"):
        build_data_iterators(cfg, build_tokenizer(cfg.data), 0, 1)
