"""SDP4Bit's communication strategy for the ZeRO optimizer (see comm/base.py for the contract).

- qWD (`gather_params`, --quantized-weights): each rank sends its shard's weight difference
  delta = weight_dtype(new master) - current weights, int4/int8-quantized (one message: codes +
  scales); every rank, the owner too, adds the same dequantized deltas, so replicas stay
  bit-identical and the quantization error is fed back through the next delta.
- TLq-HS (`reduce_grads`, --quantized-gradients [--hadamard-transform]): Hadamard once, then
  level 1 within a node (int8 all-to-all, fp32 sum, requantize to int4), level 2 between nodes
  (int4 all-to-all among the same local index, fp32 sum), inverse Hadamard and the 1/dp of the mean
  in one pass into the owned gradient shard. Partition order: DP rank r = node * L + local owns
  shard r; level 1 sends local peer j the shards {n * L + j} (all nodes n); level 2 sends node n
  shard n * L + j. One node: a single 8-bit level; one rank per node: a single 4-bit level.
  `--gradient-alltoall-pipeline K` cuts every shard into K slices (whole groups); slice k's
  level-2 all-to-all is in flight while slice k+1 is reduced.
What is not quantized goes through `PlainShardedComm`.

Stochastic rounding draws from a hash of (seed, iteration, DP rank, bucket, slice, hop, element):
the same run reproduces bit for bit, and so does a resumed one (the iteration is the optimizer's
checkpointed step count, passed in with set_iteration).
On CUDA the gradient chain runs on a side stream (its collectives' waits are stream waits), so
the backward pass continues while a bucket is being reduced.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import round_to_fp32
from . import codecs
from .base import CommStats, Pending
from .plain import PlainShardedComm


def slice_bounds(shard_size: int, pipeline: int, unit: int) -> List[Tuple[int, int]]:
    """Split [0, shard_size) into at most `pipeline` non-empty slices of whole `unit`s, near-equal."""
    units = shard_size // unit
    k = max(1, min(pipeline, units))
    cuts = [round(i * units / k) * unit for i in range(k + 1)]
    return [(a, b - a) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


class SDP4BitComm:
    """qWD parameter all-gather and/or TLq-HS gradient reduce-scatter (see the module docstring)."""

    name = "sdp4bit"
    optimizer_writes_shard_weights = False  # qWD needs the previous weights: delta = new - previous

    def __init__(self, cfg, ctx, stats: CommStats, seed: int):
        self.cfg, self.stats, self.seed = cfg, stats, int(seed)
        self.group = ctx.dp_group
        self.dp = ctx.dp_size
        self.rank = ctx.dp_rank
        self.local_size, self.nodes = ctx.dp_intra_size, ctx.dp_inter_size
        if self.dp > 1 and self.local_size * self.nodes != self.dp:
            raise ValueError(f"DP size {self.dp} is not (ranks per node {self.local_size}) x (nodes {self.nodes}): "
                             "check --ranks-per-node")
        self.intra_group, self.inter_group = ctx.dp_intra_group, ctx.dp_inter_group
        self.plain = PlainShardedComm(ctx.dp_group, stats)
        self.iteration = 0  # set by the optimizer (set_iteration) before every step's collectives
        self._exact_gather = False
        self._stream = None

    # ------------------------------------------------------------------------------ helpers
    def set_iteration(self, iteration: int) -> None:
        """The optimizer's iteration (its checkpointed step count): it keys the random streams, so a
        resumed run rounds exactly as an uninterrupted one."""
        self.iteration = int(iteration)

    def _key(self, kind: str, bucket: int, *ids: int) -> codecs.Key:
        return codecs.derive_key(self.seed, 1 if kind == "grad" else 2, self.iteration, self.rank, bucket, *ids)

    @contextmanager
    def exact_gathers(self):
        """Parameter gathers inside this block send exact weights (plain all-gather of the rounded
        masters): after a checkpoint load every replica restarts identical, whatever it held."""
        self._exact_gather = True
        try:
            yield
        finally:
            self._exact_gather = False

    # ---------------------------------------------------------------------------- gradients
    def reduce_grads(self, bucket_grad: torch.Tensor, shard_out: torch.Tensor, async_op: bool) -> Pending:
        c = self.cfg
        if not c.quantized_gradients:
            return self.plain.reduce_grads(bucket_grad, shard_out, async_op)
        if self.dp == 1:
            return Pending()
        S = shard_out.numel()
        unit = max(c.gq_group_size_intra, c.gq_group_size_inter)
        if S % unit or bucket_grad.numel() != S * self.dp:
            raise ValueError(f"bucket of {bucket_grad.numel()} elements / shard of {S}: the shard must be a multiple "
                             f"of the gradient quantization group ({unit}); pad buckets with shard_alignment")
        bucket = bucket_grad.storage_offset()
        for kind, n in self.grad_wire_bytes(S).items():
            self.stats.add(kind, n)
        chain = self._reduce_chain(bucket_grad, shard_out, bucket)
        if not bucket_grad.is_cuda:
            # gloo waits block the host: only the first hop is issued now, the rest runs in wait()
            # (a blocking wait inside a backward hook could stall a pipeline peer).
            next(chain, None)
            if not async_op:
                _drain(chain)
                return Pending()
            return Pending(finish=lambda: _drain(chain))
        current = torch.cuda.current_stream(bucket_grad.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(bucket_grad.device)
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side):  # NCCL waits are stream waits: the whole chain is queued now
            _drain(chain)
        return Pending(finish=lambda: current.wait_stream(side))

    def _reduce_chain(self, grad: torch.Tensor, shard_out: torch.Tensor, bucket: int):
        """A generator: pauses once, after the first hop's collectives are issued."""
        c = self.cfg
        L, N, S = self.local_size, self.nodes, shard_out.numel()
        had = bool(c.hadamard_transform)
        out_scale = round_to_fp32(1.0 / (self.dp * (codecs.HADAMARD_BLOCK if had else 1)))
        unit = max(c.gq_group_size_intra, c.gq_group_size_inter)
        slices = slice_bounds(S, c.gradient_alltoall_pipeline, unit)
        b1, g1 = c.gradient_quantization_bits_intra, c.gq_group_size_intra
        b2, g2 = c.gradient_quantization_bits_inter, c.gq_group_size_inter
        dev = grad.device
        if L > 1 and N > 1:
            # Level 1 for every slice first: their intra all-to-alls queue back to back.
            first = []
            for k, (off, sl) in enumerate(slices):
                send = torch.empty(L, codecs.message_bytes(N * sl, b1, g1), dtype=torch.uint8, device=dev)
                codecs.encode_partitioned(grad, send, S, off, sl, L, N, b1, g1, had, self._key("grad", bucket, k, 1))
                first.append(self._all_to_all(send, self.intra_group, "grad_intra"))
            yield
            second = []
            for k, (off, sl) in enumerate(slices):
                work, recv = first[k]
                work.wait()
                send = torch.empty(N, codecs.message_bytes(sl, b2, g2), dtype=torch.uint8, device=dev)
                codecs.reduce_requantize(recv, send, N * sl, b1, g1, b2, g2, N, self._key("grad", bucket, k, 2))
                second.append(self._all_to_all(send, self.inter_group, "grad_inter"))
            for (off, sl), (work, recv) in zip(slices, second):
                work.wait()
                codecs.reduce_decode(recv, shard_out[off: off + sl], sl, b2, g2, had, out_scale)
            return
        # One level: within the node (8-bit by default) or between nodes (4-bit by default).
        intra = N == 1
        bits, group = (b1, g1) if intra else (b2, g2)
        grp, kind = (self.intra_group, "grad_intra") if intra else (self.inter_group, "grad_inter")
        hops = []
        for k, (off, sl) in enumerate(slices):
            send = torch.empty(self.dp, codecs.message_bytes(sl, bits, group), dtype=torch.uint8, device=dev)
            codecs.encode_partitioned(grad, send, S, off, sl, self.dp, 1, bits, group, had,
                                      self._key("grad", bucket, k, 1))
            hops.append(self._all_to_all(send, grp, kind))
        yield
        for (off, sl), (work, recv) in zip(slices, hops):
            work.wait()
            codecs.reduce_decode(recv, shard_out[off: off + sl], sl, bits, group, had, out_scale)

    @staticmethod
    def _all_to_all(send: torch.Tensor, group, kind: str):
        """Row i of `send` goes to group rank i; row i of the result came from group rank i."""
        recv = torch.empty_like(send)
        return dist.all_to_all_single(recv, send, group=group, async_op=True), recv

    def grad_wire_bytes(self, shard_size: int) -> Dict[str, int]:
        """Bytes this rank sends per level for one bucket with shards of `shard_size` (what
        reduce_grads counts; also used to compute byte budgets without running collectives)."""
        c = self.cfg
        if not c.quantized_gradients:
            return {"grad": 0 if self.dp == 1 else (self.dp - 1) * shard_size * 4}
        L, N = self.local_size, self.nodes
        out = {"grad_intra": 0, "grad_inter": 0}
        if self.dp == 1:
            return out
        b1, g1 = c.gradient_quantization_bits_intra, c.gq_group_size_intra
        b2, g2 = c.gradient_quantization_bits_inter, c.gq_group_size_inter
        for _, sl in slice_bounds(shard_size, c.gradient_alltoall_pipeline, max(g1, g2)):
            if L > 1 and N > 1:
                out["grad_intra"] += (L - 1) * codecs.message_bytes(N * sl, b1, g1)
                out["grad_inter"] += (N - 1) * codecs.message_bytes(sl, b2, g2)
            elif N == 1:
                out["grad_intra"] += (L - 1) * codecs.message_bytes(sl, b1, g1)
            else:
                out["grad_inter"] += (N - 1) * codecs.message_bytes(sl, b2, g2)
        return out

    def param_wire_bytes(self, shard_size: int, elem_size: int = 2) -> int:
        """Bytes this rank sends in one bucket's parameter gather (quantized, or plain weights)."""
        c = self.cfg
        if not c.quantized_weights:
            return (self.dp - 1) * shard_size * elem_size
        return (self.dp - 1) * codecs.message_bytes(shard_size, c.weight_quantization_bits, c.wq_group_size)

    # ---------------------------------------------------------------------------- parameters
    def gather_params(self, bucket_param: torch.Tensor, shard_param: torch.Tensor, master_shard: torch.Tensor,
                      async_op: bool) -> Pending:
        c = self.cfg
        if not c.quantized_weights or self._exact_gather:
            return self.plain.gather_params(bucket_param, shard_param, master_shard, async_op)
        S, G, bits = shard_param.numel(), c.wq_group_size, c.weight_quantization_bits
        if S % G:
            raise ValueError(f"weight shard of {S} elements is not a multiple of --wq-group-size {G}: pad buckets "
                             "with shard_alignment")
        bucket = bucket_param.storage_offset()
        msg = torch.empty(codecs.message_bytes(S, bits, G), dtype=torch.uint8, device=shard_param.device)
        codecs.encode_delta(master_shard, shard_param, msg, bits, G, self._key("param", bucket),
                            c.quantize_weights_directly)
        if self.dp == 1:
            codecs.apply_delta(msg.view(1, -1), bucket_param, bits, G, c.quantize_weights_directly)
            return Pending()
        recv = torch.empty(self.dp * msg.numel(), dtype=torch.uint8, device=msg.device)
        self.stats.add("param", self.param_wire_bytes(S))
        work = dist.all_gather_into_tensor(recv, msg, group=self.group, async_op=async_op)
        return Pending([work], lambda: codecs.apply_delta(recv.view(self.dp, -1), bucket_param, bits, G,
                                                          c.quantize_weights_directly))


def _drain(gen) -> None:
    for _ in gen:
        pass


def build_comm(cfg, ctx, stats: CommStats, seed: int) -> Optional[SDP4BitComm]:
    """The SDP4Bit strategy when any of its flags is on, else None (the optimizer's plain default)."""
    if not cfg.sdp4bit:
        return None
    return SDP4BitComm(cfg, ctx, stats, seed)
