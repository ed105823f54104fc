"""Blending (Megatron semantics), blend/split flag parsing."""
import numpy as np
import pytest

from megacoat.data import helpers
from megacoat.data.blended_dataset import BlendedDataset, component_sizes
from megacoat.data.dataset_builder import DataConfigError, parse_blend, parse_split, split_boundaries
from megacoat.data.gpt_dataset import GPTDataset
from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def tagged_dataset(path, tag, n_docs=40, seq=8):
    """Documents whose tokens all lie in [1000*tag, 1000*tag + 999], so a sample tells its source."""
    rng = np.random.default_rng(tag)
    with IndexedDatasetBuilder(str(path), dtype=np.int32) as b:
        for _ in range(n_docs):
            b.add_document(rng.integers(1000 * tag, 1000 * tag + 1000, size=int(rng.integers(5, 60))))
    return IndexedDataset(str(path))


def build_blend(tmp_path, weights, size, seq=8, seed=0):
    parts = []
    for k, n in enumerate(component_sizes(size, np.asarray(weights) / np.sum(weights))):
        indexed = tagged_dataset(tmp_path / f"d{k}", k)
        parts.append(GPTDataset(indexed, np.arange(len(indexed), dtype=np.int32), seq, n, seed,
                                cache_dir=str(tmp_path / "cache")))
    return BlendedDataset(parts, weights, size)


def test_blend_proportions_within_one_percent(tmp_path):
    weights = [0.2, 0.3, 0.5]
    ds = build_blend(tmp_path, weights, 10000)
    sources = np.array([int(ds[i][0]) // 1000 for i in range(len(ds))])
    assert np.all(sources == ds.dataset_index)  # each sample really comes from its dataset
    shares = np.bincount(sources, minlength=3) / len(ds)
    np.testing.assert_allclose(shares, weights, atol=0.01)
    # Every prefix of the blend is close too (greedy rule), not just the total.
    for n in (100, 1000, 5000):
        np.testing.assert_allclose(np.bincount(sources[:n], minlength=3) / n, weights, atol=0.02)


def test_blend_is_deterministic(tmp_path):
    a = build_blend(tmp_path / "a", [0.7, 0.3], 500)
    b = build_blend(tmp_path / "b", [0.7, 0.3], 500)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i], b[i])
    assert not np.array_equal(a[0], build_blend(tmp_path / "c", [0.7, 0.3], 500, seed=1)[0]) or \
        not np.array_equal(a[1], build_blend(tmp_path / "d", [0.7, 0.3], 500, seed=1)[1])


def test_blending_indices_greedy_rule():
    index, sample = helpers.build_blending_indices([0.5, 0.5], 6, backend="numpy")
    assert index.tolist() == [0, 1, 0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1, 2, 2]


def test_parse_blend():
    assert parse_blend([]) is None
    assert parse_blend(["A"]).prefixes == ("A",) and parse_blend(["A"]).weights is None
    b = parse_blend(["0.3", "A", "0.7", "B"])
    assert b.prefixes == ("A", "B") and b.weights == (0.3, 0.7)
    assert parse_blend(["0.3 A 0.7 B"]) == b  # one quoted string, as in Megatron scripts
    assert parse_blend(["A", "B"]).weights is None
    for bad in (["0.3", "A", "B"], ["A", "0.3"], ["x", "0.5", "A"], ["-1", "A", "2", "B"]):
        with pytest.raises(DataConfigError):
            parse_blend(bad)


def test_split_follows_megatron_rounding():
    assert split_boundaries(parse_split("949,50,1"), 1000) == [0, 949, 999, 1000]
    assert split_boundaries(parse_split("969,30,1"), 734) == [0, 711, 733, 734]
    assert split_boundaries(parse_split("1"), 10) == [0, 10, 10, 10]
    assert split_boundaries(parse_split("98,2"), 7) == [0, 7, 7, 7]
    with pytest.raises(DataConfigError):
        parse_split("a,b")
