"""scripts/slurm/ against fake `sbatch`, `srun` and `scontrol` executables on PATH.

The fakes behave like SLURM on one host: sbatch reads the #SBATCH lines and runs the script with
a job's environment; scontrol expands the node list; srun starts the job step's tasks with SLURM's
per-task variables. Every call is recorded, so the tests check the commands and environment the
scripts produce; with a real python the step runs a real 2-node training on CPU.
"""
import json
import os
import stat
import subprocess
import sys

import pytest

from megacoat.config import parse_args, validate_config
from test_cli import ROOT, _env, _free_port

SLURM_DIR = os.path.join(ROOT, "scripts", "slurm")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "301",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-interval", "0", "--eval-iters", "0",
        "--log-interval", "1", "--make-vocab-size-divisible-by", "8", "--fp32", "--num-workers", "0"]

FAKE_SBATCH = r'''
import os, re, subprocess, sys, json
args = sys.argv[1:]
nodes = None
while args and args[0].startswith("--"):           # sbatch options before the script
    opt = args.pop(0)
    if opt.startswith("--nodes"):
        nodes = opt.split("=", 1)[1] if "=" in opt else args.pop(0)
script, rest = args[0], args[1:]
for line in open(script):
    m = re.match(r"#SBATCH\s+--nodes[= ](\d+)", line)
    if m and nodes is None:
        nodes = m.group(1)
nodes = int(nodes or 1)
hosts = os.environ["FAKE_HOSTS"].split()[:nodes]
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
           SLURM_JOB_NODELIST=os.environ.get("FAKE_NODELIST", ",".join(hosts)), SLURM_SUBMIT_DIR=os.getcwd())
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "sbatch", "argv": sys.argv[1:]}) + "\n")
sys.exit(subprocess.call(["bash", script] + rest, env=env))
'''

FAKE_SCONTROL = r'''
import os, sys, json
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "scontrol", "argv": sys.argv[1:]}) + "\n")
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(sys.argv[3].split(",")))  # plain comma lists only
'''

FAKE_SRUN = r'''
import os, subprocess, sys, json
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    opt = args.pop(0)
    if "=" in opt:
        k, v = opt.split("=", 1)
    else:
        k, v = opt, args.pop(0)
    opts[k] = v
nodes, per_node = int(opts.get("--nodes", 1)), int(opts.get("--ntasks-per-node", 1))
keep = ("MASTER_ADDR", "MASTER_PORT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR",
        "PYTHONPATH")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "srun", "opts": opts, "argv": args,
                        "env": {k: os.environ.get(k) for k in keep}}) + "\n")
procs = []
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_LOCALID=str(local),
                   SLURM_PROCID=str(node * per_node + local), SLURM_STEP_ID="0",
                   SLURM_NTASKS=str(nodes * per_node), SLURM_STEP_NUM_TASKS=str(nodes * per_node),
                   SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})", SLURM_NTASKS_PER_NODE=str(per_node))
        procs.append(subprocess.Popen(args, env=env))
codes = [p.wait() for p in procs]
sys.exit(max(codes, key=abs))
'''

# Stands in for python inside the job step: records what it was asked to run, runs nothing.
FAKE_PYTHON = r'''
import os, sys, json
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "python", "argv": sys.argv[1:],
                        "env": {k: os.environ.get(k) for k in ("SLURM_NODEID", "SLURM_PROCID", "MASTER_ADDR")}}) + "\n")
'''


def _exe(path, body):
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "sbatch", FAKE_SBATCH)
    _exe(bin_dir / "scontrol", FAKE_SCONTROL)
    _exe(bin_dir / "srun", FAKE_SRUN)
    _exe(bin_dir / "fake_python", FAKE_PYTHON)
    log = tmp_path / "calls.jsonl"
    env = _env()
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), MEGACOAT_ROOT=ROOT,
               MEGACOAT_LOCAL_DIR=str(tmp_path / "local"))

    def run(script, args, timeout=240, sbatch_opts=(), **extra):
        e = dict(env, **extra)
        r = subprocess.run(["sbatch"] + list(sbatch_opts) + [os.path.join(SLURM_DIR, script)] + list(args), env=e, cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=timeout)
        calls = [json.loads(line) for line in open(log)] if log.exists() else []
        return r, calls

    run.bin_dir, run.tmp = bin_dir, tmp_path
    return run


@pytest.mark.slow
def test_torchrun_per_node_real_two_node_run(fake_slurm):
    """2 "nodes" on this host, one torchrun each: one DP=2 job over gloo, rendezvous on the first host."""
    port = _free_port()
    save = fake_slurm.tmp / "ckpt"
    r, calls = fake_slurm("train.sbatch", TINY + ["--train-iters", "2", "--save", str(save)],
                          FAKE_HOSTS="localhost otherhost", FAKE_NODELIST="localhost,otherhost",
                          MEGACOAT_PORT=str(port), GPUS_PER_NODE="1", MEGACOAT_PYTHON=sys.executable)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    scontrol = [c for c in calls if c["cmd"] == "scontrol"]
    assert scontrol == [{"cmd": "scontrol", "argv": ["show", "hostnames", "localhost,otherhost"]}]
    (srun,) = [c for c in calls if c["cmd"] == "srun"]
    assert srun["opts"]["--nodes"] == "2" and srun["opts"]["--ntasks-per-node"] == "1"
    assert srun["opts"]["--kill-on-bad-exit"] == "1"
    assert srun["env"]["MASTER_ADDR"] == "localhost" and srun["env"]["MASTER_PORT"] == str(port)
    local = fake_slurm.tmp / "local" / "megacoat-4242"
    assert srun["env"]["TRITON_CACHE_DIR"] == str(local / "triton")
    assert srun["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(local / "inductor")
    assert srun["env"]["TORCH_EXTENSIONS_DIR"] == str(local / "torch_extensions")
    assert all((local / d).is_dir() for d in ("triton", "inductor", "torch_extensions"))  # made by each node
    cmd = " ".join(srun["argv"])
    assert "-m torch.distributed.run" in cmd and '--node-rank "$SLURM_NODEID"' in cmd
    assert "> world size 2: TP 1 x PP 1 x DP 2 (ranks per node 1)" in r.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.slow
def test_srun_one_task_per_gpu_real_run(fake_slurm):
    port = _free_port()
    r, calls = fake_slurm("train.sbatch", TINY + ["--train-iters", "1"], sbatch_opts=["--nodes", "1"],
                          FAKE_HOSTS="localhost", MEGACOAT_PORT=str(port), GPUS_PER_NODE="2",
                          MEGACOAT_LAUNCHER="srun", MEGACOAT_PYTHON=sys.executable)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (srun,) = [c for c in calls if c["cmd"] == "srun"]
    assert srun["opts"]["--ntasks-per-node"] == "2" and srun["opts"]["--nodes"] == "1"
    assert "torch.distributed.run" not in " ".join(srun["argv"])
    assert "> world size 2: TP 1 x PP 1 x DP 2 (ranks per node 2)" in r.stdout


@pytest.mark.parametrize("script,nodes,world", [("pretrain_1b.sbatch", 2, 16), ("pretrain_7b.sbatch", 4, 32)])
def test_example_scripts_launch_valid_runs(fake_slurm, script, nodes, world):
    """The 1B/7B examples: one torchrun per node with the right node ranks, and flags that form a
    valid configuration for the allocation's world size (checked as the run would check them)."""
    hosts = " ".join(f"gpu{i:02d}" for i in range(8))
    r, calls = fake_slurm(script, ["--seed", "7"], FAKE_HOSTS=hosts, MEGACOAT_PYTHON=str(fake_slurm.bin_dir / "fake_python"),
                          CKPT=str(fake_slurm.tmp / "ck"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (srun,) = [c for c in calls if c["cmd"] == "srun"]
    assert srun["opts"]["--nodes"] == str(nodes) and srun["env"]["MASTER_ADDR"] == "gpu00"
    runs = sorted((c for c in calls if c["cmd"] == "python"), key=lambda c: int(c["env"]["SLURM_NODEID"]))
    assert len(runs) == nodes
    for node, c in enumerate(runs):
        a = c["argv"]
        assert a[:2] == ["-m", "torch.distributed.run"]
        assert a[a.index("--nnodes") + 1] == str(nodes) and a[a.index("--node-rank") + 1] == str(node)
        assert a[a.index("--nproc-per-node") + 1] == "8"
        assert a[a.index("--master-addr") + 1] == "gpu00" and a[a.index("--master-port") + 1] == "29500"
    flags = runs[0]["argv"][runs[0]["argv"].index(os.path.join(ROOT, "pretrain_gpt.py")) + 1:]
    assert flags[-2:] == ["--seed", "7"]  # extra flags are appended
    cfg = parse_args(flags)
    validate_config(cfg, world)
    assert cfg.checkpoint.save == cfg.checkpoint.load and cfg.train.exit_signal_handler


def test_outside_a_job_is_a_message(tmp_path):
    r = subprocess.run(["bash", os.path.join(SLURM_DIR, "train.sbatch")], env=dict(_env(), MEGACOAT_ROOT=ROOT),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not inside a SLURM job" in r.stderr
