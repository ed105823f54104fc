"""The command-line tools given wrong or unusual input: a correct result or a one-line error naming the problem
and the fix; never a traceback, never a silently wrong output, never a half-written file left behind."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402


def _jsonl(path, texts, key="text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path


def _ids(n, rng, vocab=10):
    return " ".join(str(rng.randrange(vocab)) for _ in range(n))


def _preprocess(capsys, *args):
    """preprocess_data.main in this process: (exit code, stderr)."""
    try:
        rc = preprocess_data.main([str(a) for a in args])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


@pytest.mark.parametrize("workers", ["0", "-3", "two"])
def test_preprocess_refuses_a_worker_count_below_one(tmp_path, capsys, workers):
    src = _jsonl(tmp_path / "a.jsonl", [_ids(5, random.Random(0))])
    rc, err = _preprocess(capsys, "--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
                          "NullTokenizer", "--vocab-size", 10, "--workers", workers)
    assert rc == 2 and "argument --workers:" in err
    assert not list(tmp_path.glob("o_*"))


def test_pretokenized_text_outside_the_vocabulary_is_a_bad_line(tmp_path, capsys):
    """NullTokenizer input: an id past --vocab-size (which would index past the embedding, or overflow uint16),
    a negative id or a word is reported with file and line, or skipped; the other lines are kept."""
    rng = random.Random(1)
    good = [_ids(7, rng), _ids(4, rng)]
    src = tmp_path / "ids.txt"
    src.write_text(f"{good[0]}\n3 12 1\n5 70000\n2 -4\nhello world\n{good[1]}\n")
    args = ["--input", src, "--tokenizer-type", "NullTokenizer", "--vocab-size", 10, "--append-eod"]
    rc, err = _preprocess(capsys, *args, "--output-prefix", tmp_path / "stop")
    assert rc == 1 and f"{src}:2: key 'text': token id 12 is outside the vocabulary 0..10" in err
    assert "--vocab-size must exceed the largest id" in err and "--skip-bad-lines" in err
    assert not list(tmp_path.glob("stop_*"))
    rc, err = _preprocess(capsys, *args, "--output-prefix", tmp_path / "skip", "--skip-bad-lines", "--workers", 2)
    assert rc == 0 and "skipped 4 bad line(s)" in err
    assert f"{src}:3: key 'text': token id 70000" in err and f"{src}:4: key 'text': token id -4 is negative" in err
    assert f"{src}:5: key 'text': the tokenizer cannot read it" in err
    from megacoat.data.indexed_dataset import IndexedDataset
    ds = IndexedDataset(str(tmp_path / "skip_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[int(x) for x in g.split()] + [10] for g in good]


def test_a_json_key_given_twice_is_refused(tmp_path, capsys):
    src = _jsonl(tmp_path / "a.jsonl", [_ids(5, random.Random(2))])
    rc, err = _preprocess(capsys, "--input", src, "--json-keys", "text", "text", "--output-prefix", tmp_path / "o",
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", 10)
    assert rc == 1 and "--json-keys names 'text' more than once: give each key once" in err
    assert not list(tmp_path.glob("o_*"))
    for key in ("a/b", ""):  # part of an output file's name
        rc, err = _preprocess(capsys, "--input", src, "--json-keys", key, "--output-prefix", tmp_path / "o",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", 10)
        assert rc == 1 and f"--json-keys {key!r}: each key names an output file" in err
    assert not list(tmp_path.glob("o_*")) and not (tmp_path / "o_a").exists()


@pytest.mark.parametrize("tokenizer,flags,named", [
    ("NullTokenizer", ["--vocab-size", 10, "--tokenizer-model", "tok.model"], "--tokenizer-model would be ignored"),
    ("HuggingFaceTokenizer", ["--tokenizer-model", "tok", "--vocab-size", 10], "--vocab-size would be ignored"),
    ("GPT2BPETokenizer", ["--vocab-file", "v.json", "--merge-file", "m.txt", "--vocab-size", 10],
     "--vocab-size would be ignored"),
    ("NullTokenizer", ["--vocab-size", 10, "--vocab-file", "v.json", "--merge-file", "m.txt"],
     "--vocab-file --merge-file would be ignored")])
def test_tokenizer_flags_the_type_does_not_read_are_refused(tmp_path, capsys, tokenizer, flags, named):
    """They were silently ignored: --vocab-size with a SentencePiece or HF tokenizer, a --tokenizer-model with
    NullTokenizer (Megatron's tool ignores them too)."""
    src = _jsonl(tmp_path / "a.jsonl", [_ids(5, random.Random(2))])
    rc, err = _preprocess(capsys, "--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type", tokenizer,
                          *flags)
    assert rc == 2 and f"{named} by --tokenizer-type {tokenizer}" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("o_*"))


def test_an_output_prefix_that_names_no_file_or_lies_under_a_file_is_refused(tmp_path, capsys):
    src = _jsonl(tmp_path / "a.jsonl", [_ids(5, random.Random(3))])
    args = ["--input", src, "--tokenizer-type", "NullTokenizer", "--vocab-size", 10]
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _preprocess(capsys, *args, "--output-prefix", f"{out}{os.sep}")
    assert rc == 1 and "ends with a path separator: name the files too" in err
    assert os.listdir(out) == []
    rc, err = _preprocess(capsys, *args, "--output-prefix", src / "sub" / "o")
    assert rc == 1 and f"{src} is a file, not a directory" in err
    rc, err = _preprocess(capsys, *args, "--output-prefix", tmp_path / "new" / "dir" / "o")  # created
    assert rc == 0 and (tmp_path / "new" / "dir" / "o_text_document.idx").is_file()


def test_a_tokenized_dataset_given_as_input_is_refused(tmp_path, capsys):
    """An earlier output next to the text (or named by mistake) is not read as text into the new dataset."""
    d = tmp_path / "data"
    d.mkdir()
    _jsonl(d / "a.jsonl", [_ids(6, random.Random(4))])
    args = ["--tokenizer-type", "NullTokenizer", "--vocab-size", 10]
    assert _preprocess(capsys, "--input", d, "--output-prefix", d / "first", *args)[0] == 0
    rc, err = _preprocess(capsys, "--input", d, "--output-prefix", tmp_path / "again", *args)
    assert rc == 1 and f"holds {d / 'first_text_document.bin'}, a tokenized dataset file, not text" in err
    assert "--input-suffix" in err and not list(tmp_path.glob("again_*"))
    rc, err = _preprocess(capsys, "--input", d / "first_text_document.idx", "--output-prefix", tmp_path / "x", *args)
    assert rc == 1 and "is a tokenized dataset file (.bin/.idx), not text" in err
    (d / "killed_text_document.bin.tmp4242").write_bytes(np.arange(8, dtype=np.uint16).tobytes())
    rc, err = _preprocess(capsys, "--input", d, "--input-suffix", ".jsonl", "--output-prefix", tmp_path / "ok", *args)
    assert rc == 0  # the suffix picks the text
    rc, err = _preprocess(capsys, "--input", d / "killed_text_document.bin.tmp4242", "--output-prefix",
                          tmp_path / "x", *args)
    assert rc == 1 and "tokenized dataset file" in err


@pytest.mark.slow
@pytest.mark.parametrize("sig,workers", [(signal.SIGTERM, 2), (signal.SIGINT, 1)])
def test_an_interrupted_run_leaves_no_file_and_no_traceback(tmp_path, sig, workers):
    """Killed mid-write (a scheduler's SIGTERM, Ctrl-C): the partial .bin is removed, one line says so."""
    src = tmp_path / "ids.txt"
    rng = random.Random(5)
    src.write_text("".join(_ids(8, rng) + "\n" for _ in range(1000)) * 1000)  # a million documents
    prefix = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(src),
                             "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size",
                             "10", "--workers", str(workers), "--log-interval", "0"],
                            stderr=subprocess.PIPE, text=True,
                            # a shell without job control starts background jobs with SIGINT ignored, and Python
                            # then installs no Ctrl-C handler: the child gets the default, as a terminal gives it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not [p for p in tmp_path.glob("o_*.tmp*") if p.stat().st_size] and proc.poll() is None:
        assert time.time() < deadline, "the run never started writing"
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "interrupted: nothing written (the partial files were removed)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.txt"]


def _train_tokenizer(capsys, *args):
    """train_tokenizer.main in this process: (exit code, stderr)."""
    rc = train_tokenizer.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_tokenizer_training_keeps_the_old_model_and_prints_no_traceback(tmp_path, capsys,
                                                                                     monkeypatch, how):
    src = _jsonl(tmp_path / "c.jsonl", _words(50, random.Random(8)))
    out = tmp_path / "t.model"
    out.write_bytes(b"the previous model")

    def interrupted(*args, **kwargs):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at once, inside this call
        time.sleep(5)
        raise AssertionError("SIGTERM was not turned into an interruption")

    monkeypatch.setattr(train_tokenizer, "train_sentencepiece", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    rc, err = _train_tokenizer(capsys, "--input", src, "--output-model", out, "--vocab-size", 300, "--threads", 1)
    assert rc == 128 + (signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
    assert f"interrupted: no model written ({out} is as it was)" in err
    assert out.read_bytes() == b"the previous model" and signal.getsignal(signal.SIGTERM) is before


def _words(n_lines, rng):
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    return [" ".join(rng.choice(words) for _ in range(20)) for _ in range(n_lines)]


@pytest.mark.parametrize("flag,value,message", [
    ("--vocab-size", 0, "--vocab-size 0 must be >= 1"), ("--vocab-size", -5, "--vocab-size -5 must be >= 1"),
    ("--threads", 0, "--threads 0 must be in [1, 1024]"),
    ("--character-coverage", 2, "--character-coverage 2.0 must be in [0.98, 1]"),
    ("--max-input-bytes", 0, "--max-input-bytes 0 must be >= 1")])
def test_train_tokenizer_options_out_of_range_name_the_flag(tmp_path, capsys, flag, value, message):
    src = _jsonl(tmp_path / "c.jsonl", _words(50, random.Random(6)))
    args = ["--input", src, "--output-model", tmp_path / "t.model", "--vocab-size", 300, "--threads", 1]
    rc, err = _train_tokenizer(capsys, *args, flag, value)
    assert rc == 1 and f"error: {message}" in err and not (tmp_path / "t.model").exists()


def test_train_tokenizer_failures_say_what_is_wrong_with_the_text(tmp_path, capsys):
    """No text (empty input, the key missing from every skipped line, only over-long lines) and a vocabulary
    smaller than the text's characters each get their own message, not one hint about small vocabularies."""
    rng = random.Random(7)
    good = _jsonl(tmp_path / "c.jsonl", _words(50, rng))
    out = tmp_path / "t.model"
    common = ["--output-model", out, "--threads", 1]
    rc, err = _train_tokenizer(capsys, "--input", good, "--vocab-size", 10, *common)
    chars = len(set("".join(_words(50, random.Random(7)))))
    assert rc == 1 and f"--vocab-size 10 is too small for this text: it needs at least {chars + 256 + 4}" in err
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    rc, err = _train_tokenizer(capsys, "--input", empty, "--vocab-size", 300, *common)
    assert rc == 1 and "no text to train on: the input holds no non-blank line" in err
    rc, err = _train_tokenizer(capsys, "--input", good, "--json-keys", "body", "--skip-bad-lines", "--vocab-size",
                               300, *common)
    assert rc == 1 and "no text to train on" in err
    long = _jsonl(tmp_path / "long.jsonl", ["x" * 20000, "y" * 17000])
    rc, err = _train_tokenizer(capsys, "--input", long, "--vocab-size", 300, *common)
    assert rc == 1 and "all 2 non-blank line(s) are longer than 16384 bytes" in err
    (tmp_path / "none").mkdir()
    rc, err = _train_tokenizer(capsys, "--input", tmp_path / "none", "--vocab-size", 300, *common)
    assert rc == 2 and "--input matched no files" in err
    assert not out.exists()


def test_a_vocabulary_smaller_than_asked_is_reported(tmp_path, capsys):
    """SentencePiece stops early when the text holds fewer pieces than --vocab-size: that is said, with the
    model's real size, not left for the user to find out."""
    src = _jsonl(tmp_path / "c.jsonl", _words(100, random.Random(8)))
    out = tmp_path / "t.model"
    rc, err = _train_tokenizer(capsys, "--input", src, "--output-model", out, "--vocab-size", 100000, "--threads", 1)
    import sentencepiece as spm
    pieces = spm.SentencePieceProcessor(model_file=str(out)).get_piece_size()
    assert rc == 0 and pieces < 1000
    assert f"wrote {out} ({pieces} pieces)" in err
    assert f"warning: the model has {pieces} pieces, fewer than --vocab-size 100000" in err
    rc, err = _train_tokenizer(capsys, "--input", src, "--output-model", out, "--vocab-size", pieces, "--threads", 1)
    assert rc == 0 and "warning" not in err


def test_an_unwritable_output_model_is_refused_before_training(tmp_path, capsys):
    """A directory, a path under a file: refused before the (long) training, with no temporary file left."""
    src = _jsonl(tmp_path / "c.jsonl", _words(50, random.Random(9)))
    args = ["--input", src, "--vocab-size", 300, "--threads", 1]
    (tmp_path / "models").mkdir()
    rc, err = _train_tokenizer(capsys, *args, "--output-model", tmp_path / "models")
    assert rc == 1 and f"--output-model {tmp_path / 'models'} is a directory: name the file" in err
    rc, err = _train_tokenizer(capsys, *args, "--output-model", src / "t.model")
    assert rc == 1 and f"{src} is a file, not a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "models"] and not os.listdir(tmp_path / "models")
    rc, err = _train_tokenizer(capsys, *args, "--output-model", tmp_path / "new" / "t.model")  # created
    assert rc == 0 and (tmp_path / "new" / "t.model").is_file()


def test_train_tokenizer_bad_lines_name_the_flag_and_are_shown_ten_at_most(tmp_path, capsys):
    rng = random.Random(10)
    src = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": t}) for t in _words(60, rng)] + ["{broken"] * 30
    src.write_text("\n".join(lines) + "\n")
    args = ["--input", src, "--output-model", tmp_path / "t.model", "--vocab-size", 300, "--threads", 1]
    rc, err = _train_tokenizer(capsys, *args)
    assert rc == 1 and f"{src}:61: malformed JSON" in err and "(pass --skip-bad-lines to skip malformed lines)" in err
    # raised inside SentencePiece's reading: its message, not SentencePiece's with a Python stack ("At: ...")
    assert err.startswith(f"error: {src}:61: malformed JSON") and len(err.strip().splitlines()) == 2, err
    rc, err = _train_tokenizer(capsys, *args, "--skip-bad-lines")
    assert rc == 0 and err.count("skipping bad line:") == 10 and "skipped 30 bad line(s)" in err


def test_a_truncated_or_fake_gzip_input_is_named(tmp_path, capsys):
    import gzip
    text = "".join(json.dumps({"text": _ids(50, random.Random(i))}) + "\n" for i in range(200)).encode()
    whole = gzip.compress(text)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "fake.jsonl.gz").write_bytes(text)
    for name in ("cut.jsonl.gz", "fake.jsonl.gz"):
        rc, err = _preprocess(capsys, "--input", tmp_path / name, "--output-prefix", tmp_path / "o",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", 10, "--skip-bad-lines")
        assert rc == 1 and f"{tmp_path / name}: not a complete gzip file" in err
        assert not list(tmp_path.glob("o_*"))


def test_a_file_named_twice_or_not_a_file_is_refused(tmp_path, capsys):
    """`--input d d/a.jsonl` (a directory and a file under it) would tokenize a.jsonl twice into the dataset."""
    d = tmp_path / "d"
    d.mkdir()
    src = _jsonl(d / "a.jsonl", [_ids(5, random.Random(11))])
    args = ["--output-prefix", tmp_path / "o", "--tokenizer-type", "NullTokenizer", "--vocab-size", 10]
    rc, err = _preprocess(capsys, "--input", src, src, *args)
    assert rc == 1 and f"--input names {src} twice: give each file once" in err
    rc, err = _preprocess(capsys, "--input", d, os.path.relpath(src), *args)
    assert rc == 1 and f"--input names {os.path.relpath(src)} twice (also as {src}): give each file once" in err
    rc, err = _preprocess(capsys, "--input", os.devnull, *args)
    assert rc == 1 and f"--input {os.devnull} is neither a regular file nor a directory" in err
    assert not list(tmp_path.glob("o_*"))


def test_train_tokenizer_will_not_overwrite_its_input(tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl", _words(50, random.Random(12)))
    before = src.read_bytes()
    rc, err = _train_tokenizer(capsys, "--input", tmp_path, "--output-model", src, "--vocab-size", 300, "--threads", 1)
    assert rc == 2 and f"--output-model {src} is one of the --input files" in err
    assert src.read_bytes() == before


def test_an_unpaired_surrogate_escape_is_a_bad_line(tmp_path, capsys):
    """A JSON escape of half a UTF-16 pair ("\\ud800", left by text cut inside an emoji) decodes to no text:
    SentencePiece raised from inside the tokenizer (a traceback, even with --skip-bad-lines); now it is a bad
    line like undecodable bytes, and a full pair is still one character."""
    rng = random.Random(13)
    src = tmp_path / "c.jsonl"
    good = _words(60, rng)
    lines = [json.dumps({"text": t}) for t in good]
    lines.insert(30, '{"text": "cut \\ud83d here"}')
    lines.append('{"text": "a pair \\ud83d\\ude00 is fine"}')
    src.write_text("\n".join(lines) + "\n")
    model = tmp_path / "t.model"
    args = ["--input", src, "--output-model", model, "--vocab-size", 300, "--threads", 1]
    rc, err = _train_tokenizer(capsys, *args)
    assert rc == 1 and f"{src}:31: key 'text' holds an unpaired surrogate \\ud83d" in err and not model.exists()
    rc, err = _train_tokenizer(capsys, *args, "--skip-bad-lines")
    assert rc == 0 and "skipped 1 bad line(s)" in err
    common = ["--input", src, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    for workers in (1, 2):
        rc, err = _preprocess(capsys, *common, "--output-prefix", tmp_path / "stop", "--workers", workers)
        assert rc == 1 and f"{src}:31: key 'text' holds an unpaired surrogate" in err
        assert not list(tmp_path.glob("stop_*"))
    rc, err = _preprocess(capsys, *common, "--output-prefix", tmp_path / "skip", "--skip-bad-lines")
    assert rc == 0 and "skipped 1 bad line(s)" in err
    from megacoat.data.indexed_dataset import IndexedDataset
    from megacoat.data.tokenizer import build_tokenizer_by_type
    tok = build_tokenizer_by_type("GPTSentencePieceTokenizer", str(model))
    ds = IndexedDataset(str(tmp_path / "skip_text_document"))
    assert len(ds) == 61 and tok.detokenize(ds[60].tolist()) == "a pair \U0001F600 is fine"


def test_a_byte_order_mark_is_no_text(tmp_path, capsys):
    """A UTF-8 byte-order mark opening a file (as Windows editors write) made the first JSONL line 'malformed
    JSON' and went into the first document of a text file; it is left out."""
    rng = random.Random(14)
    docs = [_ids(6, rng) for _ in range(3)]
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    (tmp_path / "b.txt").write_bytes(bom + "".join(d + "\n" for d in docs).encode())
    (tmp_path / "c.py").write_bytes(bom + docs[0].encode())
    from megacoat.data.indexed_dataset import IndexedDataset
    want = [[int(x) for x in d.split()] for d in docs]
    for name, fmt, expect in (("a.jsonl", "auto", want), ("b.txt", "auto", want), ("c.py", "text-files", want[:1])):
        rc, err = _preprocess(capsys, "--input", tmp_path / name, "--input-format", fmt, "--output-prefix",
                              tmp_path / name.replace(".", "_"), "--tokenizer-type", "NullTokenizer", "--vocab-size",
                              10)
        assert rc == 0, err
        ds = IndexedDataset(str(tmp_path / f"{name.replace('.', '_')}_text_document"))
        assert [ds[i].tolist() for i in range(len(ds))] == expect


def test_preprocess_will_not_overwrite_its_input(tmp_path, capsys):
    """Text named like the dataset the prefix writes was replaced by that dataset (the text was lost)."""
    src = tmp_path / "c_text_document.idx"
    src.write_text(_ids(8, random.Random(15)) + "\n")
    before = src.read_bytes()
    for prefix in (tmp_path / "c", os.path.relpath(tmp_path / "c")):
        rc, err = _preprocess(capsys, "--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", 10)
        assert rc == 1 and f"the output {prefix}_text_document.idx is one of the --input files" in err
    assert src.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["c_text_document.idx"]


def test_ctrl_c_while_sentencepiece_reads_the_text_is_an_interruption(tmp_path, capsys, monkeypatch):
    """Ctrl-C arrives while SentencePiece pulls lines from the reader (most of a training's reading): it was
    reported as 'SentencePiece training failed: INTERNAL: KeyboardInterrupt' with exit code 1."""
    src = _jsonl(tmp_path / "c.jsonl", _words(50, random.Random(16)))
    out = tmp_path / "t.model"
    read = train_tokenizer.texts

    def interrupted(*args, **kwargs):
        for i, text in enumerate(read(*args, **kwargs)):
            if i == 20:
                raise KeyboardInterrupt
            yield text

    monkeypatch.setattr(train_tokenizer, "texts", interrupted)
    rc, err = _train_tokenizer(capsys, "--input", src, "--output-model", out, "--vocab-size", 300, "--threads", 1)
    assert rc == 128 + signal.SIGINT and err.strip() == f"interrupted: no model written ({out} is as it was)"
    assert not out.exists()
