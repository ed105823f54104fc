"""One run per --save directory: a second writer is refused naming the owner, a dead owner's lock is
taken over, a directory without its tracker is resumed (never taken for empty), another run's
checkpoints are never overwritten or pruned."""
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from megacoat.checkpoint import CheckpointError
from megacoat.checkpoint.ownership import LOCK_FILE, SaveDirLock
from megacoat.config import parse_args
from megacoat.training.trainer import Trainer
from test_cli import ROOT, TINY, _env, run_cli

COMMON = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0"]
TRACKER = "latest_checkpointed_iteration.txt"

HOLD_LOCK = r"""
import sys, time
from megacoat.checkpoint.ownership import SaveDirLock
lock = SaveDirLock(sys.argv[1], "other-run")
print("locked", flush=True)
time.sleep(600)
"""


def train(args):
    """Train in this process; returns the trainer and the lines it logged."""
    out = io.StringIO()
    t = Trainer(parse_args(COMMON + args), log_stream=out)
    t.train()
    return t, out.getvalue().splitlines()


def _iters(save):
    return sorted(n for n in os.listdir(save) if n.startswith("iter_"))


@pytest.fixture
def held_lock(tmp_path):
    """Another process holding the lock of tmp_path/ckpt; yields (dir, pid)."""
    save = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, save], env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked"
    yield save, p
    if p.poll() is None:
        p.kill()
    p.wait()


def test_a_second_writer_is_refused_naming_the_owner(held_lock):
    save, owner = held_lock
    with pytest.raises(CheckpointError) as e:
        Trainer(parse_args(COMMON + ["--train-iters", "2", "--save", save]), log_stream=open(os.devnull, "w"))
    msg = str(e.value)
    assert f"--save {save} is in use by another run" in msg
    assert f"host {socket.gethostname()}, pid {owner.pid}" in msg
    assert not _iters(save)


@pytest.mark.slow
def test_a_second_writer_from_the_command_line_gets_a_message(held_lock):
    save, owner = held_lock
    r = run_cli(COMMON + ["--train-iters", "2", "--save", save, "--load", save])
    assert r.returncode != 0
    assert f"pid {owner.pid}" in r.stderr + r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_lock_of_a_dead_run_is_taken_over(held_lock):
    save, owner = held_lock
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    t, lines = train(["--train-iters", "2", "--save", save])
    assert any(f"taking over --save {save} from a run that ended without releasing it" in x and
               f"pid {owner.pid}" in x for x in lines), lines
    assert _iters(save) == ["iter_0000002"]
    # A clean end releases it silently: the next run of the same directory says nothing about it.
    _, lines = train(["--train-iters", "3", "--save", save, "--load", save, "--override-opt_param-scheduler"])
    assert not any("taking over" in x for x in lines), lines


def test_the_lock_is_released_when_a_run_fails(tmp_path):
    save = str(tmp_path / "ckpt")
    t = Trainer(parse_args(COMMON + ["--train-iters", "2", "--save", save]), log_stream=open(os.devnull, "w"))

    def fail(trainer, rec):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError):
        t.train(on_step=fail)
    SaveDirLock(save, "next").release()  # free again, though `t` is still alive


def test_a_directory_without_its_tracker_is_resumed_not_emptied(tmp_path):
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "4", "--save", save, "--save-interval", "1", "--save-retain", "2"])
    assert _iters(save) == ["iter_0000003", "iter_0000004"]
    os.remove(os.path.join(save, TRACKER))  # a copy without it, or a crash before the tracker was written
    t, lines = train(["--train-iters", "6", "--save", save, "--load", save, "--override-opt_param-scheduler",
                      "--save-interval", "1", "--save-retain", "2"])
    assert any(f"{save} has no {TRACKER}: loading its newest complete checkpoint" in x and x.endswith("iter_0000004")
               for x in lines), lines
    assert any("loaded checkpoint" in x and "(iteration 4)" in x for x in lines), lines
    assert _iters(save) == ["iter_0000005", "iter_0000006"]  # the run's own, rotated as before


def test_a_fresh_run_never_writes_over_another_runs_checkpoints(tmp_path):
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "2", "--save", save])
    before = {n: os.stat(os.path.join(save, n, "metadata.json")).st_mtime_ns for n in _iters(save)}
    for tracker in (True, False):
        if not tracker:
            os.remove(os.path.join(save, TRACKER))
        with pytest.raises(CheckpointError) as e:
            train(["--train-iters", "3", "--save", save, "--save-retain", "1"])
        assert f"--save {save} holds checkpoints of another run (iteration 2)" in str(e.value)
        assert f"--load {save}" in str(e.value)
        assert {n: os.stat(os.path.join(save, n, "metadata.json")).st_mtime_ns for n in _iters(save)} == before


def test_finetuning_into_its_source_directory_says_where_to_save(tmp_path):
    save, other = str(tmp_path / "ckpt"), str(tmp_path / "tuned")
    train(["--train-iters", "2", "--save", save])
    with pytest.raises(CheckpointError) as e:  # iterations restart at 0 among the source run's checkpoints
        train(["--train-iters", "2", "--finetune", "--load", save, "--save", save])
    assert f"--finetune starts a new run at iteration 0 from the weights in {save}" in str(e.value)
    assert "give --save another directory" in str(e.value)
    trainer, _ = train(["--train-iters", "2", "--finetune", "--load", save, "--save", other])
    assert _iters(other) == ["iter_0000002"] and _iters(save) == ["iter_0000002"]


def test_retention_never_deletes_another_runs_checkpoint(tmp_path):
    """A checkpoint of another run, older than the one this run resumed from, stays."""
    other = str(tmp_path / "other")
    train(["--train-iters", "1", "--save", other])
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "4", "--save", save, "--save-interval", "2"])
    shutil.copytree(os.path.join(other, "iter_0000001"), os.path.join(save, "iter_0000001"))
    train(["--train-iters", "6", "--save", save, "--load", save, "--override-opt_param-scheduler", "--save-interval",
           "1", "--save-retain", "1"])
    assert _iters(save) == ["iter_0000001", "iter_0000006"]  # its own 2, 4, 5 rotated out; the other's kept
    assert open(os.path.join(save, TRACKER)).read().strip() == "6"


def test_the_lock_file_is_the_only_trace(tmp_path):
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "1", "--save", save])
    assert open(os.path.join(save, LOCK_FILE)).read() == ""  # released cleanly: no owner recorded


def test_a_conversion_into_a_live_runs_directory_is_refused(held_lock, tmp_path):
    save, owner = held_lock
    src = str(tmp_path / "src")
    train(["--train-iters", "1", "--save", src])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), "--load-format",
                        "megacoat", "--load-dir", src, "--save-format", "megacoat", "--save-dir", save, "--force"],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--save-dir {save} is in use by another run" in r.stderr and f"pid {owner.pid}" in r.stderr
    assert not _iters(save)


def test_a_refused_conversion_leaves_the_directory_another_run_just_made(tmp_path, monkeypatch):
    """--save-dir did not exist when convert.py started, and another run created and locked it before convert's
    lock: the refused conversion must leave that run's directory and lock file alone (a failed conversion removes
    only a directory that it made and holds)."""
    import megacoat.checkpoint.ownership as ownership
    from test_checkpoint_hf import convert

    src, save = str(tmp_path / "src"), str(tmp_path / "new")
    train(["--train-iters", "1", "--save", src])
    holders = []
    real = ownership.SaveDirLock

    def lock_after_another_run(save_dir, run_id, *a, **kw):
        p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, save_dir], env=_env(), cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
        holders.append(p)
        assert p.stdout.readline().strip() == "locked"
        return real(save_dir, run_id, *a, **kw)

    monkeypatch.setattr(ownership, "SaveDirLock", lock_after_another_run)
    try:
        assert convert("--load-format", "megacoat", "--load-dir", src, "--save-format", "megacoat",
                       "--save-dir", save) == 2
        assert os.listdir(save) == [LOCK_FILE]
        with open(os.path.join(save, LOCK_FILE)) as f:
            assert json.load(f)["pid"] == holders[0].pid  # still the other run's lock
    finally:
        for p in holders:
            p.kill()
            p.wait()
