"""Megatron's learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""
from __future__ import annotations

import math

from ..config import OptimizerConfig


class LRScheduler:
    def __init__(self, cfg: OptimizerConfig, train_iters: int):
        self.max_lr, self.min_lr = cfg.lr, cfg.min_lr
        self.warmup = cfg.lr_warmup_iters
        self.decay_iters = cfg.lr_decay_iters or train_iters
        self.style = cfg.lr_decay_style
        self.num_steps = 0

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
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.num_steps = sd["num_steps"]
