"""Re-saving an iteration that exists never leaves the tracker pointing at nothing: a failure at
any point of the swap leaves a loadable checkpoint. The tokenizer copy is fsynced."""
import os
import shutil
import types

import pytest
import torch

import megacoat.checkpoint.format as fmt
import megacoat.checkpoint.writer as writer
from megacoat.checkpoint import CheckpointError, CheckpointReader, resolve_checkpoint_dir
from megacoat.checkpoint.checkpointer import copy_tokenizer
from megacoat.config import parse_args
from megacoat.training.trainer import Trainer
from test_cli import TINY

COMMON = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0", "--train-iters", "2"]


def train_and_save(save, lr):
    """The first call trains two iterations, saving both. Later calls rewind the run to iteration 1
    (`--load <save>/iter_0000001`, as after a loss spike) and retrain iteration 2 with another --lr:
    the existing iter_0000002 is re-saved with other weights while the tracker names it."""
    rewind = ["--load", os.path.join(save, "iter_0000001"), "--override-opt_param-scheduler"] if os.path.isdir(save) \
        else []
    t = Trainer(parse_args(COMMON + ["--save", save, "--save-interval", "1", "--lr", str(lr)] + rewind),
                log_stream=open(os.devnull, "w"))
    t.train()
    return t


def saved_weight(save):
    """The saved word embedding (loading it checks the tracker, the directory and every checksum)."""
    reader = CheckpointReader(resolve_checkpoint_dir(save))
    try:
        for name in reader.names():
            reader.canonical("model", name)
        return reader.canonical("model", "embedding.word_embeddings.weight").clone()
    finally:
        reader.close()


class Crash(Exception):
    pass


def test_resave_replaces_the_iteration(tmp_path):
    save = str(tmp_path / "ckpt")
    train_and_save(save, 1e-3)
    first = saved_weight(save)
    train_and_save(save, 2e-3)
    assert not torch.equal(first, saved_weight(save))  # the rewound run's weights
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000001", "iter_0000002",
                                        "latest_checkpointed_iteration.txt"]


@pytest.fixture(scope="module")
def weights_of_the_resave(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("resave") / "ckpt")
    train_and_save(save, 1e-3)
    train_and_save(save, 2e-3)
    return saved_weight(save)


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "no-exchange-fallback"])
@pytest.mark.parametrize("fail_at", range(4))
def test_failure_during_resave_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, exchange, fail_at,
                                                             weights_of_the_resave):
    """Fail at the n-th file-system step of publishing a re-save (after its files are complete):
    exchange + removal of the old copy, or, without an atomic exchange, the rename sequence."""
    save = str(tmp_path / "ckpt")
    train_and_save(save, 1e-3)
    old = saved_weight(save)
    state = {"armed": False, "n": 0, "failed_at": None}
    real_rename, real_rmtree, real_exchange = os.rename, shutil.rmtree, fmt.exchange_paths
    real_write_json = writer.write_json_atomic

    def step(name, fn, *a, **k):
        if state["armed"]:
            if state["n"] == fail_at:
                state["failed_at"] = name
                raise Crash(f"injected failure at step {fail_at} ({name})")
            state["n"] += 1
        return fn(*a, **k)

    def write_json_then_arm(path, obj):  # metadata.json is the last file of the new directory
        real_write_json(path, obj)
        state["armed"] = True

    monkeypatch.setattr(writer, "write_json_atomic", write_json_then_arm)
    monkeypatch.setattr(fmt, "exchange_paths",
                        lambda a, b: step("exchange", real_exchange, a, b) if exchange else False)
    monkeypatch.setattr(os, "rename", lambda a, b: step("rename", real_rename, a, b))
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: step("rmtree", real_rmtree, path, *a, **k))
    try:
        train_and_save(save, 2e-3)
    except CheckpointError as e:
        assert "injected failure" in str(e)
    monkeypatch.undo()
    expected_failure = fail_at < (2 if exchange else 4)
    assert (state["failed_at"] is not None) == expected_failure, state
    got = saved_weight(save)  # loadable, whatever happened ...
    assert torch.equal(got, old) or torch.equal(got, weights_of_the_resave)  # ... and one of the two saves
    if not expected_failure:
        assert torch.equal(got, weights_of_the_resave)
    # A later save cleans up whatever the failure left behind.
    train_and_save(save, 3e-3)
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000001", "iter_0000002",
                                        "latest_checkpointed_iteration.txt"]


def test_tokenizer_copy_is_fsynced(tmp_path, monkeypatch):
    src_dir = tmp_path / "tok"
    src_dir.mkdir()
    (src_dir / "tokenizer.model").write_bytes(os.urandom(3000))
    (src_dir / "tokenizer_config.json").write_text("{}")
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    partial = tmp_path / "partial"
    partial.mkdir()
    info = copy_tokenizer(types.SimpleNamespace(model_file=str(src_dir / "tokenizer.model"), vocab_size=5),
                           str(partial))
    dst = partial / "tokenizer"
    assert info["tokenizer"]["file"] == os.path.join("tokenizer", "tokenizer.model")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (src_dir / name).read_bytes()
        assert os.path.realpath(dst / name) in synced, name
    assert os.path.realpath(dst) in synced  # the directory entries too
