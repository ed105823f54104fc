"""pretrain_gpt.py as a Megatron user drives it: data flags, schedules, resumes with changed flags.
Each case either trains as Megatron-LM would or stops with one line naming the flag and the fix."""
import json

import pytest

from test_cli import TINY, run_cli

BASE = TINY + ["--fp32", "--num-workers", "0", "--global-batch-size", "8"]


def _records(path):
    return [json.loads(x) for x in open(path) if "lm_loss" in x]


@pytest.mark.slow
def test_resume_with_a_smaller_global_batch_reads_on_to_its_last_step(tmp_path):
    """The train split is sized --train-iters x --global-batch-size; resumed at 32 consumed samples with
    half the batch, the run needs 32 + 6 x 4 = 56 (it stopped with a StopIteration traceback at 40)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    first = run_cli(BASE + ["--train-iters", "4", "--save", str(ckpt)])
    assert first.returncode == 0, first.stderr[-2000:]
    r = run_cli(BASE + ["--train-iters", "10", "--global-batch-size", "4", "--load", str(ckpt),
                        "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["consumed_samples"] for x in _records(log)] == [32 + 4 * k for k in range(1, 7)]
