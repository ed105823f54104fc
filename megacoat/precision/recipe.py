"""Numeric recipe of a run: the dtype of parameters and activations, and of gradient accumulation.

bf16: bf16 parameters and compute, fp32 gradient accumulation and fp32 master weights (in the
optimizer). fp32: everything fp32. The default follows the device: bf16 on GPU, fp32 on CPU
(CPU bf16 matmuls are slow and the CPU path exists for correctness).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TrainingConfig


@dataclass(frozen=True)
class PrecisionRecipe:
    params_dtype: torch.dtype
    grad_dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float32: "fp32"}[self.params_dtype]


def resolve_precision(t: TrainingConfig, device: torch.device, grad_reduce_in_bf16: bool = False) -> PrecisionRecipe:
    grad = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
    if t.bf16:
        return PrecisionRecipe(torch.bfloat16, grad)
    if t.fp32:
        return PrecisionRecipe(torch.float32, grad)
    return PrecisionRecipe(torch.bfloat16 if device.type == "cuda" else torch.float32, grad)
