"""Autograd communication regions for tensor and sequence parallelism (Megatron semantics).

Each function takes the process group explicitly. With a group of size 1 (or None) every
region is the identity, so single-process code takes the same path.

Last-dim regions split/gather the hidden dimension; sequence regions act on dim 0, the
sequence dimension of our [s, b, h] activations.

The collectives (`all_reduce`, `all_gather_first`, `reduce_scatter_first`) are the in-place
torch.distributed calls in eager code and the functional collectives (which return a new tensor) inside
`torch.compile`: dynamo's rewriting of an in-place collective into an output buffer inside an
autograd.Function's backward lost the collective on torch 2.11 (the H200's). The backward reduce-scatter of
the SP gather then became the uninitialised buffer: the compiled TP=2 + SP layers trained on garbage
weight gradients, and the partitioner, seeing a weight-gradient op that no longer depended on the
output gradient, moved it into the forward. A functional collective cannot lose its result.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_FUNCOL_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The reduced tensor (in eager code x itself, reduced in place; compiled, a new tensor)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, _FUNCOL_OPS[op], group)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_first(x: torch.Tensor, group) -> torch.Tensor:
    """The group's tensors stacked along dim 0, in rank order."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x, 0, group)
    out = torch.empty((x.shape[0] * n,) + x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/n of dim 0 of the sum over the group."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"dim 0 of size {x.shape[0]} not divisible by the group size {n}")
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x, "sum", 0, group)
    out = torch.empty((x.shape[0] // n,) + x.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    # Stacked along dim 0 (the layout every backend accepts; gloo refuses an extra leading dim).
    return torch.cat(all_gather_first(x, group).chunk(n, dim=0), dim=-1)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by TP size {n}")
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


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
    "copy_to_tp_region", _identity, all_reduce,
    "Identity forward, all-reduce of the gradient backward (input of a column-parallel layer).")
reduce_from_tp_region = _region(
    "reduce_from_tp_region", all_reduce, _identity,
    "All-reduce forward (output of a row-parallel layer), identity backward.")
scatter_to_tp_region = _region(
    "scatter_to_tp_region", _split_last, _gather_last,
    "Keep this rank's slice of the last dim; backward gathers.")
gather_from_tp_region = _region(
    "gather_from_tp_region", _gather_last, _split_last,
    "Gather the last dim from all TP ranks; backward keeps this rank's slice.")
scatter_to_sequence_parallel_region = _region(
    "scatter_to_sequence_parallel_region", _split_first, all_gather_first,
    "Keep this rank's sequence shard (dim 0); backward gathers.")
gather_from_sequence_parallel_region = _region(
    "gather_from_sequence_parallel_region", all_gather_first, reduce_scatter_first,
    "All-gather sequence shards before a column-parallel layer; backward reduce-scatters.")
reduce_scatter_to_sequence_parallel_region = _region(
    "reduce_scatter_to_sequence_parallel_region", reduce_scatter_first, all_gather_first,
    "Reduce-scatter the output of a row-parallel layer into sequence shards; backward gathers.")
