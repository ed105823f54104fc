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
        # Parameters whose main_grad holds nothing of this step yet: their first gradient is
        # copied rather than added, which saves zeroing the buffer and re-reading zeros.
        self._fresh = {id(p) for p in self.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]

    def _accumulate(self, p: torch.Tensor) -> None:
        # Move the gradient into the fp32 buffer and drop it: no bf16 accumulation, and the
        # per-parameter .grad memory is freed as soon as it is produced.
        if id(p) in self._fresh:
            p.main_grad.copy_(p.grad)
            self._fresh.discard(id(p))
        else:
            p.main_grad.add_(p.grad)
        p.grad = None

    def zero(self) -> None:
        """Start a new step: the next gradient of every parameter overwrites its main_grad."""
        self._fresh = {id(p) for p in self.params}

    def finalize(self) -> None:
        """After the last backward of a step: parameters that received no gradient get zeros."""
        for p in self.params:
            if id(p) in self._fresh:
                p.main_grad.zero_()
        self._fresh = set()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
