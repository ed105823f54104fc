"""Numeric recipe of a run: the dtype of parameters and activations, of gradient accumulation, and
the FP8 recipe of the linear layers and saved activations.

bf16: bf16 parameters and compute, fp32 gradient accumulation and fp32 master weights (in the
optimizer). fp32: everything fp32. The default follows the device: bf16 on GPU, fp32 on CPU
(CPU bf16 matmuls are slow and the CPU path exists for correctness). FP8 (`--fp8-format`) needs
bf16 parameters, so it makes bf16 the default on every device.

FP8: `--fp8-format hybrid` = E4M3 forward (weights, activations), E5M2 gradients;
`e4m3` = E4M3 everywhere. `--fp8-recipe tensorwise` = FP8 GEMMs with just-in-time per-tensor
scaling and bf16 saved activations; `coat` = the same GEMMs plus COAT's FP8 activation storage
(fused FP8 norms, activations and residual adds; saved tensors in FP8). The output layer and
attention stay bf16 in both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..config import PrecisionConfig, TrainingConfig


@dataclass(frozen=True)
class Fp8Recipe:
    fwd_format: str = "e4m3"
    grad_format: str = "e5m2"
    fp8_activations: bool = True  # coat; False: tensorwise
    # Keep each weight's FP8 copy (W and W^T, 2 bytes/element) for the whole step (--fp8-weight-cache;
    # resolve_precision decides under auto).
    cache_weights: bool = True
    # cuBLASLt algorithms timed per GEMM shape on its first call (--fp8-gemm-candidates; 1: the heuristic's).
    gemm_candidates: int = 16

    @property
    def name(self) -> str:
        fmt = "hybrid" if self.grad_format == "e5m2" else "e4m3"
        return f"fp8-{fmt}-{'coat' if self.fp8_activations else 'tensorwise'}"


@dataclass(frozen=True)
class PrecisionRecipe:
    params_dtype: torch.dtype
    grad_dtype: torch.dtype = torch.float32
    fp8: Optional[Fp8Recipe] = None

    @property
    def name(self) -> str:
        """The format of the GEMMs: what the MFU peak refers to."""
        if self.fp8 is not None:
            return "fp8"
        return {torch.bfloat16: "bf16", torch.float32: "fp32"}[self.params_dtype]

    @property
    def log_name(self) -> str:
        """The iteration line's format name, followed there by "peak": e.g. 'fp8 (hybrid, coat)'."""
        if self.fp8 is None:
            return self.name
        fmt = "hybrid" if self.fp8.grad_format == "e5m2" else "e4m3"
        return f"fp8 ({fmt}, {'coat' if self.fp8.fp8_activations else 'tensorwise'})"

    @property
    def description(self) -> str:
        """For log lines: e.g. 'bf16' or 'fp8-hybrid-coat (bf16 params)'."""
        base = {torch.bfloat16: "bf16", torch.float32: "fp32"}[self.params_dtype]
        return base if self.fp8 is None else f"{self.fp8.name} ({base} params)"


def resolve_fp8(pr: PrecisionConfig) -> Optional[Fp8Recipe]:
    if pr.fp8_format is None:
        return None
    if pr.fp8_format not in ("hybrid", "e4m3"):
        raise ValueError(f"--fp8-format {pr.fp8_format!r}: use hybrid or e4m3")
    if pr.fp8_recipe not in ("tensorwise", "coat"):
        raise ValueError(f"--fp8-recipe {pr.fp8_recipe!r}: use tensorwise or coat")
    return Fp8Recipe("e4m3", "e5m2" if pr.fp8_format == "hybrid" else "e4m3", pr.fp8_recipe == "coat",
                     gemm_candidates=pr.fp8_gemm_candidates)


def keep_fp8_weights(choice: str, num_microbatches: int, overlap_param_gather: bool) -> bool:
    """--fp8-weight-cache: whether each linear keeps its FP8 weight copies for the whole step. `auto` keeps them
    when they pay: several micro-batches reuse them, or the trainer can make them all right after the optimizer
    step (two launches for all weights, overlapping the optimizer's kernels; one pass makes W and W^T where
    per-use casting reads W in the forward and again in the backward: +1.1% tokens/s at 1.36B and one
    micro-batch, for 2 bytes per linear weight element). Under --overlap-param-gather a step of one
    micro-batch casts per use: each layer's weights arrive just before its forward, so keeping copies would only
    cost memory. On a GPU the trainer may still drop the copies `auto` keeps, before the first forward, when the
    step would not fit with them (Trainer._fit_fp8_weight_copies)."""
    if choice not in ("auto", "step", "none"):
        raise ValueError(f"--fp8-weight-cache {choice!r}: use auto, step or none")
    if choice != "auto":
        return choice == "step"
    return num_microbatches > 1 or not overlap_param_gather


def resolve_precision(t: TrainingConfig, device: torch.device, grad_reduce_in_bf16: bool = False,
                      precision: Optional[PrecisionConfig] = None, num_microbatches: int = 1,
                      overlap_param_gather: bool = False) -> PrecisionRecipe:
    grad = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
    fp8 = resolve_fp8(precision) if precision is not None else None
    if fp8 is not None:
        fp8 = replace(fp8, cache_weights=keep_fp8_weights(precision.fp8_weight_cache, num_microbatches,
                                                          overlap_param_gather))
    if fp8 is not None and t.fp32:
        raise ValueError("--fp8-format needs bf16 parameters: drop --fp32 (or use --bf16).")
    if t.bf16 or fp8 is not None:
        return PrecisionRecipe(torch.bfloat16, grad, fp8)
    if t.fp32:
        return PrecisionRecipe(torch.float32, grad)
    return PrecisionRecipe(torch.bfloat16 if device.type == "cuda" else torch.float32, grad)
