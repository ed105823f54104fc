"""Plain (uncompressed) data-parallel communication, with byte accounting.

- `PlainAllReduce`: the non-sharded optimizer's gradient all-reduce.
- `PlainShardedComm`: the ZeRO baseline: reduce-scatter of gradients in the gradient dtype,
  all-gather of bf16 (or fp32) weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import CommStats, Pending, backend_supports_inplace

__all__ = ["CommStats", "PlainAllReduce", "PlainShardedComm", "ring_all_reduce_bytes", "ring_shard_bytes"]


def ring_all_reduce_bytes(numel: int, elem_size: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce: 2 (n-1)/n of the buffer."""
    return 0 if group_size == 1 else 2 * (group_size - 1) * numel * elem_size // group_size


def ring_shard_bytes(numel: int, elem_size: int, group_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter or all-gather of a buffer: (n-1)/n of it."""
    return 0 if group_size == 1 else (group_size - 1) * numel * elem_size // group_size


class PlainAllReduce:
    """Average gradients over the data-parallel group with one all-reduce."""

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.stats = stats

    def reduce_grads(self, flat: torch.Tensor) -> None:
        if self.size == 1:
            return
        flat.div_(self.size)  # pre-divide: keeps fp32 sums in range and matches Megatron's averaging
        dist.all_reduce(flat, group=self.group)
        self.stats.add("grad", ring_all_reduce_bytes(flat.numel(), flat.element_size(), self.size))


class PlainShardedComm:
    """Reduce-scatter gradients / all-gather weights, uncompressed (see comm/base.py)."""

    name = "plain"

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.stats = stats
        self.inplace = self.size > 1 and backend_supports_inplace(group)

    def reduce_grads(self, bucket_grad: torch.Tensor, shard_out: torch.Tensor, async_op: bool) -> Pending:
        if self.size == 1:
            return Pending()
        bucket_grad.div_(self.size)
        self.stats.add("grad", ring_shard_bytes(bucket_grad.numel(), bucket_grad.element_size(), self.size))
        if self.inplace:
            return Pending([dist.reduce_scatter_tensor(shard_out, bucket_grad, group=self.group, async_op=async_op)])
        tmp = torch.empty_like(shard_out)
        work = dist.reduce_scatter_tensor(tmp, bucket_grad, group=self.group, async_op=async_op)
        return Pending([work], lambda: shard_out.copy_(tmp))

    # The optimizer may write the owned weight shard itself, fused into its step (the all-gather
    # only needs the new weights); then it calls gather_params(..., weights_written=True).
    optimizer_writes_shard_weights = True

    def gather_params(self, bucket_param: torch.Tensor, shard_param: torch.Tensor, master_shard: torch.Tensor,
                      async_op: bool, weights_written: bool = False) -> Pending:
        if not weights_written:
            shard_param.copy_(master_shard)  # round the new fp32 master to the weight dtype
        if self.size == 1:
            return Pending()
        self.stats.add("param", ring_shard_bytes(bucket_param.numel(), bucket_param.element_size(), self.size))
        if self.inplace:
            return Pending([dist.all_gather_into_tensor(bucket_param, shard_param, group=self.group,
                                                        async_op=async_op)])
        tmp = torch.empty_like(bucket_param)
        work = dist.all_gather_into_tensor(tmp, shard_param.clone(), group=self.group, async_op=async_op)
        return Pending([work], lambda: bucket_param.copy_(tmp))
