"""Faults: skip-and-stop, a dead or stuck rank, SIGTERM save-and-resume (exact)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megacoat.config import parse_args
from megacoat.training.faults import SkipGuard, TrainingStopped
from megacoat.training.trainer import pretrain
from test_cli import ROOT, TINY, _env, _free_port, run_cli

ARGS = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0"]


def test_skip_guard_counts_consecutive_skips_only():
    g = SkipGuard(3, torch.device("cpu"))
    for i, ok in enumerate([False, False, True, False, False], 1):
        g.after_step(torch.tensor(ok), i, None)
    with pytest.raises(TrainingStopped, match="stopping at iteration 6: 3 consecutive .* no checkpoint was saved"):
        g.after_step(torch.tensor(False), 6, None)
    SkipGuard(None, torch.device("cpu")).after_step(torch.tensor(False), 1, None)  # off: never stops


def test_non_finite_run_stops_with_last_checkpoint_intact(tmp_path, capsys):
    """Weights turn NaN after step 5 (a checkpoint exists at 4): steps 6-8 are skipped and the run
    stops at 8 with a message; the checkpoint of iteration 4 is still the latest and loads finite."""
    save = tmp_path / "ckpt"
    cfg = parse_args(ARGS + ["--train-iters", "30", "--save", str(save), "--save-interval", "4",
                             "--max-skipped-iterations", "3"])

    def poison(trainer, rec):
        if trainer.state.iteration == 5:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.fill_(float("nan"))

    with pytest.raises(TrainingStopped, match=r"stopping at iteration 8: 3 consecutive iterations had non-finite "
                                              r"gradients \(--max-skipped-iterations 3\); the last checkpoint "
                                              r"\(iteration 4\) is intact"):
        pretrain(cfg, on_step=poison)
    lines = [l for l in capsys.readouterr().out.splitlines() if " iteration " in l and "lm loss" in l]
    assert len(lines) == 8  # the stopping step is logged too
    assert [("number of skipped iterations:   1" in l) for l in lines] == [False] * 5 + [True] * 3
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000004", "latest_checkpointed_iteration.txt"]
    from megacoat.api import load_model
    model = load_model(str(save))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_and_stop_from_the_command_line(tmp_path):
    r = run_cli(ARGS + ["--train-iters", "5", "--lr", "1e30", "--min-lr", "1e30", "--lr-warmup-iters", "0",
                        "--clip-grad", "0", "--max-skipped-iterations", "2"])
    assert r.returncode == 1, r.stderr[-3000:]
    assert "consecutive iterations had non-finite gradients (--max-skipped-iterations 2)" in r.stderr
    assert "Traceback" not in r.stderr


HOOK = r"""
import os, signal, sys, time
from megacoat.config import parse_args
from megacoat.training.trainer import pretrain

action, at = sys.argv[1], int(sys.argv[2])

def on_step(trainer, rec):
    if trainer.ctx.rank == 0 and trainer.state.iteration == at:
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)         # the node dies
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)         # the rank hangs (stuck driver, frozen node)
        elif action == "term":
            os.killpg(os.getpgid(0), signal.SIGTERM)     # SLURM signals every process of the task

pretrain(parse_args(sys.argv[3:]), on_step=on_step)
"""


def _tasks(tmp_path, action, at, args, world=2):
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(_env(), RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), action, str(at)] + ARGS + list(args), env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return procs


@pytest.mark.parametrize("action", ["kill", "stop"])
@pytest.mark.slow
def test_a_dead_or_stuck_rank_makes_the_others_exit(tmp_path, action):
    """Rank 0 is SIGKILLed (or frozen with SIGSTOP) after step 2 with no launcher watching: rank 1
    must exit non-zero within --distributed-timeout-minutes (0.1 = 6 s), not hang."""
    procs = _tasks(tmp_path, action, 2, ["--train-iters", "50", "--distributed-timeout-minutes", "0.1"])
    try:
        t0 = time.time()
        out, err = procs[1].communicate(timeout=90)
        took = time.time() - t0
        assert procs[1].returncode not in (0, None), err[-3000:]
        assert took < 40, took
        assert "iteration        2/" in out  # it did train before the failure
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def _losses(path):
    return {x["iteration"]: x["lm_loss"] for x in map(json.loads, open(path)) if "lm_loss" in x}


@pytest.mark.slow
def test_sigterm_saves_at_the_next_boundary_and_resume_is_exact(tmp_path):
    """DP=2 tasks; SIGTERM reaches rank 0's process group (main process and DataLoader workers) after
    step 3: both ranks save at the same boundary and exit 0; resuming to 8 steps gives exactly the
    losses of an uninterrupted run."""
    save = tmp_path / "ckpt"
    common = ["--train-iters", "8", "--num-workers", "1", "--exit-signal-handler"]
    procs = _tasks(tmp_path, "term", 3, common + ["--save", str(save), "--log-json", str(tmp_path / "a.jsonl")])
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert saved in (3, 4)  # the boundary after the signal (rank 1 may be one step ahead when it arrives)
    assert f"exiting at iteration {saved}: received signal {int(signal.SIGTERM)}" in outs[1][0]
    r = run_cli(ARGS + common + ["--save", str(save), "--load", str(save), "--log-json", str(tmp_path / "a.jsonl")],
                nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = run_cli(ARGS + common + ["--log-json", str(tmp_path / "ref.jsonl")], nproc=2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "ref.jsonl")
    assert sorted(got) == list(range(1, 9))
    assert got == want  # bit-exact continuation


def _launch_and_signal(tmp_path, cmd, signal_target, at=3):
    """Start `cmd` as its own process group, wait for iteration `at` in its output, then SIGTERM
    `signal_target(proc)` from outside (as SLURM or an operator does); returns (returncode, output)."""
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        p = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while f"iteration {at:8d}/" not in out_path.read_text():
            assert time.time() < deadline and p.poll() is None, out_path.read_text()[-3000:]
            time.sleep(0.05)
        signal_target(p)
        p.wait(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out_path.read_text()


PREEMPT = ARGS[:-2] + ["--num-workers", "2", "--train-iters", "200", "--exit-signal-handler"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_to_the_process_group_with_loader_workers_saves_and_resumes_exactly(tmp_path, nproc):
    """SIGTERM from outside to every process of the job (trainer ranks and their DataLoader
    workers; under torchrun the agent forwards it to each rank's process group): every rank saves
    at one iteration boundary and exits 0; the resumed run's losses equal an uninterrupted run's."""
    save = tmp_path / "ckpt"
    args = PREEMPT + ["--save", str(save), "--log-json", str(tmp_path / "a.jsonl")]
    if nproc == 1:
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + args
        target = lambda p: os.killpg(p.pid, signal.SIGTERM)  # noqa: E731
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + args
        target = lambda p: p.send_signal(signal.SIGTERM)  # noqa: E731  torchrun forwards it to the ranks
    code, text = _launch_and_signal(tmp_path, cmd, target)
    assert "DataLoader worker" not in text, text[-3000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 200, text[-3000:]
    assert (save / f"iter_{saved:07d}" / "metadata.json").is_file()
    assert text.count(f"exiting at iteration {saved}: received signal {int(signal.SIGTERM)}") == 1, text[-3000:]
    if nproc == 1:
        assert code == 0, text[-3000:]
    else:  # torchrun itself reports the signal it got; each rank's own exit code is in its summary
        assert "exitcode  : 1" not in text and "ChildFailedError" not in text, text[-3000:]
    r = run_cli(PREEMPT + ["--save", str(save), "--load", str(save), "--log-json", str(tmp_path / "a.jsonl")],
                nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = run_cli(PREEMPT + ["--log-json", str(tmp_path / "ref.jsonl")], nproc=nproc)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "ref.jsonl")
    assert sorted(got) == list(range(1, 201))
    assert got == want  # bit-exact continuation


def _agree_on_signal(rank, world):
    import torch.distributed as dist
    from megacoat.training.faults import ExitSignalHandler
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real(group)  # as on GPUs
    try:
        h = ExitSignalHandler(torch.device("cpu"), timeout_minutes=0.5)
    finally:
        dist.get_backend = real
    assert h.group is not None and real(h.group) == "gloo"  # the per-step check stays on the host
    assert h.requested() is False
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on
    assert h.requested() is True  # every rank learns it at the same boundary
    h.restore()


@pytest.mark.slow
def test_signal_agreement_runs_over_a_host_group():
    from dist_utils import run_distributed
    run_distributed(_agree_on_signal, 2)
