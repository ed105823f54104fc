"""Launching: `srun python pretrain_gpt.py` without torchrun forms one job from SLURM's variables
(or refuses with a message); a rank that fails alone makes the job fail fast instead of hanging."""
import os
import subprocess
import sys
import time

import pytest

from megacoat.parallel.launch_env import (LaunchEnv, LaunchError, first_slurm_host, read_launch_env,
                                          slurm_tasks_on_node, torchrun_env_from_slurm)
from test_cli import ROOT, TINY, _env, _free_port

ARGS = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0"]


@pytest.mark.parametrize("nodelist,first", [("node7", "node7"), ("gpu[07-09,12],cpu3", "gpu07"),
                                            ("n[001-002]-ib,m1", "n001-ib"), ("a1,b[2-3]", "a1"),
                                            ("rack[3,5-6]", "rack3")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_tasks_per_node():
    assert [slurm_tasks_on_node("4(x2),3", n) for n in range(3)] == [4, 4, 3]
    assert slurm_tasks_on_node("8", 0) == 8


SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


def test_srun_task_gets_torchrun_variables():
    got = torchrun_env_from_slurm(SRUN)
    assert got == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123456 % 20000)}
    got = torchrun_env_from_slurm(dict(SRUN, SLURM_LAUNCH_NODE_IPADDR="10.0.0.7", MASTER_PORT="4321"))
    assert got["MASTER_ADDR"] == "10.0.0.7" and got["MASTER_PORT"] == "4321"


@pytest.mark.parametrize("env", [
    dict(SRUN, RANK="0", WORLD_SIZE="8"),                                      # torchrun inside srun
    {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")},  # sbatch script
    dict(SRUN, SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1"),                   # one task
    {},
])
def test_not_an_srun_multi_task_launch(env):
    assert torchrun_env_from_slurm(env) == {}


def test_srun_without_a_way_to_find_the_others_is_refused():
    env = {k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(LaunchError, match="srun torchrun"):
        torchrun_env_from_slurm(env)


def test_launch_env_from_torchrun_srun_or_nothing():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
                "MASTER_PORT": "29400"}
    assert read_launch_env(torchrun) == LaunchEnv(3, 8, 1, 2, "node0", 29400, "torchrun")
    assert read_launch_env(torchrun).init_method == "tcp://node0:29400"
    assert read_launch_env(dict(torchrun, MASTER_ADDR="fe80::1")).init_method == "tcp://[fe80::1]:29400"
    srun = dict(SRUN)
    got = read_launch_env(srun)
    assert got == LaunchEnv(5, 8, 1, 4, "gpu07", 20000 + 123456 % 20000, "srun") and got.distributed
    assert srun == SRUN  # read, never written
    assert read_launch_env({}) == LaunchEnv() and not LaunchEnv().distributed


@pytest.mark.parametrize("env,problem", [
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "outside WORLD_SIZE=2"),
    ({"RANK": "one", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "RANK='one' is not an integer"),
])
def test_an_incomplete_launch_env_is_refused_with_a_message(env, problem):
    with pytest.raises(LaunchError, match=problem):
        read_launch_env(env)


def _srun_task(rank, world, port, extra_env=None, args=()):
    env = dict(_env(), SLURM_PROCID=str(rank), SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(world),
               SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE=str(world), SLURM_JOB_NODELIST="localhost",
               SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + ARGS + list(args),
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_srun_python_forms_one_job(tmp_path):
    """Two tasks as srun starts them: one DP=2 job, one log, one checkpoint (not two trainings)."""
    port = _free_port()
    save = str(tmp_path / "ckpt")
    procs = [_srun_task(r, 2, port, args=["--train-iters", "2", "--save", save]) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "> world size 2: TP 1 x PP 1 x DP 2" in outs[1][0]  # the last rank prints the log
    assert "iteration" not in outs[0][0]
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_srun_refusal_is_a_message(tmp_path):
    p = _srun_task(0, 2, _free_port(), extra_env={"SLURM_LAUNCH_NODE_IPADDR": "", "SLURM_JOB_NODELIST": ""},
                   args=["--train-iters", "1"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "srun torchrun" in err and "Traceback" not in err, err[-2000:]


FAIL_ALONE = r"""
import sys
from megacoat.config import parse_args
from megacoat.training.trainer import pretrain

def on_step(trainer, rec):
    if trainer.ctx.rank == 1 and trainer.state.iteration == 2:
        raise RuntimeError("rank 1 fails alone (e.g. out of memory)")

pretrain(parse_args(sys.argv[1:]), on_step=on_step)
"""


@pytest.mark.slow
def test_a_rank_failing_alone_fails_the_job_fast(tmp_path):
    """Rank 1 raises after step 2 while rank 0 goes on into step 3's collectives: the job must end
    with an error well before the (1 minute) collective timeout, not wait in close()'s barrier."""
    script = tmp_path / "fail_alone.py"
    script.write_text(FAIL_ALONE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(script)] + ARGS + ["--train-iters", "6", "--distributed-timeout-minutes", "1"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=_env(), cwd=ROOT)
    assert r.returncode != 0
    assert "rank 1 fails alone" in r.stderr
    assert time.time() - t0 < 45


@pytest.mark.slow
def test_ranks_per_node_splitting_a_dp_group_unevenly():
    """3 ranks as nodes of 2 (--ranks-per-node 2): the DP group [0, 1, 2] has 2 ranks on one node and 1 on the
    other. Plain ZeRO trains (it uses the whole DP group); SDP4Bit, whose two-level groups need the same number of
    ranks on every node, is refused by every rank with the one-line configuration error, no rank with a
    traceback."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
            str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + TINY + \
        ["--global-batch-size", "6", "--train-iters", "2", "--ranks-per-node", "2", "--use-distributed-optimizer"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert r.returncode == 0 and " iteration        2/       2 |" in r.stdout, r.stderr[-3000:]
    base[base.index("--master-port") + 1] = str(_free_port())
    r = subprocess.run(base + ["--quantized-gradients"], capture_output=True, text=True, timeout=120, env=_env(),
                       cwd=ROOT)
    assert r.returncode != 0
    assert "pretrain_gpt.py: error: DP group [0, 1, 2] is spread unevenly over nodes of 2 ranks (--ranks-per-node" \
        in r.stderr, r.stderr[-3000:]
    assert "[rank0]: Traceback" not in r.stderr and "exitcode: 2" in r.stderr, r.stderr[-3000:]