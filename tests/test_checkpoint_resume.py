"""Exact resume (N + N steps == 2N steps, bit for bit on CPU), --async-save, --finetune, and
clear errors for bad checkpoints (missing dir, empty tracker, missing/corrupted shard, other flags)."""
import io
import json
import os
import shutil

import pytest
import torch

from megacoat.checkpoint import CheckpointError
from megacoat.config import parse_args
from megacoat.training.trainer import Trainer
from test_cli import TINY, _losses, run_cli

COMMON = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0"]  # dropout 0.1 stays on


def train(args, log_stream=None):
    """Train in this process (world 1); returns the losses of the steps it ran."""
    return train_with(COMMON + args, log_stream)


def train_with(argv, log_stream=None):
    """train() with the whole command line given (no COMMON flags added)."""
    trainer = Trainer(parse_args(argv), log_stream=log_stream or open(os.devnull, "w"))
    losses = []
    trainer.train(on_step=lambda t, rec: losses.append(rec.loss))
    return losses, trainer


def test_exact_resume_single_process(tmp_path):
    ref, _ = train(["--train-iters", "6"])
    save = str(tmp_path / "ckpt")
    first, _ = train(["--train-iters", "6", "--save", save, "--exit-interval", "3"])
    second, t = train(["--train-iters", "6", "--save", save, "--load", save])
    assert first + second == ref  # bit-identical
    assert t.state.consumed_samples == 24 and t.scheduler.num_steps == 6
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "6"


STATE_FORMATS = {
    "fp8": ["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8"],
    "bf16": ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    "fp32": [],
}


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero"])
@pytest.mark.parametrize("states", sorted(STATE_FORMATS))
def test_async_save_resumes_exactly_for_every_state_format(tmp_path, states, zero):
    """--async-save snapshots every piece, per-group ones (FP8 scale/exponent/centre) included."""
    args = ["--train-iters", "6"] + STATE_FORMATS[states] + (["--use-distributed-optimizer"] if zero else [])
    ref, _ = train(args)
    save = str(tmp_path / "ckpt")
    run = args + ["--save", save, "--load", save, "--async-save", "--save-interval", "2"]
    first, _ = train(run + ["--exit-interval", "3"])
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]
    second, _ = train(run)
    assert first + second == ref  # bit-identical


def _two_process_async_resume(tmp_path, args):
    """Background saves every 2 iterations, exit at 3, resume to 6: the losses of one uninterrupted run."""
    r = run_cli(args + ["--log-json", str(tmp_path / "ref.jsonl")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    save = str(tmp_path / "ckpt")
    run = args + ["--save", save, "--load", save, "--async-save", "--save-interval", "2"]
    r = run_cli(run + ["--exit-interval", "3", "--log-json", str(tmp_path / "a.jsonl")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(save)) == [".megacoat-save.lock", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]
    r = run_cli(run + ["--log-json", str(tmp_path / "b.jsonl")], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loaded checkpoint" in r.stdout
    assert _losses(tmp_path / "a.jsonl") + _losses(tmp_path / "b.jsonl") == _losses(tmp_path / "ref.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],  # TP 2 with SP, fp32 states
    STATE_FORMATS["fp8"],  # DP 2, FP8 states
    STATE_FORMATS["fp8"] + ["--use-distributed-optimizer"],  # DP 2 ZeRO, FP8 states
], ids=["tp2-sp", "dp2-fp8", "zero2-fp8"])
def test_exact_resume_two_processes_async_save(tmp_path, layout):
    _two_process_async_resume(tmp_path, COMMON + ["--train-iters", "6"] + layout)


@pytest.mark.parametrize("states", ["fp32", "fp8"])  # torch AdamW; the precision-aware optimizer's flat masters
def test_fp32_run_resumed_from_bf16_continues_from_the_masters(tmp_path, states):
    """A bf16 run's fp32 masters hold more than its bf16 weights. An fp32 run, whose weights are their own
    masters, resumes from the checkpoint's masters, not from its weights rounded to bf16."""
    save = str(tmp_path / "ckpt")
    bf16 = [a if a != "--fp32" else "--bf16" for a in COMMON] + STATE_FORMATS[states]
    _, first = train_with(bf16 + ["--train-iters", "4", "--exit-interval", "2", "--save", save])
    masters = {r.param.global_name: r.tensors["master"].clone() for r in first.optimizer.state_ranges()}
    t = Trainer(parse_args(COMMON + STATE_FORMATS[states] + ["--train-iters", "4", "--load", save]),
                log_stream=open(os.devnull, "w"))
    for p in t.model.parameters():
        rounded = masters[p.global_name].bfloat16().float()
        assert not torch.equal(masters[p.global_name], rounded)  # the masters are not bf16 values
        assert torch.equal(p.detach().view(-1), masters[p.global_name]), p.global_name


def test_finetune_and_no_load_optim(tmp_path):
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "3", "--save", save])
    _, t = train(["--train-iters", "2", "--load", save, "--finetune"])
    assert t.state.iteration == 2 and t.state.consumed_samples == 8  # started from 0
    log = io.StringIO()
    _, t = train(["--train-iters", "4", "--load", save, "--no-load-optim"], log_stream=log)
    assert t.state.iteration == 4  # resumed at 3, fresh optimizer
    assert t.scheduler.num_steps == 1  # and a fresh schedule, which the log says
    assert "--no-load-optim: the optimizer state and the learning-rate schedule start fresh at iteration 3" \
        in log.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("bad") / "ckpt")
    train(["--train-iters", "2", "--save", save])
    return save


def _copy(saved, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(saved, dst)
    return dst


def _load_error(load_dir, extra=()):
    with pytest.raises(CheckpointError) as e:
        train(["--train-iters", "3", "--load", load_dir] + list(extra))
    return str(e.value)


def test_missing_directory(tmp_path):
    assert "does not exist" in _load_error(str(tmp_path / "nope"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert f"{afile} is a file, not a checkpoint directory" in _load_error(str(afile))


def test_empty_tracker(saved, tmp_path):
    d = _copy(saved, tmp_path)
    open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w").close()
    assert "is empty" in _load_error(d)


def test_missing_shard(saved, tmp_path):
    d = _copy(saved, tmp_path)
    os.remove(os.path.join(d, "iter_0000002", "rank_00000.bin"))
    assert "missing shard" in _load_error(d)


def test_corrupted_shard(saved, tmp_path):
    d = _copy(saved, tmp_path)
    path = os.path.join(d, "iter_0000002", "rank_00000.bin")
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "CRC32 mismatch" in _load_error(d)


def test_wrong_dtype_in_metadata(saved, tmp_path):
    d = _copy(saved, tmp_path)
    meta_path = os.path.join(d, "iter_0000002", "metadata.json")
    meta = json.load(open(meta_path))
    meta["tensors"]["model/final_norm.weight"]["pieces"][0]["dtype"] = "bfloat16"
    json.dump(meta, open(meta_path, "w"))
    assert "dtype" in _load_error(d)


def test_mismatched_num_layers_names_the_flag(saved):
    msg = _load_error(saved, ["--num-layers", "3"])
    assert "--num-layers: checkpoint 2, this run 3" in msg and "--use-checkpoint-args" in msg
    # ... and --use-checkpoint-args takes the saved architecture instead.
    _, t = train(["--train-iters", "3", "--load", saved, "--num-layers", "3", "--use-checkpoint-args",
                  "--override-opt_param-scheduler"])
    assert t.cfg.model.num_layers == 2 and t.state.iteration == 3


def test_cli_reports_checkpoint_errors_without_traceback(tmp_path):
    r = run_cli(COMMON + ["--train-iters", "1", "--load", str(tmp_path / "nope")])
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_learned_position_table_of_another_size_names_the_flag(tmp_path):
    save = str(tmp_path / "ckpt")
    learned = ["--position-embedding-type", "learned_absolute"]
    train(["--train-iters", "2", "--save", save] + learned)
    msg = _load_error(save, learned + ["--max-position-embeddings", "48"])
    assert "--max-position-embeddings: checkpoint 32, this run 48" in msg and "--use-checkpoint-args" in msg


@pytest.mark.parametrize("flag,value", [("--rotary-base", "5000"), ("--norm-epsilon", "1e-6")])
def test_flags_that_change_the_function_are_checked_on_load(saved, flag, value):
    """Same shapes, another function: loading must refuse, naming the flag (and the way out)."""
    msg = _load_error(saved, [flag, value])
    assert f"{flag}: checkpoint" in msg and "--use-checkpoint-args" in msg
