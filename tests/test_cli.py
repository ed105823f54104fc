"""pretrain_gpt.py from the command line: bad layouts fail clearly; TP/DP runs equal the single run."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--mock-data", "--vocab-size", "301", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--eval-interval", "0", "--eval-iters", "0", "--log-interval", "1",
        "--make-vocab-size-divisible-by", "8", "--seed", "5"]


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    for k in [k for k in env if k.startswith("SLURM_")]:  # tests inside a SLURM job: no srun launch detection
        env.pop(k)
    return env


def run_cli(args, nproc=1, timeout=300):
    if nproc == 1:
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def _free_port():
    from dist_utils import free_port
    return free_port()


@pytest.mark.parametrize("args,nproc,expect", [
    (["--tensor-model-parallel-size", "3"], 2, "not divisible by --tensor-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "66"], 2,
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--group-query-attention", "--num-query-groups", "3"], 1, "is not divisible by --num-query-groups 3"),
    (["--global-batch-size", "3"], 1, "--global-batch-size 3 is not divisible by --micro-batch-size 2"),
    (["--bf16", "--fp32"], 1, "--bf16 and --fp32 conflict"),
    (["--fp16"], 1, "--fp16 is not supported"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"], 2,
     "needed by --sequence-parallel"),
])
def test_bad_layouts_fail_with_clear_message(args, nproc, expect):
    r = run_cli(TINY + ["--train-iters", "1"] + args, nproc=nproc)
    assert r.returncode != 0
    assert expect in r.stderr + r.stdout, r.stderr[-2000:]
    assert "Traceback" not in r.stderr or nproc > 1  # single process: a message, not a stack trace
    assert (r.stderr + r.stdout).count("pretrain_gpt.py: error:") == 1  # once, not once per rank


def test_unknown_flag_suggests_the_right_one():
    r = run_cli(["--num-layer", "2"])
    assert r.returncode == 2
    assert "did you mean --num-layers" in r.stderr


def _losses(path):
    return [json.loads(line)["lm_loss"] for line in open(path) if "lm_loss" in line]


@pytest.mark.slow
def test_cli_tp2_sp_and_dp2_equal_single(tmp_path):
    common = TINY + ["--train-iters", "4", "--global-batch-size", "4", "--fp32"]
    single = tmp_path / "single.jsonl"
    r = run_cli(common + ["--log-json", str(single)])
    assert r.returncode == 0, r.stderr[-3000:]
    for name, extra in (("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("dp2", []),
                        ("dp2zero", ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                     "--ddp-bucket-size", "5000"])):
        path = tmp_path / f"{name}.jsonl"
        r = run_cli(common + extra + ["--log-json", str(path)], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        ref, got = _losses(single), _losses(path)
        assert len(got) == len(ref) == 4
        for a, b in zip(ref, got):
            assert abs(a - b) <= 1e-5 * abs(a), (name, ref, got)


@pytest.mark.slow
def test_default_main_job_runs(tmp_path):
    """The README's main job (no data flags: the built-in corpus), shortened to a few steps."""
    r = run_cli(["--train-iters", "3", "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "1",
                 "--data-cache-path", str(tmp_path / "cache"), "--log-json", str(tmp_path / "log.jsonl")])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(tmp_path / "log.jsonl")
    assert len(losses) == 3 and all(l == l and 0 < l < 20 for l in losses)
    assert "validation loss at iteration 3" in r.stdout
    # First use: the corpus and tokenizer are built with visible progress, not in silence.
    assert "preparing the default corpus (first use)" in r.stderr, r.stderr[-2000:]
    assert "training the tokenizer" in r.stderr and "preprocess" in r.stderr  # the tokenizing progress bar
    assert "prepared the default corpus" in r.stderr


def test_exit_duration_saves_and_stops_at_a_log_iteration(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = run_cli(TINY + ["--train-iters", "10", "--log-interval", "2", "--exit-duration-in-mins", "0",
                        "--save", str(ckpt), "--log-json", str(tmp_path / "log.jsonl")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exiting at iteration 2" in r.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.parametrize("preset", [None, "max_split_size_mb:128"])
def test_entry_point_sets_expandable_segments_unless_the_user_did(preset):
    """pretrain_gpt.py sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch's allocator starts
    (fragmentation left 7.5 GiB stranded in a 7B step on the H200); a value of the user's own is kept."""
    env = {k: v for k, v in _env().items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if preset is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = preset
    code = ("import os, runpy, sys; sys.argv = ['pretrain_gpt.py']; "
            "runpy.run_path('pretrain_gpt.py', run_name='not_main'); print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == (preset or "expandable_segments:True")


def test_allocator_default_leaves_a_configured_or_started_allocator_alone(monkeypatch):
    """Neither variable set: expandable segments; either set (torch 2.9+ also reads PYTORCH_ALLOC_CONF, which the CUDA
    name would override): untouched."""
    from megacoat.training.allocator import default_cuda_allocator_settings
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    assert default_cuda_allocator_settings() and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    assert not default_cuda_allocator_settings() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_help_lists_every_flag():
    """`pretrain_gpt.py --help` prints (argparse formats help texts with %: a bare "95%" in one once broke it)."""
    import contextlib
    import io

    from megacoat.config import build_parser
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    assert "--fp8-gemm-candidates" in out.getvalue() and "95%" in out.getvalue()
