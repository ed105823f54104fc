"""Megatron MMIDIDX indexed dataset: round trips, merge, byte-exact interop, corrupt files."""
import os
import struct

import numpy as np
import pytest

from megacoat.data.indexed_dataset import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                                           best_token_dtype)


def random_documents(rng, n_docs, dtype, max_len=50, max_seqs=3):
    """Documents as lists of sequences (some empty), with values valid for dtype."""
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    docs = []
    for _ in range(n_docs):
        seqs = []
        for _ in range(rng.integers(1, max_seqs + 1)):
            n = int(rng.integers(0, max_len))
            if info is not None:
                seqs.append(rng.integers(info.min, info.max, size=n, endpoint=True).astype(dtype))
            else:
                seqs.append(rng.standard_normal(n).astype(dtype))
        docs.append(seqs)
    return docs


def write_with_library(prefix, docs, dtype):
    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for seqs in docs:
            for s in seqs:
                b.add_item(s)
            b.end_document()


# An independent writer/reader written only from the format description (not the library).
def spec_write(prefix, docs, dtype):
    code = {np.dtype(v): k for k, v in DTYPE_CODES.items()}[np.dtype(dtype)]
    lengths, doc_idx, payload = [], [0], b""
    for seqs in docs:
        for s in seqs:
            lengths.append(len(s))
            payload += np.asarray(s, dtype=dtype).tobytes()
        doc_idx.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    with open(prefix + ".bin", "wb") as f:
        f.write(payload)


def spec_read(prefix):
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off)
    off += 8 * n_seq
    doc_idx = struct.unpack_from(f"<{n_doc}q", raw, off)
    assert version == 1 and off + 8 * n_doc == len(raw)
    dtype = DTYPE_CODES[code]
    data = open(prefix + ".bin", "rb").read()
    seqs = [np.frombuffer(data, dtype=dtype, count=n, offset=p) for n, p in zip(lengths, pointers)]
    return [seqs[doc_idx[i]:doc_idx[i + 1]] for i in range(n_doc - 1)]


def assert_docs_equal(a, b):
    assert len(a) == len(b)
    for da, db in zip(a, b):
        assert len(da) == len(db)
        for sa, sb in zip(da, db):
            np.testing.assert_array_equal(np.asarray(sa), np.asarray(sb))


def library_read(prefix):
    ds = IndexedDataset(prefix)
    return [ds.document(i) for i in range(ds.num_documents)]


@pytest.mark.parametrize("dtype", list(DTYPE_CODES.values()), ids=lambda d: str(d))
def test_round_trip_every_dtype(tmp_path, dtype):
    docs = random_documents(np.random.default_rng(0), 40, dtype)
    prefix = str(tmp_path / "d")
    write_with_library(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype
    assert len(ds) == sum(len(d) for d in docs)
    assert_docs_equal(library_read(prefix), docs)
    # partial reads
    flat = [s for d in docs for s in d]
    i = next(k for k, s in enumerate(flat) if len(s) > 5)
    np.testing.assert_array_equal(ds.get(i, 2, 3), flat[i][2:5])
    with pytest.raises(IndexError):
        ds.get(i, 0, len(flat[i]) + 1)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float32])
def test_byte_exact_with_independent_implementation(tmp_path, dtype):
    docs = random_documents(np.random.default_rng(1), 30, dtype)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write_with_library(ours, docs, dtype)
    spec_write(theirs, docs, dtype)
    for ext in (".idx", ".bin"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read()
    assert_docs_equal(library_read(theirs), docs)  # library reads the spec writer's files
    assert_docs_equal(spec_read(ours), docs)       # spec reader reads the library's files


def test_merge(tmp_path):
    rng = np.random.default_rng(2)
    parts = [random_documents(rng, n, np.uint16) for n in (5, 0, 7)]
    prefixes = []
    for k, docs in enumerate(parts):
        prefixes.append(str(tmp_path / f"p{k}"))
        write_with_library(prefixes[-1], docs, np.uint16)
    merged = str(tmp_path / "merged")
    with IndexedDatasetBuilder(merged, dtype=np.uint16) as b:
        for p in prefixes:
            b.add_index(p)
    everything = [d for docs in parts for d in docs]
    assert_docs_equal(library_read(merged), everything)
    spec_write(str(tmp_path / "direct"), everything, np.uint16)
    for ext in (".idx", ".bin"):
        assert open(merged + ext, "rb").read() == open(str(tmp_path / "direct") + ext, "rb").read()
    with pytest.raises(IndexedDatasetError, match="dtype"):
        IndexedDatasetBuilder(str(tmp_path / "bad"), dtype=np.int32).add_index(prefixes[0])


def test_builder_rejects_ids_that_do_not_fit(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not fit"):
        b.add_item(np.array([70000]))
    b.abort()
    assert best_token_dtype(65499) == np.uint16 and best_token_dtype(65500) == np.int32


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "e")
    IndexedDatasetBuilder(prefix, dtype=np.int32).finalize()
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


# -- corrupt files: each gives an error naming the file and the problem -------------------------

@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "g")
    spec_write(prefix, random_documents(np.random.default_rng(3), 10, np.int32, max_len=20), np.int32)
    return prefix


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


CORRUPTIONS = {
    "bad magic": (lambda p: patch(p + ".idx", 0, b"XXIDIDX"), "bad magic"),
    "version": (lambda p: patch(p + ".idx", 9, struct.pack("<Q", 2)), "version"),
    "dtype code": (lambda p: patch(p + ".idx", 17, struct.pack("<B", 9)), "dtype code"),
    "short header": (lambda p: truncate(p + ".idx", 20), "truncated header"),
    "truncated index": (lambda p: truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), "truncated"),
    "trailing index data": (lambda p: open(p + ".idx", "ab").write(b"\0" * 8), "trailing"),
    "sequence count": (lambda p: patch(p + ".idx", 18, struct.pack("<Q", 3)), "disagrees"),
    "document count": (lambda p: patch(p + ".idx", 26, struct.pack("<Q", 99)), "disagrees"),
    "truncated bin": (lambda p: truncate(p + ".bin", os.path.getsize(p + ".bin") - 4), "truncated"),
    "longer bin": (lambda p: open(p + ".bin", "ab").write(b"\0" * 4), "longer"),
    "missing bin": (lambda p: os.remove(p + ".bin"), "not found"),
    "missing idx": (lambda p: os.remove(p + ".idx"), "not found"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_files_are_rejected(good, case):
    corrupt, message = CORRUPTIONS[case]
    corrupt(good)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        IndexedDataset(good)
    assert os.path.basename(good) in str(err.value)


def _idx_layout(prefix):
    raw = open(prefix + ".idx", "rb").read()
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    return n_seq, n_doc, 34, 34 + 4 * n_seq, 34 + 12 * n_seq


def test_pointer_beyond_bin_is_rejected(good):
    n_seq, _, _, ptr_off, _ = _idx_layout(good)
    patch(good + ".idx", ptr_off + 8 * (n_seq - 1), struct.pack("<q", 10 ** 6))
    with pytest.raises(IndexedDatasetError, match="points to"):
        IndexedDataset(good)


def test_inconsistent_document_indices_are_rejected(good):
    n_seq, n_doc, _, _, doc_off = _idx_layout(good)
    patch(good + ".idx", doc_off + 8 * (n_doc - 1), struct.pack("<q", n_seq + 5))
    with pytest.raises(IndexedDatasetError, match="document indices"):
        IndexedDataset(good)


def test_negative_length_is_rejected(good):
    _, _, len_off, _, _ = _idx_layout(good)
    patch(good + ".idx", len_off, struct.pack("<i", -1))
    with pytest.raises(IndexedDatasetError):
        IndexedDataset(good)


def test_mismatched_pair_is_rejected(tmp_path, good):
    other = str(tmp_path / "other")
    spec_write(other, random_documents(np.random.default_rng(9), 12, np.int32, max_len=20), np.int32)
    os.replace(other + ".bin", good + ".bin")
    with pytest.raises(IndexedDatasetError, match="belongs to another index|truncated|longer"):
        IndexedDataset(good)


def test_truncated_bin_never_yields_garbage(good):
    """Cut the data file at every length: opening fails, it never returns tokens past the data."""
    full = open(good + ".bin", "rb").read()
    for cut in range(0, len(full), 4):
        with open(good + ".bin", "wb") as f:
            f.write(full[:cut])
        with pytest.raises(IndexedDatasetError, match="truncated"):
            IndexedDataset(good)
