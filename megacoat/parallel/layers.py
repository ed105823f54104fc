"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Activations are [s, b, h]. Parameters carry attributes read by the optimizer:
- `tensor_model_parallel` (bool): the parameter is split across TP ranks (count it on every
  TP rank in the grad norm); duplicated parameters are counted on TP rank 0 only.
- `sequence_parallel` (bool): duplicated across TP but fed sequence shards, so its gradient
  must be all-reduced across TP (norm weights, row-parallel biases under --sequence-parallel).
- `global_name`, `shard_info`: how the local tensor maps into the full one (for init and for
  checkpoints): `shard_info = (dim, partition_sizes)` means the full tensor is made of blocks
  of `partition_sizes` along `dim`, each block split evenly over TP, the local tensor being
  the concatenation of this rank's piece of every block.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.wgrad import wgrad_accumulate
from .mappings import (copy_to_tp_region, gather_from_sequence_parallel_region, gather_from_tp_region,
                       group_rank, group_size, reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tp_region)
from .random import param_generator


def shard_of_full(full: torch.Tensor, dim: int, partition_sizes: Sequence[int], rank: int, size: int) -> torch.Tensor:
    """This rank's local tensor from the full tensor (see module doc for the layout)."""
    blocks = torch.split(full, list(partition_sizes), dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def full_from_shards(shards: Sequence[torch.Tensor], dim: int, partition_sizes: Sequence[int]) -> torch.Tensor:
    """Inverse of shard_of_full over all ranks' local tensors."""
    size = len(shards)
    local_sizes = [p // size for p in partition_sizes]
    per_rank_blocks = [torch.split(s, local_sizes, dim=dim) for s in shards]
    return torch.cat([torch.cat([prb[i] for prb in per_rank_blocks], dim=dim)
                      for i in range(len(partition_sizes))], dim=dim)


class InitSpec:
    """How to initialise a parameter layout-independently."""

    def __init__(self, seed: int, std: Optional[float], valid_rows: Optional[int] = None):
        self.seed = seed
        self.std = std  # None: zeros
        # Only the first `valid_rows` rows are drawn (the rest, vocabulary padding, is zero), so
        # the weights do not depend on how much padding a TP size needs.
        self.valid_rows = valid_rows

    def materialize(self, param: torch.Tensor, name: str, full_shape, dim: int, partition_sizes, tp_rank, tp_size):
        with torch.no_grad():
            if self.std is None:
                param.zero_()
                return
            if param.is_meta:  # --dry-run plans shapes on the meta device: nothing to draw
                return
            gen = param_generator(self.seed, name, param.device)
            full = torch.zeros(full_shape, dtype=torch.float32, device=param.device)
            rows = full_shape[0] if self.valid_rows is None else self.valid_rows
            full[:rows].normal_(0.0, self.std, generator=gen)
            param.copy_(shard_of_full(full, dim, partition_sizes, tp_rank, tp_size))


class _LinearWithGradAccumulation(torch.autograd.Function):
    """y = x W^T + b whose weight gradient is added straight into `main_grad` (Megatron's
    gradient-accumulation fusion): no bf16 weight-gradient tensor, no separate accumulation pass.

    Autograd still needs a gradient for the weight so that the optimizer's post-accumulate hook runs
    (it launches overlapped bucket syncs): an uninitialised placeholder is returned, and the hook
    ignores it because the layer marked the weight with `grad_added_to_main_grad`. The optimizer's
    one-element CPU flag `weight.main_grad_overwrite` says that this is the step's first gradient
    (the GEMM then writes main_grad instead of adding to it).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, overwrite):
        ctx.save_for_backward(x, weight)
        # Not a saved tensor: other micro-batches' backwards legitimately add into it meanwhile
        # (pipelining, accumulation), which autograd's version check would reject.
        ctx.main_grad, ctx.overwrite = main_grad, overwrite
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        placeholder = wgrad_accumulate(ctx.main_grad, grad_output, x, ctx.overwrite, weight.dtype)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, placeholder, grad_bias, None, None


def linear_with_grad_accumulation(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                  fuse: bool) -> torch.Tensor:
    """F.linear, with the weight gradient accumulated into `weight.main_grad` when `fuse` and the
    optimizer gave the weight a main gradient (training); plain F.linear otherwise (inference)."""
    main_grad = getattr(weight, "main_grad", None)
    overwrite = getattr(weight, "main_grad_overwrite", None)
    if fuse and main_grad is not None and overwrite is not None and weight.requires_grad and torch.is_grad_enabled():
        return _LinearWithGradAccumulation.apply(x, weight, bias, main_grad, overwrite)
    return F.linear(x, weight, bias)


def _set_linear_impl(self, linear_impl) -> None:
    """`linear_impl` runs the layer's forward instead of F.linear and this module's communication (the FP8 GEMM
    path of precision/linear.py, handed in by the model so that parallel/ does not import precision/):
    `impl.column_parallel(layer, x, activation)` / `impl.row_parallel(layer, x)`, with `impl.make_cache()` (its
    per-weight state, e.g. the FP8 weight copy). Its inputs and outputs may carry what the neighbouring operations
    of its recipe exchange with it (precision/handoff.py)."""
    self.linear_impl = linear_impl
    self.fp8_cache = linear_impl.make_cache() if linear_impl is not None and self.weight is not None else None


def _make_param(shape, dtype, device, name, tensor_parallel: bool, shard_info=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    p.tensor_model_parallel = tensor_parallel
    p.sequence_parallel = False
    p.global_name = name
    p.shard_info = shard_info
    return p


class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W split along its output dimension across TP ranks.

    `partition_sizes` splits the output into blocks (e.g. [ffn, ffn] for a fused gate/up
    projection), each block split over TP, so every rank holds its part of every block.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group, name: str, init: InitSpec,
                 bias: bool = False, gather_output: bool = False, sequence_parallel: bool = False,
                 partition_sizes: Optional[Sequence[int]] = None, dtype=torch.float32, device=None,
                 skip_weight: bool = False, gradient_accumulation_fusion: bool = False, linear_impl=None):
        super().__init__()
        self.tp_group = tp_group
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.partition_sizes = list(partition_sizes or [out_features])
        if sum(self.partition_sizes) != out_features or any(s % tp for s in self.partition_sizes):
            raise ValueError(f"{name}: output blocks {self.partition_sizes} must sum to {out_features} "
                             f"and each be divisible by TP={tp}")
        self.out_local = out_features // tp
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        if skip_weight:  # weight is supplied at forward time (tied output layer)
            self.weight = None
        else:
            self.weight = _make_param((self.out_local, in_features), dtype, device, f"{name}.weight", True,
                                      (0, self.partition_sizes))
            init.materialize(self.weight, f"{name}.weight", (out_features, in_features), 0, self.partition_sizes,
                             rank, tp)
        # A weight supplied at forward time (the tied embedding) also gets a plain gradient from its
        # other use: only a weight this layer owns may take the fused path.
        self.fuse_wgrad = gradient_accumulation_fusion and self.weight is not None
        if self.fuse_wgrad:
            self.weight.grad_added_to_main_grad = True
        self._set_linear_impl(linear_impl)
        if bias:
            self.bias = _make_param((self.out_local,), dtype, device, f"{name}.bias", True, (0, self.partition_sizes))
            self.bias.data.zero_()
        else:
            self.bias = None

    _set_linear_impl = _set_linear_impl

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None, activation: Optional[str] = None):
        """`weight`: the weight to use instead of the layer's own (the tied output layer's; plain F.linear then).
        `activation`: an activation the layer's implementation fuses into its autograd node (FP8 coat: "swiglu")."""
        if self.linear_impl is not None and weight is None:
            return self.linear_impl.column_parallel(self, x, activation)
        if activation is not None:
            raise ValueError(f"{self.weight.global_name}: a fused activation needs the layer's own FP8 "
                             "implementation and weight")
        w = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tp_region(x, self.tp_group)
        y = linear_with_grad_accumulation(x, w, self.bias, self.fuse_wgrad and weight is None)
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group)
        return y


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W split along its input dimension; partial outputs are summed over TP."""

    def __init__(self, in_features: int, out_features: int, *, tp_group, name: str, init: InitSpec,
                 bias: bool = False, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None, gradient_accumulation_fusion: bool = False, linear_impl=None):
        super().__init__()
        self.tp_group = tp_group
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if in_features % tp:
            raise ValueError(f"{name}: input size {in_features} not divisible by TP={tp}")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _make_param((out_features, in_features // tp), dtype, device, f"{name}.weight", True,
                                  (1, [in_features]))
        init.materialize(self.weight, f"{name}.weight", (out_features, in_features), 1, [in_features], rank, tp)
        self.fuse_wgrad = gradient_accumulation_fusion
        if self.fuse_wgrad:
            self.weight.grad_added_to_main_grad = True
        self._set_linear_impl(linear_impl)
        if bias:
            self.bias = _make_param((out_features,), dtype, device, f"{name}.bias", False)
            self.bias.sequence_parallel = sequence_parallel
            self.bias.data.zero_()
        else:
            self.bias = None

    _set_linear_impl = _set_linear_impl

    def forward(self, x: torch.Tensor):
        if self.linear_impl is not None:
            return self.linear_impl.row_parallel(self, x)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        return self.reduce_output(linear_with_grad_accumulation(x, self.weight, None, self.fuse_wgrad))

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial output summed over TP (reduce-scattered along the sequence under SP), plus the bias."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split across TP ranks.

    Each rank looks up the ids in its vocabulary range, zeros the rest, and the partial
    embeddings are summed over TP (reduce-scattered along the sequence under SP by the caller).
    """

    def __init__(self, padded_vocab: int, hidden: int, *, tp_group, name: str, init: InitSpec,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if padded_vocab % tp:
            raise ValueError(f"padded vocabulary {padded_vocab} not divisible by TP={tp}")
        self.vocab_local = padded_vocab // tp
        self.vocab_start = rank * self.vocab_local
        self.weight = _make_param((self.vocab_local, hidden), dtype, device, f"{name}.weight", True, (0, [padded_vocab]))
        init.materialize(self.weight, f"{name}.weight", (padded_vocab, hidden), 0, [padded_vocab], rank, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> partial embeddings [b, s, h] (not yet summed over TP)."""
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


def mark_sequence_parallel(module: nn.Module) -> None:
    """Flag all parameters of a module (norms) as needing a TP all-reduce of their gradient."""
    for p in module.parameters():
        p.sequence_parallel = True


def register_replicated(p: nn.Parameter, name: str) -> nn.Parameter:
    """Annotate a parameter that every TP rank holds whole (norms, learned positions)."""
    p.tensor_model_parallel = False
    p.sequence_parallel = getattr(p, "sequence_parallel", False)
    p.global_name = name
    p.shard_info = None
    return p
