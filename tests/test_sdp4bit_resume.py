"""Exact resume under SDP4Bit (--quantized-weights --quantized-gradients --hadamard-transform):
3 + 3 steps with a checkpoint in between give bit-identical losses to 6 uninterrupted steps (CPU,
gloo, 2 ranks as 2 nodes of 1: the 4-bit inter-node level and the 4-bit weight differences). The
stochastic rounding keys on the optimizer's checkpointed iteration, not on per-process counters."""
import json

import pytest
from test_cli import TINY, _losses, run_cli

ARGS = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0", "--train-iters", "6",
               "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
               "--quantized-weights", "--wq-group-size", "64", "--quantized-gradients", "--hadamard-transform",
               "--gq-group-size-inter", "32", "--gq-group-size-intra", "32", "--ranks-per-node", "1"]


@pytest.mark.slow
def test_exact_resume_with_quantized_weights_and_gradients(tmp_path):
    ref = tmp_path / "ref.jsonl"
    r = run_cli(ARGS + ["--log-json", str(ref)], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    save = str(tmp_path / "ckpt")
    r = run_cli(ARGS + ["--save", save, "--exit-interval", "3", "--log-json", str(tmp_path / "a.jsonl")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(ARGS + ["--save", save, "--load", save, "--log-json", str(tmp_path / "b.jsonl")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loaded checkpoint" in r.stdout
    first, second, whole = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl"), _losses(ref)
    assert len(first) == 3 and len(second) == 3 and len(whole) == 6
    assert first + second == whole, (first, second, whole)  # bit-identical
    # the quantized collectives really ran: 4-bit gradients between the two "nodes", 4-bit weight deltas
    rec = [json.loads(line) for line in open(ref) if "lm_loss" in line][-1]
    comm = rec["comm_bytes_per_iter"]
    assert comm.get("grad_inter", 0) > 0 and comm.get("param", 0) > 0 and not comm.get("grad"), comm
