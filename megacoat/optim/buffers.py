"""Contiguous gradient (and weight) buffers: every parameter's `main_grad` is a view into one flat tensor.

Gradients accumulate there across micro-batches in fp32 (or bf16 when asked), so that the
data-parallel sync is one collective over one buffer, and bf16 parameters never accumulate
in bf16. Parameters are laid out in reverse registration order, the order backward produces
their gradients (what bucketed, overlapped syncs will need).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..kernels.wgrad import require_main_grad_storage


class GradAccumulator:
    """Moves each fresh `.grad` into `param.main_grad` (a buffer view) from a post-accumulate hook.

    The first gradient of a step is copied, later ones (micro-batches) added: no zeroing pass
    over the buffer and no bf16 accumulation; `.grad` is freed as soon as it is produced.
    `on_ready(param)` is called after each move (the ZeRO optimizer uses it to launch a bucket's
    reduce-scatter as soon as its last gradient of the step arrives).
    """

    def __init__(self, params: List[nn.Parameter], on_ready=None):
        self.params = params
        self.on_ready = on_ready
        self._fresh = {id(p) for p in params}
        # Weights of layers with gradient-accumulation fusion: their weight-gradient GEMM writes
        # main_grad itself (their `.grad` is a placeholder). Its CPU flag `main_grad_overwrite` (one
        # element of one tensor, reset per step with one fill) makes the step's first GEMM overwrite.
        self.fused = [p for p in params if getattr(p, "grad_added_to_main_grad", False)]
        self._fused_ids = {id(p) for p in self.fused}
        self._overwrite = torch.ones(len(self.fused), dtype=torch.bool)
        for i, p in enumerate(self.fused):
            p.main_grad_overwrite = self._overwrite[i:i + 1]
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: torch.Tensor) -> None:
        require_main_grad_storage(p.main_grad)
        if id(p) in self._fused_ids:
            self._fresh.discard(id(p))
        elif id(p) in self._fresh:
            p.main_grad.copy_(p.grad)
            self._fresh.discard(id(p))
        else:
            p.main_grad.add_(p.grad)
        p.grad = None
        if self.on_ready is not None:
            self.on_ready(p)

    def zero(self) -> None:
        """Start a new step: the next gradient of every parameter overwrites its main_grad."""
        self._fresh = {id(p) for p in self.params}
        self._overwrite.fill_(True)

    def finalize(self) -> List[nn.Parameter]:
        """After the last backward: zero the main_grad of parameters that got no gradient; return them."""
        missing = [p for p in self.params if id(p) in self._fresh]
        for p in missing:
            p.main_grad.zero_()
        self._fresh = set()
        return missing


# Every main_grad view of the non-sharded GradBuffer starts a multiple of 16 elements into its bucket: a compiled
# graph copies an input that is not 16-byte aligned, and the fused weight-gradient ops, which write main_grad without
# declaring it, would then write that copy and the gradient would be lost.
VIEW_ALIGN = 16


def grad_bucket_layout(numels: Sequence[int], bucket_size: Optional[int]) -> List[Tuple[List[int], List[int], int]]:
    """The non-sharded GradBuffer's buckets for parameters of these sizes, given in backward order: per bucket
    (the indices of its parameters, each one's view start, the bucket's numel including the VIEW_ALIGN gaps). A
    bucket closes once it holds `bucket_size` elements (None: one bucket). What the data-parallel all-reduce and
    the gradient norm read (`training/planner.py` counts its bytes from it)."""
    bucket_size = bucket_size or max(sum(numels), 1)
    layout, current, size = [], [], 0
    for i, n in enumerate(numels):
        current.append(i)
        size += n
        if size >= bucket_size or i == len(numels) - 1:
            starts, offset = [], 0
            for j in current:
                starts.append(offset)
                offset = _round_up(offset + numels[j], VIEW_ALIGN)
            layout.append((current, starts, offset))
            current, size = [], 0
    return layout


class GradBuffer:
    """The non-sharded optimizer's gradient buffers: one flat tensor per bucket (no weight buffer).

    With `release_between_steps`, each bucket's memory exists only from just before the first backward
    that writes it until the end of the optimizer step (`allocate_for` from the model's pre-backward
    hook, `release` after the step): activations and gradients then share memory the way they do when
    `.grad` tensors are freed between steps, while main_grad views (and compiled graphs that take
    them) stay the same tensors. Buckets follow backward order, so a bucket is allocated when the
    activations of the layers it serves are being freed.
    """

    def __init__(self, params: List[nn.Parameter], dtype: torch.dtype = torch.float32,
                 bucket_size: Optional[int] = None, release_between_steps: bool = False, on_ready=None):
        self.params = [p for p in params if p.requires_grad]
        order = list(reversed(self.params))
        device = order[0].device if order else torch.device("cpu")
        layout = grad_bucket_layout([p.numel() for p in order], bucket_size)
        groups = [[order[j] for j in members] for members, _, _ in layout]
        self.buckets: List[torch.Tensor] = []
        self.bucket_of: Dict[int, int] = {}
        # Per bucket, the positions of the gaps between parameters (None: no gaps): zeroed in one launch whenever the
        # bucket gets memory (whole-bucket readers such as the data-parallel all-reduce and the gradient norm then
        # see zeros, never stale values).
        self.gaps: List[Optional[torch.Tensor]] = []
        for i, (group, (_, starts, offset)) in enumerate(zip(groups, layout)):
            data = torch.zeros(offset, dtype=dtype, device=device)
            for p, start in zip(group, starts):
                p.main_grad = data[start: start + p.numel()].view_as(p)
                self.bucket_of[id(p)] = i
            gaps = [torch.arange(a + p.numel(), b) for p, a, b in zip(group, starts, starts[1:] + [offset])
                    if a + p.numel() < b]
            self.gaps.append(torch.cat(gaps).to(device) if gaps else None)
            self.buckets.append(data)
        self.release_between_steps = release_between_steps
        self.bucket_params = [list(g) for g in groups]
        self.accumulator = GradAccumulator(self.params, on_ready)
        if release_between_steps:
            self.release()

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buckets)

    def allocate_for(self, params) -> None:
        """Give the buckets holding `params` their memory (contents undefined: the step's first
        gradient of each parameter overwrites, parameters without one are zeroed in finalize)."""
        for i in {self.bucket_of[id(p)] for p in params if id(p) in self.bucket_of}:
            self._allocate_bucket(i)

    def _allocate_bucket(self, i: int) -> None:
        if _allocate(self.buckets[i]) and self.gaps[i] is not None:
            self.buckets[i].index_fill_(0, self.gaps[i], 0)

    def release(self) -> None:
        for b in self.buckets:
            b.untyped_storage().resize_(0)

    def zero(self) -> None:
        self.accumulator.zero()

    def finalize(self) -> None:
        for i in range(len(self.buckets)):  # parameters that got no gradient still need zeros to read
            self._allocate_bucket(i)
        self.accumulator.finalize()


def _allocate(t: torch.Tensor) -> bool:
    """Give t's storage its memory (contents undefined); True if it had none."""
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)
        return True
    return False


PARAM_ALIGN = 128  # see ParamGradBuffer


def shard_alignment(dp_size: int, group_sizes=(128, 2048)) -> int:
    """Every DP shard of a bucket is a multiple of the largest quantization group any
    communication or state codec uses, so groups never straddle owners: buckets are padded to
    a multiple of dp * lcm(groups)."""
    align = 1
    for g in group_sizes:
        align = math.lcm(align, g)
    return dp_size * align


@dataclass
class Bucket:
    """A contiguous range [start, end) of the buffers (padded), split evenly over DP ranks."""

    index: int
    start: int
    end: int
    params: List[nn.Parameter]
    param_ranges: Dict[int, Tuple[int, int]]   # id(param) -> absolute [start, end) in the buffers
    dp_size: int
    dp_rank: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.dp_size

    @property
    def owned(self) -> Tuple[int, int]:
        """This rank's absolute [start, end) in the buffers."""
        s = self.start + self.dp_rank * self.shard_size
        return s, s + self.shard_size


class ParamGradBuffer:
    """Contiguous weight and gradient buffers of the ZeRO optimizer, split into buckets.

    Model parameters become views of `param_data` (so a bucket's all-gather writes the weights
    in place) and their `main_grad` views of `grad_data`. Layout: reverse registration order,
    every parameter starting at a multiple of `param_align` (128: the FP8 optimizer-state groups
    are 128 elements of each parameter's own range, so they never straddle a DP shard and do not
    depend on the DP size), buckets of at least `bucket_size` elements closed at parameter
    boundaries, each padded with zeros to a multiple of `shard_alignment(dp)`. Padding is zero
    and stays zero (the optimizer keeps zeros at zero).
    """

    def __init__(self, params: List[nn.Parameter], grad_dtype: torch.dtype, dp_size: int, dp_rank: int,
                 bucket_size: Optional[int], align: int, param_align: int = PARAM_ALIGN):
        self.params = [p for p in params if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"one buffer holds one parameter dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        device = self.params[0].device
        order = list(reversed(self.params))
        total = sum(p.numel() for p in order)
        bucket_size = bucket_size or total
        self.buckets: List[Bucket] = []
        ranges: Dict[int, Tuple[int, int]] = {}
        offset, current, bucket_start = 0, [], 0
        for i, p in enumerate(order):
            offset = bucket_start + _round_up(offset - bucket_start, param_align)
            ranges[id(p)] = (offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            if offset - bucket_start >= bucket_size or i == len(order) - 1:
                end = bucket_start + _round_up(offset - bucket_start, align)
                self.buckets.append(Bucket(len(self.buckets), bucket_start, end, current,
                                           {id(q): ranges[id(q)] for q in current}, dp_size, dp_rank))
                offset = bucket_start = end
                current = []
        self.param_ranges = ranges
        self.param_data = torch.zeros(offset, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(offset, dtype=grad_dtype, device=device)
        self.bucket_of = {}
        with torch.no_grad():
            for b in self.buckets:
                for p in b.params:
                    s, e = b.param_ranges[id(p)]
                    self.param_data[s:e].copy_(p.data.view(-1))
                    p.data = self.param_data[s:e].view_as(p)
                    p.main_grad = self.grad_data[s:e].view_as(p)
                    self.bucket_of[id(p)] = b

    def bucket_param(self, b: Bucket) -> torch.Tensor:
        return self.param_data[b.start:b.end]

    def bucket_grad(self, b: Bucket) -> torch.Tensor:
        return self.grad_data[b.start:b.end]

    def owned_segments(self, b: Bucket):
        """(param, param-local [start, end), absolute [start, end)) for every param overlapping
        this rank's shard of bucket b, in buffer order; a param may straddle shard boundaries."""
        lo, hi = b.owned
        out = []
        for p in b.params:
            s, e = b.param_ranges[id(p)]
            a, z = max(s, lo), min(e, hi)
            if a < z:
                out.append((p, (a - s, z - s), (a, z)))
        return out


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
