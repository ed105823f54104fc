"""The optimizer interface of the training loop, and its non-sharded implementation.

The loop only calls:
    opt.zero_grad()                      before the first micro-batch of a step
    opt.start_micro_batch(is_last)       before each backward (is_last: gradients become final)
    result = opt.step(lr)                after the last micro-batch's backward:
                                         grad sync -> grad norm -> clip -> AdamW -> param sync
    opt.memory_report()
and checkpoints use state_ranges() / scalar_state() / load_scalar_state() / after_load(),
so the ZeRO distributed optimizer replaces `MixedPrecisionAdamW` behind the same calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.base import CommStats
from ..comm.plain import PlainAllReduce
from ..config import OptimizerConfig
from ..parallel.context import ParallelContext
from .buffers import GradBuffer
from .adamw import Fp32AdamW
from .fp8_adam import (Chunk, PrecisionAwareAdamW, choose_state_formats, decay_table, dequantize_groups,
                       round_up_group)
from .clip import global_grad_norm, norm_from_local_square_sum
from .grad_norm_overlap import BucketNormOverlap


@dataclass
class ParamStateRange:
    """The optimizer state this rank holds for one parameter, for checkpoints.

    `param` is the model parameter (its `global_name`, `shard_info`, `tensor_model_parallel`
    say where its TP-local tensor sits in the full one). This rank owns the flat range
    `[start, end)` of that TP-local tensor (the whole of it without ZeRO). `tensors` maps a state
    name ("master", "exp_avg", "exp_avg_sq", or a codec's own names) to a 1-D view of length
    `end - start`: reading it saves the state, writing into it loads the state.
    """

    param: nn.Parameter
    start: int
    end: int
    tensors: Dict[str, torch.Tensor]
    # Per-group state (FP8 moments: scale, exponent and centre of each group of 128 elements of the
    # TP-local flat tensor): 1-D views over groups [start // 128, ceil(end / 128)).
    groups: Dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepResult:
    """0-dim tensors, possibly still being computed on the device: read them when logging,
    so that the host never waits for the GPU inside a step."""

    success: torch.Tensor     # bool; False: non-finite gradient norm, step skipped
    grad_norm: torch.Tensor   # fp32
    comm_bytes: dict


def all_reduce_packed(tensors: List[torch.Tensor], group) -> None:
    """Sum each tensor over `group` in place, with one collective for all of them."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


class CodecScalars:
    """Checkpoint scalars of an optimizer whose AdamW lives in `self.codec`."""

    def scalar_state(self) -> dict:
        """Optimizer scalars: the Adam step count (the same for every parameter)."""
        return self.codec.scalar_state()

    def load_scalar_state(self, d: dict) -> None:
        self.codec.load_scalar_state(d)

    def dequantize_state(self, codes, s, k, c) -> torch.Tensor:
        """fp32 values of FP8 moment codes with per-element s, k, c (loading a checkpoint saved in
        another state format or TP layout)."""
        return dequantize_groups(codes, s, k, c, expand=True)

    def conversion_ranges(self) -> List["ParamStateRange"]:
        """Ranges with fp32 "master", "exp_avg", "exp_avg_sq" to load a checkpoint of another state
        format into; after_load() re-encodes them (torch's AdamW holds fp32 moments already)."""
        ranges = self.state_ranges()
        if not getattr(self, "flat", False):
            return ranges
        out = []
        for r, (a, b) in zip(ranges, self._flat_spans()):
            out.append(ParamStateRange(r.param, r.start, r.end,
                                       {"master": r.tensors["master"], **self.codec.conversion_states(a, b)}))
        return out


class PreSyncParams:
    """Parameters whose gradients need their own collective before the data-parallel gradient sync.

    Pipeline parallelism registers the tied word embedding of the first and last stage here:
    `fn(params)` sums its gradient over those two stages at the start of `step()`. It must not
    run from a gradient hook (it would wait for the other stage in the middle of the pipeline's
    point-to-point traffic), so the ZeRO optimizer also keeps the buckets holding these
    parameters out of the overlapped sync and launches them after `fn`.
    """

    def add_pre_sync_params(self, params, fn) -> None:
        self._pre_sync = getattr(self, "_pre_sync", []) + [(list(params), fn)]

    def _run_pre_sync(self) -> None:
        for params, fn in getattr(self, "_pre_sync", ()):
            fn(params)


def counted_in_norm(p, tp_rank: int) -> bool:
    """Count each gradient element once in the global norm: TP duplicates on TP rank 0 only, and a
    tied copy (`tied_copy`, the last pipeline stage's word embedding) not at all."""
    if getattr(p, "tied_copy", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


class MixedPrecisionAdamW(CodecScalars, PreSyncParams):
    """AdamW on an fp32 master copy of every parameter, gradients all-reduced over DP.

    Model parameters may be bf16 (the compute copy) or fp32 (then the master is the parameter
    itself). Gradients accumulate in the fp32 `GradBuffer`.
    """

    def __init__(self, model: nn.Module, cfg: OptimizerConfig, ctx: ParallelContext,
                 grad_dtype: torch.dtype = torch.float32, bucket_size: Optional[int] = None):
        self.cfg, self.ctx = cfg, ctx
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Gradient memory only from each bucket's first backward to the end of the step, where the
        # model tells us when a module's backward starts (GPTModel's pre_backward_hook).
        release = hasattr(model, "pre_backward_hook")
        self.grad_buffer = GradBuffer(self.params, grad_dtype, bucket_size, release_between_steps=release,
                                      on_ready=self._on_grad_ready)
        if release:
            self._install_grad_allocation(model)
        self.stats = CommStats()
        self.comm = PlainAllReduce(ctx.dp_group, self.stats)
        self.counted = [counted_in_norm(p, ctx.tp_rank) for p in self.params]
        self.sp_params = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        # The norm's sum of squares per bucket during the backward, where gradients are final there
        # (one data-parallel rank, no TP sum of sequence-parallel gradients, no tied-embedding pre-sync).
        self.norm_overlap = None
        if ctx.dp_size == 1 and not (ctx.tp_size > 1 and self.sp_params):
            self.norm_overlap = BucketNormOverlap(self.grad_buffer.bucket_params,
                                                  {id(p) for p, c in zip(self.params, self.counted) if c},
                                                  self.params[0].device, self.grad_buffer.buckets)
        self.fused = self.params[0].is_cuda
        formats = choose_state_formats(cfg, self.params[0].device)
        self.flat = formats is not None
        if self.flat:
            self.codec = self._flat_codec(formats)
        else:
            self.masters = [p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone())
                            for p in self.params]
            self.codec = Fp32AdamW(self.masters, [p.ndim <= 1 for p in self.params], cfg, self.fused)

    def _flat_codec(self, formats) -> PrecisionAwareAdamW:
        """Masters in one flat fp32 tensor, each parameter starting a group of 128 (the codec's
        shard); one chunk per parameter. fp32 parameters become views of their master."""
        self.offsets, n = [], 0
        for p in self.params:
            self.offsets.append(n)
            n += round_up_group(p.numel())
        self.master_flat = torch.zeros(n, dtype=torch.float32, device=self.params[0].device)
        self.masters, chunks = [], []
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                view = self.master_flat[off: off + p.numel()].view_as(p)
                view.copy_(p.detach())
                if p.dtype == torch.float32:
                    p.data = view
                    self.masters.append(p)
                else:
                    self.masters.append(nn.Parameter(view, requires_grad=False))
                chunks.append(Chunk(off, off + round_up_group(p.numel()), p.main_grad.view(-1),
                                    None if p.dtype == torch.float32 else p))
        decay = decay_table([(off, p.numel(), p.ndim > 1) for p, off in zip(self.params, self.offsets)], n,
                            self.master_flat.device)
        return PrecisionAwareAdamW(self.master_flat, chunks, decay, self.cfg, *formats)

    def _install_grad_allocation(self, model: nn.Module) -> None:
        params_of = {}
        for mod in model.modules():  # a model (chunk) for its direct parameters, other modules for all
            params_of[id(mod)] = list(mod.parameters(recurse=not hasattr(mod, "pre_backward_hook")))

        def allocate(modules) -> None:
            for mod in modules:
                self.grad_buffer.allocate_for(params_of.get(id(mod), ()))

        model.pre_backward_hook = allocate

    def zero_grad(self) -> None:
        self.grad_buffer.zero()
        if self.norm_overlap is not None:
            self.norm_overlap.reset()
            self.norm_overlap.enabled = not getattr(self, "_pre_sync", None)

    def _on_grad_ready(self, p) -> None:
        if self.norm_overlap is not None:
            self.norm_overlap.on_ready(p)

    def _sync_sequence_parallel_grads(self) -> None:
        """Norm weights see only their sequence shard under SP: sum their grads over TP."""
        if self.ctx.tp_size > 1:
            all_reduce_packed([p.main_grad for p in self.sp_params], self.ctx.tp_group)

    def start_micro_batch(self, is_last: bool) -> None:
        """The all-reduce runs in step(); the norm's partial sums may start in the last backward."""
        if self.norm_overlap is not None:
            self.norm_overlap.set_last_micro_batch(is_last)

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        self.grad_buffer.finalize()
        self._run_pre_sync()
        self._sync_sequence_parallel_grads()
        for bucket in self.grad_buffer.buckets:
            self.comm.reduce_grads(bucket)
        grads = [p.main_grad for p in self.params]
        if self.norm_overlap is not None and self.norm_overlap.enabled:
            norm = norm_from_local_square_sum(self.norm_overlap.total(), self.ctx.mp_group)
        else:
            norm = global_grad_norm(grads, self.counted, self.ctx.mp_group)
        if self.flat:  # reads bf16 gradients directly and writes the bf16 weights in the same pass
            success = self.codec.step(lr, norm)
            if self.grad_buffer.release_between_steps:
                self.grad_buffer.release()
            return StepResult(success, norm, self.stats.pop())
        for m, g in zip(self.masters, grads):
            m.grad = g if g.dtype == torch.float32 else g.float()
        success = self.codec.step(lr, norm, lambda c: [m.grad.mul_(c) for m in self.masters])
        for m in self.masters:
            m.grad = None
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p is not m]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        if self.grad_buffer.release_between_steps:
            self.grad_buffer.release()  # stream-ordered: the step's kernels above still read it first
        return StepResult(success, norm, self.stats.pop())

    def memory_report(self) -> dict:
        """Bytes per parameter held by this rank for each kind of model state."""
        n = sum(p.numel() for p in self.params)
        weights = sum(p.numel() * p.element_size() for p in self.params)
        master = sum(m.numel() * 4 for p, m in zip(self.params, self.masters) if m is not p)
        states = self.codec.bytes_per_element * n
        grads = self.grad_buffer.numel * self.grad_buffer.buckets[0].element_size()
        return {"params": n, "weights": weights / n, "grads": grads / n, "master": master / n,
                "optimizer_states": states / n}

    # ------------------------------------------------------------------ checkpoint interface
    def state_ranges(self) -> List[ParamStateRange]:
        if not self.flat:
            return [ParamStateRange(p, 0, p.numel(), {"master": m.detach().view(-1), **self.codec.state_views(i)})
                    for i, (p, m) in enumerate(zip(self.params, self.masters))]
        out = []
        for p, m, off in zip(self.params, self.masters, self.offsets):
            elem, groups = self.codec.range_states(off, off + p.numel())
            out.append(ParamStateRange(p, 0, p.numel(), {"master": m.detach().view(-1), **elem}, groups))
        return out

    def describe(self) -> str:
        return self.codec.formats() if self.flat else "exp_avg fp32, exp_avg_sq fp32 (torch AdamW)"

    def _flat_spans(self):
        return [(off, off + p.numel()) for p, off in zip(self.params, self.offsets)]

    @torch.no_grad()
    def after_load(self) -> None:
        """Masters were written through state_ranges(): refresh the model's (bf16) weights."""
        if self.flat:
            self.codec.after_load()
        for p, m in zip(self.params, self.masters):
            if p is not m:
                p.copy_(m)

