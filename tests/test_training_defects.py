"""The training loop's bookkeeping defects, fixed and kept fixed: skip counters in checkpoints, no per-step
records kept, --log-json and validation after a resume, --log-interval 0, the exit-duration clock."""
import gc
import json
import os
import time

import pytest
import torch

from megacoat.checkpoint import CheckpointReader, resolve_checkpoint_dir
from megacoat.config import ConfigError, parse_args
from megacoat.training.trainer import StepRecord, Trainer, process_start_time
from test_cli import TINY

COMMON = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0"]


def make_trainer(args):
    return Trainer(parse_args(COMMON + args), log_stream=open(os.devnull, "w"))


def poison_gradients(trainer, values):
    """Before the optimizer step of iteration i (1-based), set one gradient element to values[i]."""
    forward_backward = trainer.forward_backward
    # The poison is written after the backward; the overlapped norm reads gradients during it.
    trainer.optimizer.norm_overlap = None

    def poisoned(micro_batches):
        loss = forward_backward(micro_batches)
        value = values.get(trainer.state.iteration + 1)
        if value is not None:
            next(trainer.model.parameters()).main_grad.view(-1)[0] = value
        return loss

    trainer.forward_backward = poisoned


def saved_train_state(save, iteration):
    reader = CheckpointReader(os.path.join(save, f"iter_{iteration:07d}"))
    try:
        return reader.common()["train_state"]
    finally:
        reader.close()


@pytest.mark.parametrize("when", ["save_interval", "exit_interval"])
def test_checkpoint_counts_skipped_and_nan_steps_not_yet_logged(tmp_path, when):
    """Steps 1 (Inf) and 2 (NaN) are skipped; the save at 3 comes before any log line (interval 5)."""
    save = str(tmp_path / "ckpt")
    extra = ["--save-interval", "3"] if when == "save_interval" else ["--exit-interval", "3"]
    t = make_trainer(["--train-iters", "4", "--log-interval", "5", "--save", save] + extra)
    poison_gradients(t, {1: float("inf"), 2: float("nan")})
    t.train()
    st = saved_train_state(save, 3)
    assert (st["skipped_iters"], st["nan_iters"]) == (2, 1)
    if when == "save_interval":  # the final save (iteration 4) counts the same, and so does the state
        assert saved_train_state(save, 4)["skipped_iters"] == 2
        t.state.resolve_counters()
        assert (t.state.skipped_iters, t.state.nan_iters) == (2, 1)


def test_skipped_steps_in_the_log_line(tmp_path):
    log = tmp_path / "log.jsonl"
    t = make_trainer(["--train-iters", "4", "--log-interval", "2", "--log-json", str(log)])
    poison_gradients(t, {1: float("inf"), 3: float("nan"), 4: float("nan")})
    t.train()
    records = [json.loads(line) for line in open(log)]
    assert [(r["iteration"], r["skipped"], r["nan"]) for r in records] == [(2, 1, 0), (4, 2, 2)]
    assert records[0]["lm_loss"] == records[0]["lm_loss"]  # the loss of step 2 (not skipped)
    assert records[1]["lm_loss"] != records[1]["lm_loss"]  # every step skipped: no loss to report (NaN)


def test_trainer_keeps_no_per_step_records():
    t = make_trainer(["--train-iters", "8", "--log-interval", "100"])
    alive = []

    def count_records(trainer, rec):
        if trainer.state.iteration == 8:
            gc.collect()
            alive.append(sum(type(o) is StepRecord for o in gc.get_objects()))

    t.train(on_step=count_records)
    assert alive == [1]  # only the record of the step being reported


def test_log_interval_zero_is_refused_with_a_message():
    with pytest.raises(ConfigError, match="--log-interval 0 must be >= 1"):
        make_trainer(["--train-iters", "2", "--log-interval", "0"])


class Stop(Exception):
    pass


def _stop_after(iteration):
    def on_step(trainer, rec):
        if trainer.state.iteration == iteration:
            raise Stop()
    return on_step


def _json(path):
    return [json.loads(line) for line in open(path)]


def test_log_json_has_each_iteration_once_after_a_resume(tmp_path):
    """A run saves at 2, logs 3, then dies; the resumed run redoes 3: its record replaces the old one."""
    ref_log, log, save = tmp_path / "ref.jsonl", tmp_path / "log.jsonl", str(tmp_path / "ckpt")
    make_trainer(["--train-iters", "6", "--log-json", str(ref_log)]).train()
    args = ["--train-iters", "6", "--save", save, "--load", save, "--save-interval", "2", "--log-json", str(log)]
    with pytest.raises(Stop):
        make_trainer(args).train(on_step=_stop_after(3))
    assert [r["iteration"] for r in _json(log)] == [1, 2, 3]
    make_trainer(args).train()
    got = _json(log)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["lm_loss"] for r in got] == [r["lm_loss"] for r in _json(ref_log)]  # and exact resume


def _valid_losses(path):
    return {r["iteration"]: r["valid_loss"] for r in _json(path) if "valid_loss" in r}


def test_validation_continues_after_a_resume(tmp_path):
    """Evaluations at 2 and 4 read validation batches 0 and 1; the one at 6 reads batch 2, resumed or not."""
    common = ["--train-iters", "6", "--eval-interval", "2", "--eval-iters", "1"]
    ref_log, log, save = tmp_path / "ref.jsonl", tmp_path / "log.jsonl", str(tmp_path / "ckpt")
    make_trainer(common + ["--log-json", str(ref_log)]).train()
    run = common + ["--save", save, "--load", save, "--log-json", str(log)]
    make_trainer(run + ["--exit-interval", "4"]).train()
    make_trainer(run).train()
    ref, got = _valid_losses(ref_log), _valid_losses(log)
    assert sorted(ref) == [2, 4, 6] and sorted(got) == [2, 4, 6]
    assert got[6] == ref[6]  # bit-identical: same weights, same validation samples
    assert len({ref[2], ref[4], ref[6]}) == 3  # the batches differ, so a restart at sample 0 would show


def test_exit_duration_clock_starts_with_the_process():
    before = time.time()
    t = make_trainer(["--train-iters", "1", "--exit-duration-in-mins", "10"])
    assert t.checkpointer.start_time <= before  # start-up work (imports, build, data) counts
    assert time.time() - t.checkpointer.start_time < 3600
    assert abs(process_start_time() - t.checkpointer.start_time) < 1e-6


@pytest.mark.gpu
def test_step_bookkeeping_never_waits_for_the_gpu():
    """Counting skipped/NaN steps and summing the log's figures stay on the device: no host sync per
    step (torch raises on any synchronising call in sync-debug mode 'error')."""
    from megacoat.parallel.context import ParallelContext
    from megacoat.training.log import IterationLogger
    from megacoat.training.trainer import TrainState

    dev = torch.device("cuda")
    cfg = parse_args(COMMON + ["--train-iters", "10"])
    logger = IterationLogger(cfg, ParallelContext.single(dev), dev, "bf16", None, stream=open(os.devnull, "w"))
    state = TrainState()
    recs = [StepRecord(i, 1e-3, torch.tensor(2.0 + i, device=dev), torch.tensor(v, device=dev),
                       torch.tensor(ok, device=dev))
            for i, (v, ok) in enumerate([(1.0, True), (float("nan"), False), (float("inf"), False)])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rec in recs:
            logger.record_step(rec, {})
            state.count_step(rec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    state.resolve_counters()
    assert (state.skipped_iters, state.nan_iters) == (2, 1)
    loss, norm, good, skipped, nan = logger._sums.tolist()
    assert (loss, norm, good, skipped, nan) == (2.0, 1.0, 1.0, 2.0, 1.0)
