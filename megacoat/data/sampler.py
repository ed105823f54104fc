"""Which samples each data-parallel rank reads, in an order that does not depend on the DP size.

A step of global batch size g that starts after `consumed` samples takes samples
[consumed, consumed + g): DP rank r takes the contiguous block of g/d samples starting at
consumed + r*g/d and reads it as g/(d*mbs) micro-batches of mbs samples. Putting the ranks' blocks
side by side gives the same global batch for any d, so runs with different DP sizes train on the
same data. The step sizes come from `batch_size_at(consumed)` (--rampup-batch-size grows them), and
training resumes at any consumed_samples, as Megatron's sampler does: a checkpoint saved during the
ramp, or a run resumed with another --global-batch-size, continues with the next unread sample.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional


class GlobalOrderBatchSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, cyclic: bool = False,
                 batch_size_at: Optional[Callable[[int], int]] = None):
        """`batch_size_at(consumed)`: the global batch of the step that starts there (default: always
        `global_batch_size`); every value must be a multiple of micro_batch_size x dp_size."""
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                             f"{micro_batch_size} x data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples {consumed_samples} is negative")
        if total_samples < global_batch_size:
            raise ValueError(f"the dataset has {total_samples} samples, fewer than one global batch "
                             f"({global_batch_size})")
        self.total_samples = total_samples
        self.mbs, self.gbs = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cyclic = cyclic
        self.batch_size_at = batch_size_at or (lambda consumed: global_batch_size)
        if cyclic:  # a cycling stream (validation) resumed after several passes continues inside the pass
            consumed_samples %= total_samples // global_batch_size * global_batch_size
        self.consumed_samples = consumed_samples

    def _steps(self) -> Iterator[tuple]:
        """(first sample, global batch size) of each step, from consumed_samples on."""
        start = self.consumed_samples
        while True:
            size = self.batch_size_at(start)
            if size % (self.mbs * self.dp_size):
                raise ValueError(f"a global batch of {size} samples is not divisible by --micro-batch-size "
                                 f"{self.mbs} x data-parallel size {self.dp_size}")
            if start + size > self.total_samples:
                if not self.cyclic or start == 0:
                    return
                start = 0  # the next pass
                continue
            yield start, size
            start += size

    def __len__(self) -> int:
        """Micro-batches of this rank until the (non-cyclic) stream ends; one pass when cyclic."""
        steps = self._steps()
        if self.cyclic:
            return (self.total_samples // self.gbs) * (self.gbs // (self.mbs * self.dp_size))
        return sum(size // (self.mbs * self.dp_size) for _, size in steps)

    def __iter__(self) -> Iterator[List[int]]:
        for start, size in self._steps():
            block = size // self.dp_size
            first = start + self.dp_rank * block
            for m in range(first, first + block, self.mbs):
                yield list(range(m, m + self.mbs))
