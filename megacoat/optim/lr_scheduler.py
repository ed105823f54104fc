"""Megatron's learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr.

A checkpoint keeps the schedule's position and its shape (peak and minimum lr, warmup, decay span,
style, unit). Resuming with other schedule flags follows Megatron's rule: refused, unless
--override-opt_param-scheduler (the flags win) or --use-checkpoint-opt_param-scheduler (the
checkpoint's schedule wins) says which to keep.
"""
from __future__ import annotations

import math

from ..config import ConfigError, OptimizerConfig

# The schedule's shape: attribute -> (flag in iterations, flag in samples).
_SHAPE = {
    "max_lr": ("--lr", "--lr"),
    "min_lr": ("--min-lr", "--min-lr"),
    "warmup": ("--lr-warmup-iters (or --lr-warmup-fraction)", "--lr-warmup-samples (or --lr-warmup-fraction)"),
    "decay_iters": ("--lr-decay-iters (default: --train-iters)", "--lr-decay-samples (default: --train-samples)"),
    "style": ("--lr-decay-style", "--lr-decay-style"),
}


class LRScheduler:
    unit = "iterations"  # what num_steps, warmup and decay_iters count

    def __init__(self, cfg: OptimizerConfig, train_iters: int):
        self.max_lr, self.min_lr = cfg.lr, cfg.min_lr
        self.warmup = cfg.lr_warmup_iters
        self.decay_iters = cfg.lr_decay_iters or train_iters
        self.style = cfg.lr_decay_style
        self.num_steps = 0
        self.override = cfg.override_opt_param_scheduler
        self.use_checkpoint = cfg.use_checkpoint_opt_param_scheduler

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step number `step` (1-based)."""
        if self.warmup > 0 and step <= self.warmup:
            return self.max_lr * step / self.warmup
        if self.style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        span = max(self.decay_iters - self.warmup, 1)
        ratio = (step - self.warmup) / span
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self) -> float:
        self.num_steps += 1
        return self.lr_at(self.num_steps)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "unit": self.unit, **{k: getattr(self, k) for k in _SHAPE}}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the saved position. A saved shape that differs from this run's flags is refused unless
        --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler says which one to keep
        (checkpoints that saved only the position are taken as they are)."""
        unit = sd.get("unit", self.unit)
        if unit != self.unit:
            now = "samples (--train-samples)" if self.unit == "samples" else "iterations (--train-iters)"
            raise ConfigError(f"the checkpoint's learning-rate schedule counts {unit} but this run's counts {now}: "
                              f"resume in the checkpoint's unit, or start the schedule afresh with --no-load-optim")
        differ = [k for k in _SHAPE if k in sd and sd[k] != getattr(self, k)]
        if differ and self.use_checkpoint:
            for k in differ:
                setattr(self, k, sd[k])
        elif differ and not self.override:
            col = 1 if self.unit == "samples" else 0
            what = "; ".join(f"{_SHAPE[k][col]} {sd[k]} in the checkpoint, {getattr(self, k)} now" for k in differ)
            raise ConfigError(f"the checkpoint's learning-rate schedule differs from this run's flags ({what}): "
                              "pass --override-opt_param-scheduler to follow the flags, or "
                              "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")
        self.num_steps = sd["num_steps"]
