"""benchmarks/profile_step.py's lead trace: where in a steady-state step the GPU waits for the host.

CPU: the tracing itself (marks at every layer's forward and backward and around the optimizer, in step order,
the model's hooks and the optimizer restored) with host-clock stand-ins for CUDA events. GPU (marked): the same
on a small coat run with real events.
"""
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_step import kernel_table, lead_trace  # noqa: E402

from megacoat.config import parse_args  # noqa: E402
from megacoat.training.trainer import Trainer  # noqa: E402


def _trainer(extra):
    return Trainer(parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                               "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                               "--global-batch-size", "2", "--mock-data", "--vocab-size", "256", "--train-iters",
                               "10", "--lr", "1e-4", "--eval-iters", "0", "--eval-interval", "0", *extra]))


def _check(tr, steps=3):
    it = tr.data_iterators().train
    tr.train_step(tr._next_micro_batches(it))
    hook, step = tr.model.pre_backward_hook, tr.optimizer.step
    rows = lead_trace(tr, it, steps)
    names = [r[0] for r in rows]
    assert names[0] == "step start" and names[-2:] == ["optimizer start", "optimizer end"], names
    assert {"forward layer 0", "forward layer 1", "backward layer 0", "backward layer 1"} <= set(names), names
    assert names.index("forward layer 1") < names.index("backward layer 1") < names.index("backward layer 0")
    assert all(torch.isfinite(torch.tensor([mean, low, first])).all() and low <= mean + 1e-9
               for _, mean, low, first in rows)
    assert tr.model.pre_backward_hook is hook and tr.optimizer.step == step
    return rows


class _HostEvent:
    """A CUDA event stand-in on the host clock: the 'GPU' reaches it when the host records it (lead 0)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_lead_trace_marks_every_layer_and_the_optimizer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    tr = _trainer(["--fp32"])
    rows = _check(tr)
    assert all(abs(mean) < 1.0 and abs(first) < 1.0 for _, mean, _, first in rows)  # host clock: never behind
    tr.close()


@pytest.mark.gpu
def test_lead_trace_on_gpu_coat():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    tr = _trainer(["--bf16", "--fp8-format", "hybrid"])
    _check(tr)
    tr.close()


def test_kernel_table_groups_by_name_and_duration():
    # two steps: per step one 2 us fill, one 30 us cast and one 150 us GEMM, plus a 10 us cast in step 2
    spans = [(0, 2, "fill"), (5, 35, "cast"), (40, 190, "gemm"),
             (200, 202, "fill"), (205, 235, "cast"), (240, 390, "gemm"), (400, 410, "cast")]
    rows, buckets = kernel_table(spans, steps=2)
    assert [r[0] for r in rows] == ["gemm", "cast", "fill"]
    name, n, ms, mean = rows[1]
    assert n == 1.5 and abs(ms - 0.035) < 1e-12 and abs(mean - 70 / 3) < 1e-9
    assert [(label, n) for label, n, _ in buckets] == [("0-5 us", 1.0), ("5-20 us", 0.5), ("20-100 us", 1.0),
                                                       (">= 100 us", 1.0)]
    assert abs(sum(ms for _, _, ms in buckets) - sum(e - s for s, e, _ in spans) / 2e3) < 1e-12
