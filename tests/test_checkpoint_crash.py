"""A process killed (SIGKILL) at any moment of a save leaves the previous checkpoint loadable and the
tracker pointing at it; the next save cleans up what the killed one left."""
import os
import signal
import subprocess
import sys
import time

import pytest

from megacoat.checkpoint import CheckpointReader, resolve_checkpoint_dir
from test_cli import ROOT, TINY, _env

ARGS = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0"]

# Runs in a subprocess: train and save iterations 1, 2, then kill itself at `point` of the save at 3
# (on_step runs after a step and before that step's save).
KILL_AT = r"""
import os, signal, sys
import megacoat.checkpoint.checkpointer as c
import megacoat.checkpoint.writer as w
from megacoat.config import parse_args
from megacoat.training.trainer import Trainer

point, args = sys.argv[1], sys.argv[2:]

def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)

orig_write_pieces = w.write_pieces
def write_half_then_die(path, pieces, offsets):
    if pieces and '.iter_0000003' in path:
        orig_write_pieces(path, pieces[: len(pieces) // 2], offsets)
        die()
    return orig_write_pieces(path, pieces, offsets)

def arm():
    if point == 'rank_file':
        c.write_pieces = write_half_then_die
    elif point == 'metadata':
        w.write_json_atomic = die
    elif point == 'tracker':
        w.write_tracker = die

cfg = parse_args(args)
t = Trainer(cfg, log_stream=open(os.devnull, 'w'))
t.train(on_step=lambda tr, rec: arm() if tr.state.iteration == 3 else None)
"""


def _run_until_killed(point, save):
    args = ARGS + ["--train-iters", "3", "--save", save, "--save-interval", "1"]
    r = subprocess.run([sys.executable, "-c", KILL_AT, point] + args, env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]


@pytest.mark.parametrize("point", ["rank_file", "metadata", "tracker"])
@pytest.mark.slow
def test_killed_during_save_keeps_previous_checkpoint(tmp_path, point):
    save = str(tmp_path / "ckpt")
    _run_until_killed(point, save)
    path = resolve_checkpoint_dir(save)
    assert path.endswith("iter_0000002")  # the tracker still names the last complete save
    CheckpointReader(path).canonical("model", "final_norm.weight")
    if point != "tracker":
        assert not os.path.exists(os.path.join(save, "iter_0000003"))
    if point != "rank_file":
        return
    # Resuming from it and saving again works, and leaves no partial directory behind.
    args = ARGS + ["--train-iters", "3", "--save", save, "--load", save]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + args, env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loaded checkpoint" in r.stdout and "iter_0000002" in r.stdout
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000001", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]  # no partial directory left


def _tracker_version(save):
    """Identity of the tracker file's current version (it is replaced by rename at every save)."""
    try:
        st = os.stat(os.path.join(save, "latest_checkpointed_iteration.txt"))
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path):
    """A real kill at arbitrary times while a larger model saves every iteration. Each kill lands
    after the run being killed has itself completed a save (the second run rewinds to iteration 1,
    so it re-saves iterations that exist: the directory swap is killed too)."""
    save = str(tmp_path / "ckpt")
    args = ARGS + ["--hidden-size", "256", "--num-layers", "4", "--train-iters", "1000", "--save", save,
                   "--save-interval", "1", "--log-interval", "1000"]
    for delay, rewind in ((0.6, []), (1.3, ["--load", os.path.join(save, "iter_0000001")])):
        before = _tracker_version(save)
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + args + rewind, env=_env(),
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 90
        while _tracker_version(save) in (None, before) and time.time() < deadline:  # this run's first save
            time.sleep(0.05)
        assert _tracker_version(save) not in (None, before), "the run made no checkpoint in 90 s"
        time.sleep(delay)
        assert p.poll() is None, "the run ended before it was killed"
        p.send_signal(signal.SIGKILL)
        p.wait()
        path = resolve_checkpoint_dir(save)
        reader = CheckpointReader(path)
        for name in reader.names():  # every tensor complete and checksummed
            reader.canonical("model", name)
            reader.canonical("optim.exp_avg", name)
        reader.close()
