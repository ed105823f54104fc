"""Out of GPU memory in a training step: the error keeps torch's text and adds the flags that would shrink
this run, with the model-state bytes each saves."""
import os

import pytest
import torch

from megacoat.config import parse_args
from megacoat.training.memory_advice import FP8_STATE_BYTES, memory_saving_flags, out_of_memory_message
from megacoat.training.trainer import Trainer
from test_cli import TINY

GIB = 2**30


def test_every_applicable_flag_with_its_saving():
    cfg = parse_args(["--fp8-format", "hybrid", "--micro-batch-size", "4"])
    n = 3 * GIB  # parameters on this rank
    memory = {"params": n, "weights": 2.0, "grads": 4.0, "master": 4.0, "optimizer_states": 8.0,
              "fp8_weight_copies": 1.5}
    flags = memory_saving_flags(cfg, memory, dp_size=2)
    text = "\n".join(flags)
    assert "--fp8-weight-cache none: -4.5 GiB" in text  # 1.5 bytes x 3 Gi
    assert f"--exp-avg-sq-dtype fp8: -{(8 - FP8_STATE_BYTES) * 3:.1f} GiB" in text  # 8 -> 2.1875 bytes/param
    assert "--grad-reduce-in-bf16: -6.0 GiB" in text
    assert "--use-distributed-optimizer: -18.0 GiB" in text  # (8 x (1 - 1/2) + 4 - 4/2) x 3 Gi
    assert "--recompute-granularity full" in text and "--micro-batch-size 2 --global-batch-size 8 " in text  # its default: 4 x DP 2
    assert "--fp8-format" not in text and "--fp8-recipe coat:" not in text  # FP8 with coat already on
    odd = "\n".join(memory_saving_flags(parse_args(["--micro-batch-size", "9"]), memory, dp_size=1))
    assert "--micro-batch-size 3 --global-batch-size 9 (3x the micro-batches per step): about 3/9" in odd
    tensorwise = memory_saving_flags(parse_args(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]), memory, 1)
    assert "--fp8-recipe coat: activations saved in FP8 (tensorwise saves them in bf16)" in tensorwise


def test_zero_saving_counts_the_master_shard_it_adds():
    """fp32 parameters need no master without ZeRO; under it every rank holds a 4/DP-byte master shard."""
    cfg = parse_args(["--fp32"])
    memory = {"params": GIB, "weights": 4.0, "grads": 4.0, "master": 0.0, "optimizer_states": 8.0}
    text = "\n".join(memory_saving_flags(cfg, memory, dp_size=2))
    assert "--use-distributed-optimizer: -2.0 GiB" in text  # 8 x 1/2 - 4/2
    assert "--fp8-format" not in text  # FP8 needs bf16 parameters


def test_only_what_is_not_already_on():
    cfg = parse_args(["--micro-batch-size", "1", "--use-distributed-optimizer", "--grad-reduce-in-bf16",
                      "--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8",
                      "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    memory = {"params": GIB, "weights": 2.0, "grads": 2.0, "master": 2.0, "optimizer_states": FP8_STATE_BYTES / 2}
    assert memory_saving_flags(cfg, memory, dp_size=2) == [
        "--fp8-format hybrid --fp8-recipe coat: FP8 GEMMs and activations saved in FP8 (sm_89+ GPUs)"]


def test_bf16_moments_save_less_than_fp32_ones_and_zero_shards_count():
    cfg = parse_args(["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
                      "--use-distributed-optimizer"])
    # ZeRO over 4 ranks: this rank's moments are a quarter of 4 bytes per parameter
    memory = {"params": 4 * GIB, "weights": 2.0, "grads": 4.0, "master": 1.0, "optimizer_states": 1.0}
    text = "\n".join(memory_saving_flags(cfg, memory, dp_size=4))
    assert f"--exp-avg-sq-dtype fp8: -{4 * (1 - FP8_STATE_BYTES / 4):.1f} GiB" in text
    assert "--use-distributed-optimizer" not in text


def test_a_step_out_of_memory_raises_the_same_error_with_the_advice(monkeypatch):
    """The error object torch raised (its traceback too), its text followed by the advice."""
    cfg = parse_args(TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0", "--train-iters", "5"])
    trainer = Trainer(cfg, log_stream=open(os.devnull, "w"))
    real_step, calls = trainer.train_step, []
    raised = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def step(micro_batches):
        calls.append(1)
        if len(calls) == 3:
            raise raised
        return real_step(micro_batches)

    monkeypatch.setattr(trainer, "train_step", step)
    with pytest.raises(torch.OutOfMemoryError) as info:
        trainer.train()
    assert info.value is raised
    text = str(info.value)
    assert text.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "megacoat: out of GPU memory in training step 3. Model state on this rank: weights" in text
    assert "--recompute-granularity full" in text and "--fp8-format" not in text  # --fp32 run: no FP8 offered
    assert trainer.state.iteration == 2


def test_message_names_the_held_state():
    cfg = parse_args([])
    msg = out_of_memory_message(cfg, {"params": GIB, "weights": 2.0, "grads": 4.0, "master": 4.0,
                                      "optimizer_states": 8.0}, 1, 0)
    assert msg.splitlines()[0].startswith("megacoat: out of GPU memory in training step 1. Model state on this "
                                          "rank: weights 2.0 GiB, grads 4.0 GiB, master 4.0 GiB, optimizer_states 8.0 GiB.")
