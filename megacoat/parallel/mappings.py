"""Autograd communication regions for tensor and sequence parallelism (Megatron semantics).

Each function takes the process group explicitly. With a group of size 1 (or None) every
region is the identity, so single-process code takes the same path.

Last-dim regions split/gather the hidden dimension; sequence regions act on dim 0, the
sequence dimension of our [s, b, h] activations.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    # Output stacked along dim 0 (the layout every backend accepts; gloo refuses an extra leading dim).
    out = torch.empty((n * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return torch.cat(out.chunk(n, dim=0), dim=-1)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by TP size {n}")
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * n,) + x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + x.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _identity(x, group):
    return x


def _region(name: str, forward, backward, doc: str):
    """A region function: `forward(x, group)` on the value, `backward(g, group)` on its gradient,
    the identity (no autograd node) when the group has one rank."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, g):
            return backward(g, ctx.group), None

    def region(x, group):
        return x if group_size(group) == 1 else Region.apply(x, group)

    Region.__name__ = Region.__qualname__ = f"_{name}"
    region.__name__ = region.__qualname__ = name
    region.__doc__ = doc
    return region


copy_to_tp_region = _region(
    "copy_to_tp_region", _identity, _all_reduce,
    "Identity forward, all-reduce of the gradient backward (input of a column-parallel layer).")
reduce_from_tp_region = _region(
    "reduce_from_tp_region", _all_reduce, _identity,
    "All-reduce forward (output of a row-parallel layer), identity backward.")
scatter_to_tp_region = _region(
    "scatter_to_tp_region", _split_last, _gather_last,
    "Keep this rank's slice of the last dim; backward gathers.")
gather_from_tp_region = _region(
    "gather_from_tp_region", _gather_last, _split_last,
    "Gather the last dim from all TP ranks; backward keeps this rank's slice.")
scatter_to_sequence_parallel_region = _region(
    "scatter_to_sequence_parallel_region", _split_first, _gather_first,
    "Keep this rank's sequence shard (dim 0); backward gathers.")
gather_from_sequence_parallel_region = _region(
    "gather_from_sequence_parallel_region", _gather_first, _reduce_scatter_first,
    "All-gather sequence shards before a column-parallel layer; backward reduce-scatters.")
reduce_scatter_to_sequence_parallel_region = _region(
    "reduce_scatter_to_sequence_parallel_region", _reduce_scatter_first, _gather_first,
    "Reduce-scatter the output of a row-parallel layer into sequence shards; backward gathers.")
