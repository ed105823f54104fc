"""Plain (uncompressed) data-parallel gradient communication, with byte accounting."""
from __future__ import annotations

import torch
import torch.distributed as dist


class CommStats:
    """Bytes this rank sent per step, per kind (gradients, parameters), as counted at each collective."""

    def __init__(self):
        self.bytes = {"grad": 0, "param": 0}

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    def pop(self) -> dict:
        out, self.bytes = self.bytes, {"grad": 0, "param": 0}
        return out


def ring_all_reduce_bytes(numel: int, elem_size: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce: 2 (n-1)/n of the buffer."""
    return 0 if group_size == 1 else 2 * (group_size - 1) * numel * elem_size // group_size


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
