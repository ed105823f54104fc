"""The ZeRO distributed optimizer (`--use-distributed-optimizer`).

Each DP rank owns one contiguous 1/dp slice of every bucket of the `ParamGradBuffer`. Only for
that slice does it keep fp32 master weights and optimizer states (in the codec's format). A step:

    gradient sync   each bucket's gradient is reduced to its owners (communication strategy:
                    plain reduce-scatter, or SDP4Bit's TLq-HS), launched per bucket as soon as
                    its last gradient of the step exists with --overlap-grad-reduce
    grad norm       over owned slices, summed over DP and the model-parallel group
                    (TP duplicates counted on TP rank 0 only)
    clip + AdamW    on the owned fp32 master slice (the codec)
    parameter sync  the new weights of every slice reach every rank (strategy: plain
                    all-gather, or SDP4Bit's qWD), waited for just before the first use of each
                    bucket in the next forward with --overlap-param-gather

Parameters may straddle slice boundaries: the optimizer works on per-parameter segments
(views into one flat master tensor), which also keeps weight decay per parameter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..comm.base import CommStats, Pending
from ..comm.plain import PlainShardedComm
from ..config import OptimizerConfig
from ..parallel.context import ParallelContext
from .adamw import Fp32AdamW
from .fp8_adam import Chunk, PrecisionAwareAdamW, choose_state_formats, decay_table
from .buffers import Bucket, GradAccumulator, ParamGradBuffer, shard_alignment
from .clip import global_grad_norm
from .optimizer import CodecScalars, ParamStateRange, PreSyncParams, StepResult, counted_in_norm, all_reduce_packed


@dataclass
class Segment:
    """The part of one parameter inside this rank's slice of a bucket."""

    param: nn.Parameter
    local: Tuple[int, int]      # [start, end) within the flattened (TP-local) parameter
    absolute: Tuple[int, int]   # [start, end) within the buffers
    master: nn.Parameter        # fp32 view into the flat master tensor
    counted: bool               # counts towards the grad norm on this TP rank


@dataclass
class ZeroOptions:
    bucket_size: Optional[int] = None      # elements; None: one bucket
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_dtype: torch.dtype = torch.float32


class DistributedOptimizer(CodecScalars, PreSyncParams):
    def __init__(self, model: nn.Module, cfg: OptimizerConfig, ctx: ParallelContext, opts: ZeroOptions,
                 comm=None):
        self.cfg, self.ctx, self.opts = cfg, ctx, opts
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffer = ParamGradBuffer(self.params, opts.grad_dtype, ctx.dp_size, ctx.dp_rank, opts.bucket_size,
                                      shard_alignment(ctx.dp_size))
        self.stats = comm.stats if comm is not None else CommStats()
        self.comm = comm or PlainShardedComm(ctx.dp_group, self.stats)
        self.fused = self.params[0].is_cuda
        self._build_masters()
        formats = choose_state_formats(cfg, self.master_flat.device)
        self.flat = formats is not None
        self.codec = self._flat_codec(formats) if self.flat else \
            Fp32AdamW([s.master for s in self.segments], [s.param.ndim <= 1 for s in self.segments], cfg, self.fused)
        self.accumulator = GradAccumulator(self.params, self._on_grad_ready if opts.overlap_grad_reduce else None)
        self._is_last_micro_batch = True
        self._ready: Dict[int, int] = {}
        self._pending_grad: Dict[int, Pending] = {}
        self._pending_param: Dict[int, Pending] = {}
        self._held_buckets: set = set()  # not launched from the gradient hook (add_pre_sync_params)
        self.iteration = 0  # step() calls, checkpointed: seeds the strategy's random streams (SDP4Bit)
        self._tell_iteration()
        if opts.overlap_param_gather:
            self._install_param_wait(model)

    # ------------------------------------------------------------------------------ set-up
    def _build_masters(self) -> None:
        buf = self.buffer
        total = sum(b.shard_size for b in buf.buckets)
        self.master_flat = torch.zeros(total, dtype=torch.float32, device=buf.param_data.device)
        self.bucket_master: Dict[int, torch.Tensor] = {}
        self.segments: List[Segment] = []
        offset = 0
        for b in buf.buckets:
            lo, hi = b.owned
            view = self.master_flat[offset: offset + b.shard_size]
            view.copy_(buf.param_data[lo:hi])
            self.bucket_master[b.index] = view
            for p, local, (a, z) in buf.owned_segments(b):
                counted = counted_in_norm(p, self.ctx.tp_rank)
                self.segments.append(Segment(p, local, (a, z), nn.Parameter(view[a - lo: z - lo]), counted))
            offset += b.shard_size

    def _flat_codec(self, formats) -> PrecisionAwareAdamW:
        """The flat-shard codec: one chunk per bucket shard; it writes the owned bf16 weights itself
        where the communication strategy allows (`optimizer_writes_shard_weights`)."""
        buf = self.buffer
        write = buf.param_dtype == torch.bfloat16 and getattr(self.comm, "optimizer_writes_shard_weights", False)
        chunks, offset = [], 0
        for b in buf.buckets:
            lo, hi = b.owned
            chunks.append(Chunk(offset, offset + b.shard_size, buf.grad_data[lo:hi],
                                buf.param_data[lo:hi] if write else None))
            offset += b.shard_size
        spans = [(self._flat_offset(s), s.master.numel(), s.param.ndim > 1) for s in self.segments]
        decay = decay_table(spans, self.master_flat.numel(), self.master_flat.device)
        return PrecisionAwareAdamW(self.master_flat, chunks, decay, self.cfg, *formats)

    def _flat_spans(self):
        return [(self._flat_offset(s), self._flat_offset(s) + s.master.numel()) for s in self.segments]

    def _flat_offset(self, s: Segment) -> int:
        return s.master.storage_offset() - self.master_flat.storage_offset()

    def _install_param_wait(self, model: nn.Module) -> None:
        """Before a module's forward, wait for the all-gathers of the buckets holding its weights.

        Uses the model's explicit pre-module callback (GPTModel calls it outside compiled code),
        so no hook runs inside torch.compile'd layers.
        """
        buckets_of_module: Dict[int, List[int]] = {}
        for mod in model.modules():
            # A model (or model chunk: anything with the hook) only for its direct parameters
            # (e.g. learned positions); other modules for all of theirs.
            params = mod.parameters(recurse=not hasattr(mod, "pre_module_hook"))
            ids = sorted({self.buffer.bucket_of[id(p)].index for p in params if id(p) in self.buffer.bucket_of})
            buckets_of_module[id(mod)] = ids

        def wait_for(module: nn.Module) -> None:
            for i in buckets_of_module.get(id(module), ()):
                pending = self._pending_param.pop(i, None)
                if pending is not None:
                    pending.wait()

        if not hasattr(model, "pre_module_hook"):
            raise TypeError("--overlap-param-gather needs a model that calls pre_module_hook (GPTModel)")
        model.pre_module_hook = wait_for

    # ------------------------------------------------------------------------- interface
    def zero_grad(self) -> None:
        self.accumulator.zero()
        self._ready = {b.index: 0 for b in self.buffer.buckets}

    def start_micro_batch(self, is_last: bool) -> None:
        """The trainer says whether the coming backward is the step's last (grads become final)."""
        self._is_last_micro_batch = is_last

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._is_last_micro_batch:
            return
        b = self.buffer.bucket_of[id(p)]
        self._ready[b.index] = self._ready.get(b.index, 0) + 1
        if self._ready[b.index] == len(b.params) and b.index not in self._held_buckets:
            self._launch_grad_sync(b, async_op=True)

    def _launch_grad_sync(self, b: Bucket, async_op: bool) -> None:
        lo, hi = b.owned
        self._pending_grad[b.index] = self.comm.reduce_grads(self.buffer.bucket_grad(b),
                                                             self.buffer.grad_data[lo:hi], async_op)

    def add_pre_sync_params(self, params, fn) -> None:
        """See PreSyncParams; the buckets holding `params` wait for `fn` in finish_grad_sync."""
        super().add_pre_sync_params(params, fn)
        self._held_buckets |= {self.buffer.bucket_of[id(p)].index for p in params}

    def finish_grad_sync(self) -> None:
        self.accumulator.finalize()  # params that got no gradient hold zeros
        self._run_pre_sync()  # e.g. tied embedding grads summed over first + last pipeline stage
        for b in self.buffer.buckets:
            if b.index not in self._pending_grad:
                self._launch_grad_sync(b, async_op=True)
        for b in self.buffer.buckets:
            self._pending_grad.pop(b.index).wait()

    def finish_param_sync(self) -> None:
        """Complete deferred all-gathers (before reading weights outside a forward)."""
        for i in sorted(self._pending_param):
            self._pending_param.pop(i).wait()

    def _segment_grad(self, s: Segment) -> torch.Tensor:
        g = self.buffer.grad_data[s.absolute[0]: s.absolute[1]]
        # The flat codec reads bf16 gradients directly (no fp32 copy); torch's AdamW needs fp32.
        return g if g.dtype == torch.float32 or self.flat else g.float()

    def _sync_sequence_parallel_grads(self, grads: List[torch.Tensor]) -> None:
        """Norm weights see only their sequence shard under SP: sum their owned grads over TP."""
        if self.ctx.tp_size > 1:
            all_reduce_packed([g for g, s in zip(grads, self.segments)
                               if getattr(s.param, "sequence_parallel", False)], self.ctx.tp_group)

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        self.finish_grad_sync()
        grads = [self._segment_grad(s) for s in self.segments]
        self._sync_sequence_parallel_grads(grads)
        norm = global_grad_norm(grads, [s.counted for s in self.segments], self.ctx.mp_group,
                                extra_group=self.ctx.dp_group)
        if self.flat:
            success = self.codec.step(lr, norm)
        else:
            for s, g in zip(self.segments, grads):
                s.master.grad = g
            success = self.codec.step(lr, norm, lambda c: [g.mul_(c) for g in grads])
            for s in self.segments:
                s.master.grad = None
        self._gather_params(async_op=self.opts.overlap_param_gather)
        self.iteration += 1
        self._tell_iteration()
        return StepResult(success, norm, self.stats.pop())

    def _tell_iteration(self) -> None:
        """Strategies with stochastic rounding key it by the iteration: a resumed run draws the same."""
        if hasattr(self.comm, "set_iteration"):
            self.comm.set_iteration(self.iteration)

    def scalar_state(self) -> dict:
        return {**super().scalar_state(), "iteration": self.iteration}

    def load_scalar_state(self, d: dict) -> None:
        super().load_scalar_state(d)
        self.iteration = int(d.get("iteration", d.get("adam_step", 0)))
        self._tell_iteration()

    def _gather_params(self, async_op: bool, after_load: bool = False) -> None:
        # Forward uses the buckets from last to first (buckets are in reverse registration order):
        # issue them in that order so the first one needed completes first.
        # The codec already wrote the owned bf16 weights (only where the strategy allows it).
        written = {"weights_written": True} if self.flat and self.codec.writes_weights and not after_load else {}
        for b in reversed(self.buffer.buckets):
            lo, hi = b.owned
            pending = self.comm.gather_params(self.buffer.bucket_param(b), self.buffer.param_data[lo:hi],
                                              self.bucket_master[b.index], async_op, **written)
            if async_op:
                self._pending_param[b.index] = pending
            else:
                pending.wait()

    # ---------------------------------------------------------------------------- reports
    def memory_report(self) -> dict:
        n = sum(p.numel() for p in self.params)
        shard = self.master_flat.numel()
        return {"params": n,
                "weights": self.buffer.param_data.numel() * self.buffer.param_data.element_size() / n,
                "grads": self.buffer.grad_data.numel() * self.buffer.grad_data.element_size() / n,
                "master": 4 * shard / n,
                "optimizer_states": self.codec.bytes_per_element * shard / n}

    def describe(self) -> str:
        return self.codec.formats() if self.flat else "exp_avg fp32, exp_avg_sq fp32 (torch AdamW)"

    # ----------------------------------------------------------------- checkpoint interface
    def state_ranges(self) -> List[ParamStateRange]:
        self.finish_param_sync()
        if not self.flat:
            return [ParamStateRange(s.param, s.local[0], s.local[1],
                                    {"master": s.master.detach().view(-1), **self.codec.state_views(i)})
                    for i, s in enumerate(self.segments)]
        out = []
        for s in self.segments:
            a = self._flat_offset(s)
            elem, groups = self.codec.range_states(a, a + s.master.numel())
            out.append(ParamStateRange(s.param, s.local[0], s.local[1], {"master": s.master.detach().view(-1), **elem},
                                       groups))
        return out

    @torch.no_grad()
    def after_load(self) -> None:
        """Masters were written through state_ranges(): rebuild every rank's weights from them."""
        self.finish_param_sync()
        if self.flat:
            self.codec.after_load()
        with getattr(self.comm, "exact_gathers", contextlib.nullcontext)():  # qWD: exact weights, not deltas
            self._gather_params(async_op=False, after_load=True)
