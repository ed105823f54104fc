"""Which samples each data-parallel rank reads, in an order that does not depend on the DP size.

Global batch i is samples [i*gbs, (i+1)*gbs). DP rank r takes the contiguous block of gbs/d
samples starting at r*gbs/d and reads it as gbs/(d*mbs) micro-batches of mbs samples. Putting
the ranks' blocks side by side gives the same global batch for any d, so runs with different
DP sizes train on the same data. Training resumes at consumed_samples (a multiple of gbs).
"""
from __future__ import annotations

from typing import Iterator, List


class GlobalOrderBatchSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, cyclic: bool = False):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                             f"{micro_batch_size} x data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if consumed_samples % global_batch_size:
            raise ValueError(f"consumed_samples {consumed_samples} is not a multiple of the global batch size "
                             f"{global_batch_size}; resume from a checkpoint saved at an iteration boundary")
        if total_samples < global_batch_size:
            raise ValueError(f"the dataset has {total_samples} samples, fewer than one global batch "
                             f"({global_batch_size})")
        self.total_samples = total_samples
        if cyclic:  # a cycling stream (validation) resumed after several passes continues inside the pass
            consumed_samples %= total_samples // global_batch_size * global_batch_size
        self.consumed_samples = consumed_samples
        self.mbs, self.gbs = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cyclic = cyclic

    @property
    def num_global_batches(self) -> int:
        return self.total_samples // self.gbs

    def __len__(self) -> int:
        per_rank = self.gbs // (self.mbs * self.dp_size)
        return (self.num_global_batches - self.consumed_samples // self.gbs) * per_rank

    def _global_batches(self) -> Iterator[int]:
        first = self.consumed_samples // self.gbs
        while True:
            yield from range(first, self.num_global_batches)
            if not self.cyclic:
                return
            first = 0

    def __iter__(self) -> Iterator[List[int]]:
        block = self.gbs // self.dp_size
        for i in self._global_batches():
            start = i * self.gbs + self.dp_rank * block
            for m in range(start, start + block, self.mbs):
                yield list(range(m, m + self.mbs))
