"""Empty data: preprocessing warns; training refuses an empty train split before building the model, naming the
data and the split; an empty validation split skips evaluation with a warning."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from megacoat.config import ConfigError, parse_args, validate_config
from megacoat.data import DataConfigError, build_datasets, build_tokenizer
from megacoat.data.indexed_dataset import IndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--log-interval", "1"]
VOCAB = 300


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def preprocess(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=_env())


def null_data(path, n_docs, seed=0):
    """A NullTokenizer dataset (eod = VOCAB) of random documents; n_docs = 0: an empty one."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(str(path), dtype=np.uint16) as b:
        for _ in range(n_docs):
            b.add_document(np.append(rng.integers(0, VOCAB, size=int(rng.integers(20, 90))), VOCAB))
    return str(path)


def cfg_of(tmp_path, *flags):
    cfg = parse_args(TINY + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--num-workers", "0",
                             "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                             "--data-cache-path", str(tmp_path / "cache"), *flags])
    validate_config(cfg, 1)
    return cfg


def test_preprocessing_empty_input_warns(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    out = tmp_path / "empty"
    r = preprocess("--input", src, "--output-prefix", out, "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB)
    assert r.returncode == 0, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: wrote no documents to ") and f"{out}_text_document" in last, r.stderr
    assert "training on it will be refused" in last


def test_preprocessing_every_line_skipped_warns_with_the_count(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": 1 2}\n["not an object"]\n{"other": "3 4"}\n')
    r = preprocess("--input", src, "--output-prefix", tmp_path / "bad", "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", VOCAB, "--skip-bad-lines")
    assert r.returncode == 0, r.stderr
    assert "skipped 3 bad line(s)" in r.stderr
    assert "warning: wrote no documents" in r.stderr and "3 bad line(s) were skipped under --skip-bad-lines" in r.stderr


def test_preprocessing_empty_texts_warn(tmp_path):
    src = tmp_path / "blank.jsonl"
    src.write_text('{"text": ""}\n{"text": ""}\n')
    r = preprocess("--input", src, "--output-prefix", tmp_path / "blank", "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", VOCAB, "--append-eod")
    assert r.returncode == 0, r.stderr
    assert "warning: wrote 2 document(s) without a token" in r.stderr


def test_preprocessing_real_data_does_not_warn(tmp_path):
    src = tmp_path / "ok.jsonl"
    src.write_text('{"text": "5 6 7"}\n')
    r = preprocess("--input", src, "--output-prefix", tmp_path / "ok", "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", VOCAB)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


@pytest.fixture
def no_model(monkeypatch):
    """The trainer fails the test if it gets as far as building the model."""
    import megacoat.training.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")
    monkeypatch.setattr(trainer, "build_model_chunks", refuse)
    return trainer.Trainer


@pytest.mark.parametrize("flags_of,names", [
    (lambda e, ok: ["--data-path", e], ["--data-path", "{e}", "--split 969,30,1", "no train documents",
                                        "{e} holds no documents"]),
    (lambda e, ok: ["--data-path", ok, e], ["{e} holds no documents", "train"]),  # a blend with an empty part
    (lambda e, ok: ["--data-path", "0.5", ok, "0.5", e], ["{e} holds no documents", "train"]),
    (lambda e, ok: ["--data-path", ok, "--split", "1,1000,0"], ["--split 1,1000,0", "{ok} has 0 of its 30 documents",
                                                                "no train documents"]),
    (lambda e, ok: ["--train-data-path", e, "--valid-data-path", ok], ["--train-data-path {e}", "no train documents"]),
])
def test_training_refuses_an_empty_train_split_before_the_model(tmp_path, no_model, flags_of, names):
    e, ok = null_data(tmp_path / "empty", 0), null_data(tmp_path / "ok", 30)
    with pytest.raises(DataConfigError) as err:
        no_model(cfg_of(tmp_path, *flags_of(e, ok)))
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name.format(e=e, ok=ok) in message, message


def test_documents_without_tokens_are_refused_naming_the_split(tmp_path, no_model):
    prefix = str(tmp_path / "one")
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        b.add_document(np.array([VOCAB], dtype=np.uint16))  # one token: not one sample
    with pytest.raises(DataConfigError, match=f"--data-path {prefix} --split 1: .*the train split has 1 tokens"):
        no_model(cfg_of(tmp_path, "--data-path", prefix, "--split", "1"))


def test_split_without_train_share_is_refused_by_the_flags(tmp_path):
    ok = null_data(tmp_path / "ok", 30)
    with pytest.raises(ConfigError, match=f"--split 0,1,0 leaves no documents of --data-path {ok} for training"):
        cfg_of(tmp_path, "--data-path", ok, "--split", "0,1,0")


def test_empty_validation_split_skips_evaluation_with_a_warning(tmp_path, caplog):
    from megacoat.training.trainer import pretrain

    ok = null_data(tmp_path / "ok", 30)
    cfg = cfg_of(tmp_path, "--data-path", ok, "--split", "100,0,0")
    with caplog.at_level(logging.WARNING, logger="megacoat.data"):
        datasets = build_datasets(cfg, build_tokenizer(cfg.data))
    assert datasets.train is not None and datasets.valid is None
    assert f"--split 100,0,0 leaves no documents of --data-path {ok} for validation: evaluation is skipped" in \
        caplog.text
    state = pretrain(cfg)  # trains without evaluating
    assert state.iteration == 2


def test_no_warning_when_no_validation_is_asked_for(tmp_path, caplog):
    ok = null_data(tmp_path / "ok", 30)
    cfg = cfg_of(tmp_path, "--data-path", ok, "--split", "100,0,0", "--eval-iters", "0")
    with caplog.at_level(logging.WARNING, logger="megacoat.data"):
        build_datasets(cfg, build_tokenizer(cfg.data))
    assert "evaluation is skipped" not in caplog.text


def test_cli_refuses_empty_data_with_one_line(tmp_path):
    e = null_data(tmp_path / "empty", 0)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "2",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--data-path", e,
                        "--data-cache-path", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "NoneType" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"pretrain_gpt.py: error: --data-path {e} --split 969,30,1: no train documents: {e} holds no "
                    "documents; check the input given to tools/preprocess_data.py (it reports the documents it wrote)")


@pytest.mark.parametrize("rank", [0, 1])
def test_library_warnings_show_on_rank_0_only(rank):
    """Every rank builds the same datasets from the same flags: a warning of rank 0's repeated by each of a
    thousand ranks buries the log. Other ranks still show errors."""
    import io

    from megacoat.training.log import configure_library_logging

    logger = logging.getLogger("megacoat")
    saved = (list(logger.handlers), logger.level)
    for h in [h for h in logger.handlers if getattr(h, "megacoat_handler", False)]:
        logger.removeHandler(h)
    stream = io.StringIO()
    try:
        configure_library_logging(stream, rank=rank)
        logging.getLogger("megacoat.data").warning("warning: the validation split is empty")
        logging.getLogger("megacoat.data").error("the index file is unreadable")
    finally:
        logger.handlers[:], logger.level = saved
    shown = stream.getvalue()
    assert ("warning: the validation split is empty" in shown) == (rank == 0)
    assert "the index file is unreadable" in shown
