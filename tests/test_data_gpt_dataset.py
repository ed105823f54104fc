"""GPT dataset indices: samples reproduce the stream, shuffles are permutations, caching, C++ == numpy."""
import os

import numpy as np
import pytest

from megacoat.data import helpers
from megacoat.data.gpt_dataset import GPTDataset, build_gpt_indices, load_or_build_indices
from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

BACKENDS = ["numpy"] + (["cpp"] if helpers.cpp_available() else [])


def reference_sample_index(sizes, document_index, seq_length):
    """Megatron's walk, written plainly: consume seq_length + 1 tokens per sample, keep one."""
    total = int(sum(sizes[d] for d in document_index))
    num_samples = (total - 1) // seq_length
    out = [(0, 0)]
    j, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining:
            length = int(sizes[document_index[j]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                j, offset = j + 1, 0
        out.append((j, offset))
    return np.array(out, dtype=np.int64)


def make_dataset(path, doc_lengths, seed=0, dtype=np.uint16):
    rng = np.random.default_rng(seed)
    docs = []
    with IndexedDatasetBuilder(str(path), dtype=dtype) as b:
        for n in doc_lengths:
            d = rng.integers(0, 1000, size=n)
            docs.append(d)
            b.add_document(d)
    return IndexedDataset(str(path)), docs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seq_length", [1, 3, 16, 100])
def test_sample_index_matches_reference_walk(backend, seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 40, size=60).astype(np.int32)  # includes empty documents
    sizes[0] = 0
    doc_index = rng.permutation(np.tile(np.arange(60, dtype=np.int32), 2))
    got = helpers.build_sample_index(sizes, doc_index, seq_length, backend=backend)
    np.testing.assert_array_equal(got, reference_sample_index(sizes, doc_index, seq_length))


def test_cpp_and_numpy_give_identical_arrays():
    if not helpers.cpp_available():
        pytest.skip("megacoat._data_helpers not built")
    rng = np.random.default_rng(7)
    for trial in range(20):
        sizes = rng.integers(0, 3000, size=int(rng.integers(1, 500))).astype(np.int32)
        doc_index = rng.permutation(np.repeat(np.arange(len(sizes), dtype=np.int32), int(rng.integers(1, 4))))
        seq = int(rng.integers(1, 2049))
        a = helpers.build_sample_index(sizes, doc_index, seq, backend="cpp")
        b = helpers.build_sample_index(sizes, doc_index, seq, backend="numpy")
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
        w = rng.random(int(rng.integers(1, 6)))
        w /= w.sum()
        for x, y in zip(helpers.build_blending_indices(w, 3000, backend="cpp"),
                        helpers.build_blending_indices(w, 3000, backend="numpy")):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("num_samples", [5, 200, 1000])  # one epoch; several; separate final epoch
def test_samples_reproduce_the_token_stream(tmp_path, num_samples):
    seq = 16
    indexed, docs = make_dataset(tmp_path / "d", [1, 7, 30, 0, 16, 17, 5, 64, 2, 33])
    ds = GPTDataset(indexed, np.arange(len(docs), dtype=np.int32), seq, num_samples, seed=3, cache_dir=None)
    assert len(ds) >= num_samples
    stream = np.concatenate([docs[d] for d in ds.document_index])
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(ds[i], stream[k * seq:k * seq + seq + 1])
    # the document index holds every document once per epoch (epochs shuffled together, Megatron)
    epochs = len(ds.document_index) // len(docs)
    assert len(ds.document_index) == epochs * len(docs)
    np.testing.assert_array_equal(np.bincount(ds.document_index), np.full(len(docs), epochs))


def test_shuffle_index_is_a_permutation_and_seeded(tmp_path):
    indexed, docs = make_dataset(tmp_path / "d", list(range(1, 120)))
    documents = np.arange(len(docs), dtype=np.int32)
    _, sample_a, shuffle_a = build_gpt_indices(indexed.sequence_lengths, documents, 32, 2000, seed=5)
    np.testing.assert_array_equal(np.sort(shuffle_a), np.arange(len(sample_a) - 1))
    _, _, shuffle_b = build_gpt_indices(indexed.sequence_lengths, documents, 32, 2000, seed=5)
    _, _, shuffle_c = build_gpt_indices(indexed.sequence_lengths, documents, 32, 2000, seed=6)
    np.testing.assert_array_equal(shuffle_a, shuffle_b)
    assert not np.array_equal(shuffle_a, shuffle_c)


def test_separate_final_epoch_is_shuffled_apart(tmp_path):
    # 2 epochs needed, the second only barely: its samples come last in the shuffle.
    indexed, docs = make_dataset(tmp_path / "d", [50] * 20)  # 1000 tokens/epoch, 62 samples of 16
    documents = np.arange(20, dtype=np.int32)
    doc_index, sample_index, shuffle = build_gpt_indices(indexed.sequence_lengths, documents, 16, 65, seed=1)
    first_epoch_samples = (1000 - 1) // 16
    assert len(doc_index) == 40
    assert sorted(doc_index[20:]) == list(range(20))  # the final epoch is shuffled on its own
    assert shuffle[:first_epoch_samples].max() < first_epoch_samples
    assert shuffle[first_epoch_samples:].min() >= first_epoch_samples


def test_split_documents_only(tmp_path):
    indexed, docs = make_dataset(tmp_path / "d", [10] * 30)
    ds = GPTDataset(indexed, np.arange(10, 20, dtype=np.int32), 8, 50, seed=0, cache_dir=None)
    assert set(np.unique(ds.document_index)) == set(range(10, 20))
    allowed = set(np.concatenate(docs[10:20]).tolist())
    for i in range(len(ds)):
        assert set(ds[i].tolist()) <= allowed


def test_cache_is_reused_and_invalidated(tmp_path):
    cache = str(tmp_path / "cache")
    indexed, docs = make_dataset(tmp_path / "d", [20] * 50)
    documents = np.arange(50, dtype=np.int32)
    args = (indexed.prefix, indexed.sequence_lengths, documents, 16, 100, 0, "train", cache)
    a = load_or_build_indices(*args)
    files = sorted(os.listdir(cache))
    assert sum(f.endswith(".npy") for f in files) == 3
    mtimes = {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files}
    b = load_or_build_indices(*args)  # reused: nothing rewritten
    assert {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files} == mtimes
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # Changing any input makes a new cache entry: seed, seq length, samples, documents, the data itself.
    for changed in [(16, 100, 1), (17, 100, 0), (16, 101, 0)]:
        load_or_build_indices(indexed.prefix, indexed.sequence_lengths, documents, *changed, "train", cache)
    load_or_build_indices(indexed.prefix, indexed.sequence_lengths, documents[:40], 16, 100, 0, "train", cache)
    assert sum(f.endswith(".npy") for f in os.listdir(cache)) == 3 * 5
    indexed2, _ = make_dataset(tmp_path / "d", [21] * 50, seed=1)  # regenerate the data in place
    load_or_build_indices(indexed2.prefix, indexed2.sequence_lengths, documents, 16, 100, 0, "train", cache)
    assert sum(f.endswith(".npy") for f in os.listdir(cache)) == 3 * 6
