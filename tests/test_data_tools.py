"""tools/train_tokenizer.py and tools/preprocess_data.py end to end, on the default corpus' text."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megacoat.data.default_corpus import stdlib_source_files
from megacoat.data.indexed_dataset import IndexedDataset
from megacoat.data.tokenizer import GPTSentencePieceTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(name, *args, ok=True):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A slice of the default corpus (stdlib sources) as files, JSONL and a trained model."""
    tmp = tmp_path_factory.mktemp("tools")
    files = [f for f in stdlib_source_files() if f"{os.sep}json{os.sep}" in f or f"{os.sep}email{os.sep}" in f]
    texts = [open(f, encoding="utf-8").read() for f in files]
    jsonl = tmp / "corpus.jsonl"
    with open(jsonl, "w") as f:
        for path, text in zip(files, texts):
            f.write(json.dumps({"text": text, "path": path}) + "\n")
    model = tmp / "tok.model"
    run_tool("train_tokenizer.py", "--input", jsonl, "--output-model", model, "--vocab-size", 1000, "--threads", 2)
    return dict(tmp=tmp, files=files, texts=texts, jsonl=jsonl, model=str(model))


def read_documents(prefix):
    ds = IndexedDataset(prefix)
    return ds, [np.concatenate(ds.document(i)) if ds.document(i) else np.zeros(0) for i in range(ds.num_documents)]


@pytest.fixture(scope="module")
def jsonl_outputs(corpus):
    """The corpus' JSONL preprocessed with 1 and 2 worker processes: {workers: (prefix, stderr)}."""
    out = {}
    for workers in (1, 2):
        prefix = corpus["tmp"] / f"w{workers}"
        proc = run_tool("preprocess_data.py", "--input", corpus["jsonl"], "--json-keys", "text", "path",
                        "--output-prefix", prefix, "--tokenizer-type", "GPTSentencePieceTokenizer",
                        "--tokenizer-model", corpus["model"], "--append-eod", "--workers", workers,
                        "--log-interval", 10)
        out[workers] = (prefix, proc.stderr)
    return out


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_jsonl_round_trip(corpus, jsonl_outputs, workers):
    out, stderr = jsonl_outputs[workers]
    assert "MB/s" in stderr
    tok = GPTSentencePieceTokenizer(corpus["model"])
    ds, docs = read_documents(f"{out}_text_document")
    assert ds.dtype == np.uint16 and len(docs) == len(corpus["texts"])
    for ids, text in zip(docs, corpus["texts"]):
        if not text:  # empty __init__.py: an empty document, no eod (Megatron)
            assert len(ids) == 0
            continue
        assert ids[-1] == tok.eod and tok.detokenize(ids[:-1].tolist()) == text
    _, paths = read_documents(f"{out}_path_document")
    assert [tok.detokenize(p[:-1].tolist()) for p in paths] == corpus["files"]  # a second key


def test_workers_write_identical_files(jsonl_outputs):
    """Independent of test order: the fixture makes both outputs (this test never skips)."""
    (w1, _), (w2, _) = jsonl_outputs[1], jsonl_outputs[2]
    for ext in (".bin", ".idx"):
        a = open(f"{w1}_text_document{ext}", "rb").read()
        assert len(a) > 0 and a == open(f"{w2}_text_document{ext}", "rb").read()


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl"])
def test_progress_bar_counts_file_bytes(tmp_path, monkeypatch, suffix):
    """The bar's total is the input files' size on disk, so it must count bytes on disk: compressed
    ones for .gz (raw text is ~20x larger here), ending exactly at the total, never beyond."""
    import gzip

    import tqdm

    from megacoat.data.preprocessing import preprocess

    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": " ".join(str(int(v)) for v in rng.integers(0, 9, size=200))}) + "\n"
             for _ in range(300)] + ["\n\n"]  # trailing blank lines count too
    path = tmp_path / f"ids{suffix}"
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    seen = []

    class RecordingBar(tqdm.tqdm):
        def update(self, n=1):
            super().update(n)
            seen.append((self.n, self.total))

    monkeypatch.setattr(tqdm, "tqdm", RecordingBar)
    result = preprocess([str(path)], str(tmp_path / "out"), "NullTokenizer", vocab_size=10, progress=True)
    assert result.documents == 300
    size = os.path.getsize(path)
    assert seen and all(total == size for _, total in seen)
    assert all(n <= size for n, _ in seen)
    assert seen[-1][0] == size


def test_text_files_and_text_lines(corpus):
    directory = os.path.dirname(next(f for f in corpus["files"] if f.endswith(os.path.join("json", "decoder.py"))))
    out = corpus["tmp"] / "files"
    run_tool("preprocess_data.py", "--input", directory, "--input-format", "text-files", "--input-suffix", ".py",
             "--output-prefix", out, "--tokenizer-type", "GPTSentencePieceTokenizer",
             "--tokenizer-model", corpus["model"], "--workers", 2)
    tok = GPTSentencePieceTokenizer(corpus["model"])
    _, docs = read_documents(f"{out}_text_document")
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    assert len(docs) == len(names)
    assert tok.detokenize(docs[0].tolist()) == open(os.path.join(directory, names[0]), encoding="utf-8").read()

    lines = corpus["tmp"] / "lines.txt"
    lines.write_text("first document\n\nthird document\n")
    out = corpus["tmp"] / "lines"
    run_tool("preprocess_data.py", "--input", lines, "--output-prefix", out, "--tokenizer-type",
             "GPTSentencePieceTokenizer", "--tokenizer-model", corpus["model"], "--append-eod")
    ds, docs = read_documents(f"{out}_text_document")
    assert ds.num_documents == 3 and len(docs[1]) == 0  # empty documents are kept, without eod (Megatron)
    assert tok.detokenize(docs[2][:-1].tolist()) == "third document"


def test_bad_lines_are_reported_or_skipped(corpus):
    bad = corpus["tmp"] / "bad.jsonl"
    bad.write_text('{"text": "good"}\n{"text": broken\n{"other": "x"}\n["list"]\n{"text": "also good"}\n')
    out = corpus["tmp"] / "bad"
    args = ["--input", bad, "--output-prefix", out, "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", corpus["model"], "--append-eod"]
    proc = run_tool("preprocess_data.py", *args, ok=False)
    assert proc.returncode == 1
    assert f"{bad}:2: malformed JSON" in proc.stderr and "--skip-bad-lines" in proc.stderr
    assert not os.path.exists(f"{out}_text_document.bin")  # no partial output
    proc = run_tool("preprocess_data.py", *args, "--skip-bad-lines", "--workers", 2)
    assert f"{bad}:3: missing key 'text'" in proc.stderr and f"{bad}:4: expected a JSON object" in proc.stderr
    assert "skipped 3 bad line(s)" in proc.stderr
    assert IndexedDataset(f"{out}_text_document").num_documents == 2


def test_null_tokenizer_and_int32_output(corpus):
    src = corpus["tmp"] / "ids.txt"
    src.write_text("1 2 3\n70000 5\n")
    out = corpus["tmp"] / "ids"
    run_tool("preprocess_data.py", "--input", src, "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
             "--vocab-size", 100000, "--append-eod")
    ds, docs = read_documents(f"{out}_text_document")
    assert ds.dtype == np.int32
    assert docs[0].tolist() == [1, 2, 3, 100000] and docs[1].tolist() == [70000, 5, 100000]


def test_clear_tool_errors(corpus):
    proc = run_tool("preprocess_data.py", "--input", corpus["tmp"] / "missing.jsonl", "--output-prefix",
                    corpus["tmp"] / "x", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                    corpus["model"], ok=False)
    assert proc.returncode == 1 and "no such file" in proc.stderr
    proc = run_tool("preprocess_data.py", "--input", corpus["jsonl"], "--output-prefix", corpus["tmp"] / "x",
                    "--tokenizer-type", "GPTSentencePieceTokenizer", ok=False)
    assert proc.returncode == 1 and "--tokenizer-model" in proc.stderr


def test_undecodable_file_stops_or_is_skipped(tmp_path):
    """text-files: a file that is not UTF-8 (site-packages holds some) names itself and the flag to
    pass; with --skip-bad-lines it is left out and the other files are kept."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("1 2 3")  # NullTokenizer: the text is the token ids
    (src / "b.py").write_bytes(b"4 \xa4 5")
    (src / "c.py").write_text("6 7")
    from megacoat.data.preprocessing import BadInputError, expand_inputs, preprocess
    files = expand_inputs([str(src)], [".py"])
    with pytest.raises(BadInputError, match=r"(?s)b\.py: not valid UTF-8.*--skip-bad-lines"):
        preprocess(files, str(tmp_path / "stop"), "NullTokenizer", vocab_size=256, input_format="text-files",
                   progress=False)
    result = preprocess(files, str(tmp_path / "skip"), "NullTokenizer", vocab_size=256, input_format="text-files",
                        skip_bad_lines=True, progress=False)
    assert result.documents == 2
