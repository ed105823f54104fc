"""Contiguous gradient buffer: every parameter's `main_grad` is a view into one flat tensor.

Gradients accumulate there across micro-batches in fp32 (or bf16 when asked), so that the
data-parallel sync is one collective over one buffer, and bf16 parameters never accumulate
in bf16. Parameters are laid out in reverse registration order, the order backward produces
their gradients (what bucketed, overlapped syncs will need).
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn


class GradBuffer:
    def __init__(self, params: List[nn.Parameter], dtype: torch.dtype = torch.float32):
        self.params = [p for p in params if p.requires_grad]
        order = list(reversed(self.params))
        numel = sum(p.numel() for p in order)
        device = order[0].device if order else torch.device("cpu")
        self.data = torch.zeros(numel, dtype=dtype, device=device)
        self.offsets = {}
        offset = 0
        for p in order:
            p.main_grad = self.data[offset: offset + p.numel()].view_as(p)
            self.offsets[id(p)] = offset
            offset += p.numel()
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]

    @staticmethod
    def _accumulate(p: torch.Tensor) -> None:
        # Move the fresh gradient into the fp32 buffer and drop it: no bf16 accumulation,
        # and the per-parameter .grad memory is freed as soon as it is produced.
        p.main_grad.add_(p.grad)
        p.grad = None

    def zero(self) -> None:
        self.data.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
