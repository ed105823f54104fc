"""Megatron flags: activation recomputation (identical gradients), sample-based schedule
(--train-samples, --lr-warmup-samples / --lr-decay-samples, --lr-warmup-fraction,
--rampup-batch-size) against hand-computed values, checkpoint retention (--save-retain)."""
import json
import math
import os

import pytest
import torch

from megacoat.config import ConfigError, parse_args, validate_config
from dist_utils import run_distributed
from test_cli import TINY, run_cli

BASE = TINY + ["--fp32", "--num-workers", "0"]


def _records(path):
    return [json.loads(x) for x in open(path) if "lm_loss" in x]


def _cosine(step_units, warmup, decay, lr=1e-3, min_lr=1e-4):
    """Hand-written schedule: linear warmup, cosine decay to min_lr."""
    if warmup > 0 and step_units <= warmup:
        return lr * step_units / warmup
    if step_units > decay:
        return min_lr
    ratio = (step_units - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def test_train_samples_with_warmup_and_decay_samples(tmp_path):
    log = tmp_path / "log.jsonl"
    r = run_cli(BASE + ["--global-batch-size", "4", "--train-samples", "42", "--lr-warmup-samples", "10",
                        "--lr-decay-samples", "36", "--lr", "1e-3", "--min-lr", "1e-4", "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(log)
    assert [x["iteration"] for x in recs] == list(range(1, 11))  # 42 // 4 = 10 steps
    assert [x["consumed_samples"] for x in recs] == [4 * k for k in range(1, 11)]
    for x in recs:  # step k has consumed 4k samples: lr of the schedule at 4k samples
        assert x["lr"] == pytest.approx(_cosine(x["consumed_samples"], 10, 36), rel=1e-12, abs=0)
    assert recs[0]["lr"] == pytest.approx(0.4e-3) and recs[-1]["lr"] == 1e-4  # 40 > 36: decayed


def test_warmup_fraction_in_iterations(tmp_path):
    log = tmp_path / "log.jsonl"
    r = run_cli(BASE + ["--global-batch-size", "2", "--train-iters", "8", "--lr-warmup-fraction", "0.25",
                        "--lr-decay-style", "linear", "--lr", "1e-3", "--min-lr", "1e-4", "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-3000:]
    got = [x["lr"] for x in _records(log)]
    # warmup = 0.25 x 8 = 2 iterations; then linear from 1e-3 to 1e-4 over iterations 2..8.
    want = [0.5e-3, 1e-3] + [1e-4 + (1 - (k - 2) / 6) * 0.9e-3 for k in range(3, 9)]
    assert got == pytest.approx(want, rel=1e-12)


def test_rampup_batch_size(tmp_path):
    """Ramp 2 -> 8 by 2 over 12 samples (one increment per 4 samples) with micro-batch 2."""
    log = tmp_path / "log.jsonl"
    r = run_cli(BASE + ["--global-batch-size", "8", "--train-samples", "30", "--rampup-batch-size", "2", "2", "12",
                        "--lr-warmup-samples", "0", "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(log)
    # consumed 0 -> 2 (gbs 2), 2 -> 4 (2), 4 -> 8 (4), 8 -> 14 (6), 14 -> 22 (8), 22 -> 30 (8)
    assert [x["consumed_samples"] for x in recs] == [2, 4, 8, 14, 22, 30]
    lines = [l for l in r.stdout.splitlines() if "lm loss" in l]
    assert [int(l.split("global batch size:")[1].split("|")[0]) for l in lines] == [2, 2, 4, 6, 8, 8]
    for x in recs:
        assert x["lr"] == pytest.approx(_cosine(x["consumed_samples"], 0, 30), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [3, 4])  # after 8 consumed samples (a whole final batch), after 14 (not one)
def test_rampup_resume_is_exact(tmp_path, stop):
    flags = BASE + ["--global-batch-size", "8", "--train-samples", "30", "--rampup-batch-size", "2", "2", "12"]
    ckpt = tmp_path / "ckpt"
    a = run_cli(flags + ["--save", str(ckpt), "--exit-interval", str(stop), "--log-json", str(tmp_path / "a.jsonl")])
    assert a.returncode == 0, a.stderr[-2000:]
    b = run_cli(flags + ["--load", str(ckpt), "--save", str(ckpt), "--log-json", str(tmp_path / "a.jsonl")])
    assert b.returncode == 0, b.stderr[-2000:]
    ref = run_cli(flags + ["--log-json", str(tmp_path / "ref.jsonl")])
    got = [(x["consumed_samples"], x["lm_loss"], x["lr"]) for x in _records(tmp_path / "a.jsonl")]
    want = [(x["consumed_samples"], x["lm_loss"], x["lr"]) for x in _records(tmp_path / "ref.jsonl")]
    assert got == want and len(got) == 6


@pytest.mark.slow
@pytest.mark.parametrize("resumed_gbs", [4, 16])
def test_train_samples_resumed_with_another_global_batch_trains_the_remaining_samples(tmp_path, resumed_gbs):
    """--train-samples counts samples: a run resumed with another --global-batch-size stops where the samples
    run out, not after the number of steps its batch size would take from scratch (too many, or none at all)."""
    flags = BASE + ["--train-samples", "48"]
    ckpt = tmp_path / "ckpt"
    a = run_cli(flags + ["--global-batch-size", "8", "--save", str(ckpt), "--exit-interval", "2"])
    assert a.returncode == 0, a.stderr[-2000:]
    log = tmp_path / "b.jsonl"
    b = run_cli(flags + ["--global-batch-size", str(resumed_gbs), "--load", str(ckpt), "--save", str(ckpt),
                         "--log-json", str(log)])
    assert b.returncode == 0, b.stderr[-2000:]
    # 16 samples consumed by the first run; the remaining 32 in whole steps of the new batch
    want = list(range(16 + resumed_gbs, 49, resumed_gbs))
    assert [x["consumed_samples"] for x in _records(log)] == want
    assert [x["iteration"] for x in _records(log)] == list(range(3, 3 + len(want)))


@pytest.mark.parametrize("flags,message", [
    (["--lr-warmup-samples", "5"], "needs --train-samples"),
    (["--rampup-batch-size", "2", "2", "10"], "needs --train-samples"),
    (["--train-samples", "40", "--rampup-batch-size", "3", "5", "10"], "multiples of --micro-batch-size x DP"),
    (["--train-samples", "40", "--rampup-batch-size", "2", "4", "10"], "a multiple of INCREMENT"),
    (["--train-samples", "3"], "less than one global batch"),
    (["--recompute-method", "block"], "need --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"], "must be >= 1"),
    (["--save-retain", "0"], "--save-retain must be >= 1"),
    (["--lr-warmup-fraction", "1.5"], "must be in [0, 1]"),
    (["--adam-beta2", "1.0"], "--adam-beta2 1.0 must be >= 0 and < 1"),
    (["--adam-beta2", "0.99999999"], "--adam-beta2 0.99999999 must be >= 0 and < 1 in fp32"),
    (["--adam-beta1", "-0.1"], "--adam-beta1 -0.1 must be >= 0 and < 1"),
])
def test_bad_schedule_flags(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_config(parse_args(BASE + ["--global-batch-size", "8"] + flags), 1)


def _visible(path) -> list:
    """The directory's checkpoints and tracker (hidden files, such as the save directory's lock, left out)."""
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


@pytest.mark.slow
def test_save_retain_keeps_the_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = run_cli(BASE + ["--global-batch-size", "2", "--train-iters", "7", "--save", str(ckpt), "--save-interval", "2",
                        "--save-retain", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _visible(ckpt) == ["iter_0000006", "iter_0000007", "latest_checkpointed_iteration.txt"]
    assert "--save-retain 2: removed checkpoint(s) of iteration 2" in r.stdout
    # and a resume from the retained newest works
    r = run_cli(BASE + ["--global-batch-size", "2", "--train-iters", "8", "--load", str(ckpt), "--save", str(ckpt),
                        "--save-retain", "2", "--override-opt_param-scheduler"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _visible(ckpt) == ["iter_0000007", "iter_0000008", "latest_checkpointed_iteration.txt"]


# ------------------------------------------------------------------------------ recomputation
RECOMPUTE = {
    "full-uniform-2": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    "full-uniform-1": ["--recompute-granularity", "full"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
}


def _grads_and_forward_counts(flags, world):
    """Gradients of one step (2 micro-batches, dropout on) and how often each layer ran forward."""
    from megacoat.training.trainer import Trainer
    tr = Trainer(parse_args(flags))
    counts = {}

    def counting(fn, key):
        def run(*a, **k):
            counts[key] = counts.get(key, 0) + 1
            return fn(*a, **k)
        return run

    # (A recomputed layer's own forward hook may not fire: torch stops the recomputation once the
    # tensors backward needs exist, before the layer returns. Its attention runs to the end.)
    for name, mod in tr.model.named_modules():
        if name.endswith("attention"):
            mod.register_forward_hook(lambda m, i, o, n=name: counts.__setitem__(n, counts.get(n, 0) + 1))
            mod._core = counting(mod._core, name + "._core")
    tr.optimizer.zero_grad()
    it = tr.data_iterators().train
    loss = tr.forward_backward(tr._next_micro_batches(it))
    grads = {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}
    return loss.item(), grads, counts


def _compare_recompute(rank, world, tp_flags):
    flags = TINY[:] + ["--fp32", "--num-workers", "0", "--num-layers", "3", "--global-batch-size", str(4 * world // (2 if tp_flags else 1)),
                       "--attention-dropout", "0.2", "--hidden-dropout", "0.2"] + tp_flags
    # later flags win: the dropout above replaces TINY's zeros
    ref_loss, ref, ref_counts = _grads_and_forward_counts(flags, world)
    assert ref_counts["layers.0.attention"] == 2  # two micro-batches, one forward each
    for name, extra in RECOMPUTE.items():
        loss, got, counts = _grads_and_forward_counts(flags + extra, world)
        assert loss == ref_loss, name
        for n in ref:
            assert torch.equal(got[n], ref[n]), (name, n)
        attn = [counts[f"layers.{i}.attention"] for i in range(3)]
        core = [counts[f"layers.{i}.attention._core"] for i in range(3)]
        if name == "selective":  # the attention core alone runs again
            assert attn == [2, 2, 2] and core == [4, 4, 4], (attn, core)
        elif name == "full-block-1":
            assert attn == [4, 2, 2], attn  # only the first layer re-runs
        else:
            assert attn == [4, 4, 4], attn


def test_recompute_gives_identical_gradients_single():
    _compare_recompute(0, 1, [])


@pytest.mark.slow
def test_recompute_gives_identical_gradients_tp2_sp():
    run_distributed(_compare_recompute, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])


@pytest.mark.slow
def test_rampup_with_interleaved_pipeline(tmp_path):
    flags = BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8", "--train-samples", "24"]
    with pytest.raises(ConfigError, match="START and INCREMENT must be multiples of 4"):
        validate_config(parse_args(flags + ["--rampup-batch-size", "2", "2", "8"]), 2)
    log = tmp_path / "log.jsonl"
    r = run_cli(flags + ["--rampup-batch-size", "4", "4", "8", "--log-json", str(log)], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    # ramp 4 -> 8 by 4 over 8 samples: 0 -> 4 (4), 4 -> 8 (4), 8 -> 16 (8), 16 -> 24 (8)
    assert [x["consumed_samples"] for x in _records(log)] == [4, 8, 16, 24]


def test_recompute_under_coat_fp8_gives_identical_gradients():
    """COAT layers (FP8 GEMMs, FP8 saved activations, emulated on CPU) recompute to the same bits."""
    flags = TINY[:] + ["--bf16", "--num-workers", "0", "--num-layers", "2", "--global-batch-size", "4",
                       "--fp8-format", "hybrid", "--fp8-recipe", "coat", "--attention-dropout", "0.1",
                       "--hidden-dropout", "0.1"]
    ref_loss, ref, _ = _grads_and_forward_counts(flags, 1)
    for name in ("full-uniform-1", "selective"):
        loss, got, counts = _grads_and_forward_counts(flags + RECOMPUTE[name], 1)
        assert loss == ref_loss and all(torch.equal(got[n], ref[n]) for n in ref), name
        assert counts["layers.0.attention._core"] == 4, counts


def test_cross_entropy_loss_fusion_flag():
    """Megatron's --cross-entropy-loss-fusion is accepted; here it is on by default (None: where the kernels
    run) and --no-cross-entropy-loss-fusion turns it off (the GPU test compares both paths)."""
    assert parse_args([]).precision.cross_entropy_loss_fusion is None
    assert parse_args(["--cross-entropy-loss-fusion"]).precision.cross_entropy_loss_fusion is True
    assert parse_args(["--no-cross-entropy-loss-fusion"]).precision.cross_entropy_loss_fusion is False


def test_cross_entropy_loss_fusion_flag_reaches_the_model():
    from megacoat.training.trainer import Trainer
    for extra, want in (([], True), (["--no-cross-entropy-loss-fusion"], False), (["--cross-entropy-loss-fusion"], True)):
        tr = Trainer(parse_args(BASE + ["--global-batch-size", "2", "--train-iters", "1"] + extra),
                     log_stream=open(os.devnull, "w"))
        try:
            assert tr.model.lc.cross_entropy_fusion is want, extra
        finally:
            tr.close()
