"""The learning-rate schedule the flags ask for: in iterations (--train-iters, the default) or in
samples (--train-samples: warmup and decay in samples, as Megatron counts them), with
--lr-warmup-fraction as a share of the decay span. The shape (linear warmup, then cosine /
linear / constant decay to --min-lr) is optim.lr_scheduler's."""
from __future__ import annotations

from ..config import MegacoatConfig
from ..optim.lr_scheduler import LRScheduler


class SampleLRScheduler(LRScheduler):
    """Counts consumed samples instead of steps: step(n) after a step of n samples. The lr of a
    step is the schedule at the samples consumed once it is done (as step k gets lr_at(k))."""

    unit = "samples"

    def __init__(self, cfg: MegacoatConfig):
        o = cfg.optim
        super().__init__(o, cfg.train.train_iters)
        self.decay_iters = o.lr_decay_samples or cfg.train.train_samples
        if o.lr_warmup_fraction is not None:
            self.warmup = o.lr_warmup_fraction * self.decay_iters
        else:
            self.warmup = o.lr_warmup_samples or 0

    def step(self, samples: int = 1) -> float:
        self.num_steps += samples
        return self.lr_at(self.num_steps)


def build_lr_scheduler(cfg: MegacoatConfig) -> LRScheduler:
    if cfg.train.train_samples is not None:
        return SampleLRScheduler(cfg)
    sched = LRScheduler(cfg.optim, cfg.train.train_iters)
    if cfg.optim.lr_warmup_fraction is not None:  # Megatron: warmup = fraction x decay steps
        sched.warmup = cfg.optim.lr_warmup_fraction * sched.decay_iters
    return sched


def step_lr(scheduler: LRScheduler, samples: int) -> float:
    """Advance by one optimizer step of `samples` samples; returns that step's learning rate."""
    return scheduler.step(samples) if isinstance(scheduler, SampleLRScheduler) else scheduler.step()
