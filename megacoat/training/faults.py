"""Faults: stopping on runs of non-finite steps, and saving on SIGTERM (SLURM preemption).

A dead or stuck rank is handled by the process group's timeout (--distributed-timeout-minutes,
set in init_distributed) and by Trainer.close(failed=True), which aborts instead of waiting.
"""
from __future__ import annotations

import datetime
import signal
from typing import Optional

import torch
import torch.distributed as dist


class TrainingStopped(RuntimeError):
    """Training stopped on purpose before the end (the message says why and what to do)."""


class SkipGuard:
    """--max-skipped-iterations N: counts consecutive skipped steps on the device and raises once
    there are N. Reading the count is a host sync, paid once per step only when the flag is set.
    Every rank sees the same skip decision (the gradient norm is global), so all stop together."""

    def __init__(self, limit: Optional[int], device: torch.device):
        if limit is not None and limit < 1:
            raise ValueError("--max-skipped-iterations must be >= 1.")
        self.limit = limit
        self.run = torch.zeros((), dtype=torch.int64, device=device)

    def after_step(self, success: torch.Tensor, iteration: int, last_saved: Optional[int]) -> None:
        if self.limit is None:
            return
        skipped = (~success.to(self.run.device, torch.bool)).long()
        self.run = (self.run + skipped) * skipped  # back to zero after a good step
        n = int(self.run.item())
        if n >= self.limit:
            where = f"the last checkpoint (iteration {last_saved}) is intact" if last_saved is not None else \
                "no checkpoint was saved by this run"
            raise TrainingStopped(
                f"stopping at iteration {iteration}: {n} consecutive iterations had non-finite gradients "
                f"(--max-skipped-iterations {self.limit}); {where}. Lower --lr, check the data, or resume from the "
                "checkpoint with a different --seed.")


class ExitSignalHandler:
    """--exit-signal-handler: remember a SIGTERM instead of dying, so that the loop can save at the
    next iteration boundary and exit 0. `requested()` is collective (a MAX all-reduce per step):
    SLURM may signal ranks at slightly different times, and every rank must stop at the same step.

    SLURM and torchrun signal the whole process group: the DataLoader workers ignore SIGTERM under
    this flag (data.ignore_sigterm), so they live until the main process shuts them down."""

    def __init__(self, device: torch.device, signum: int = signal.SIGTERM, timeout_minutes: Optional[float] = None):
        self.device, self.signum = device, signum
        self.received = False
        # The per-step agreement runs on the host over gloo: an NCCL all-reduce read back with .item()
        # would wait for the GPU every step. Collective: every rank builds the handler.
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            kw = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
            self.group = dist.new_group(backend="gloo", **kw)
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def requested(self) -> bool:
        flag = self.received
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([1 if flag else 0], dtype=torch.int32)  # host memory (gloo)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = bool(t.item())
        return flag

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
