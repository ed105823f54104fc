"""Pipeline schedules: one engine driven by a precomputed action table.

A table is the list of what one rank does, in order:
    F(mb, c)     forward of micro-batch `mb` through this rank's model chunk `c`
    B(mb, c)     backward of it
    C(ops)       one batch of point-to-point operations (`batch_isend_irecv`), waited for as a
                 whole; each op names the tensor it carries (activation or gradient of micro-batch
                 `mb` for chunk `c`).
Chunk `c` of PP rank `r` is virtual stage `v = c * pp + r` (Megatron's interleaved layout; one
chunk per rank is plain 1F1B). Activations flow v -> v + 1 (next rank in the PP ring: the last
rank's next is the first), gradients v + 1 -> v.

Schedules (tables built by `build_schedule`, following Megatron-LM's loop structure):
  - PP = 1: the no-pipelining schedule, F(0) B(0) F(1) B(1) ... (no communication).
  - 1F1B: `min(pp - rank - 1, m)` warmup forwards, then one forward / one backward, then the
    cooldown backwards. Stage r holds at most `pp - r` micro-batches' activations.
  - interleaved (several chunks per rank): warmup `2 (pp - rank - 1) + (vp - 1) pp` forwards,
    steady 1F1B over (micro-batch, chunk) pairs taken in groups of pp micro-batches, cooldown.
Every table can be checked without processes (`check_tables`): each message sent is the one the
peer receives at that position, and the ranks cannot deadlock (send and receive of a message
complete together, a rank waits for its whole batch).

Within a batch, activation operations come before gradient operations: with PP = 2 both peers of
a rank are the same rank, and NCCL matches the messages between two ranks in posting order.
Tags say the same thing to gloo.

Tensors on the wire have the fixed shape [seq / tp under sequence parallelism else seq,
micro_batch, hidden] in the compute dtype. Once an activation is sent, its data is replaced by a
one-element tensor (the autograd graph, which does not need the output's value, stays), so a
stage keeps only what its backward needs; the backward then runs through the engine directly
(the usual shape check would see the freed tensor).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

ACT, GRAD = "act", "grad"
_TAGS = {ACT: 1, GRAD: 2}


@dataclass(frozen=True)
class Comm:
    op: str      # "send" | "recv"
    kind: str    # ACT (activation, to the next virtual stage) | GRAD (its gradient, to the previous)
    mb: int
    chunk: int   # this rank's chunk that produced (send) or will consume (recv) the tensor


@dataclass(frozen=True)
class Action:
    kind: str                       # "F" | "B" | "C"
    mb: int = -1
    chunk: int = -1
    comms: Tuple[Comm, ...] = ()

    def __repr__(self) -> str:
        if self.kind == "C":
            return "C(" + ", ".join(f"{c.op}-{c.kind}{c.mb}.{c.chunk}" for c in self.comms) + ")"
        return f"{self.kind}{self.mb}.{self.chunk}"


class _Builder:
    """Emits one rank's table; resolves which micro-batch each receive is for (per-chunk order)."""

    def __init__(self, pp: int, rank: int, vp: int):
        self.pp, self.rank, self.vp = pp, rank, vp
        self.actions: List[Action] = []
        self.fwd = [0] * vp
        self.bwd = [0] * vp
        self.recv_act = [0] * vp
        self.recv_grad = [0] * vp

    def first(self, chunk: int) -> bool:
        return chunk * self.pp + self.rank == 0

    def last(self, chunk: int) -> bool:
        return chunk * self.pp + self.rank == self.pp * self.vp - 1

    def forward(self, chunk: int) -> Tuple[int, int]:
        mb = self.fwd[chunk]
        self.fwd[chunk] += 1
        self.actions.append(Action("F", mb, chunk))
        return chunk, mb

    def backward(self, chunk: int) -> Tuple[int, int]:
        mb = self.bwd[chunk]
        self.bwd[chunk] += 1
        self.actions.append(Action("B", mb, chunk))
        return chunk, mb

    def comm(self, send_act=None, recv_act: Optional[int] = None, send_grad=None,
             recv_grad: Optional[int] = None) -> None:
        """One batch; ops that do not apply at this virtual stage (first/last) are dropped."""
        ops = []
        if send_act is not None and not self.last(send_act[0]):
            ops.append(Comm("send", ACT, send_act[1], send_act[0]))
        if recv_act is not None and not self.first(recv_act):
            ops.append(Comm("recv", ACT, self.recv_act[recv_act], recv_act))
            self.recv_act[recv_act] += 1
        if send_grad is not None and not self.first(send_grad[0]):
            ops.append(Comm("send", GRAD, send_grad[1], send_grad[0]))
        if recv_grad is not None and not self.last(recv_grad):
            ops.append(Comm("recv", GRAD, self.recv_grad[recv_grad], recv_grad))
            self.recv_grad[recv_grad] += 1
        if ops:
            self.actions.append(Action("C", comms=tuple(ops)))


def _one_f_one_b(b: _Builder, m: int, forward_only: bool) -> None:
    pp, rank = b.pp, b.rank
    if forward_only:
        for _ in range(m):
            b.comm(recv_act=0)
            b.comm(send_act=b.forward(0))
        return
    warmup = min(pp - rank - 1, m)
    remaining = m - warmup
    for _ in range(warmup):
        b.comm(recv_act=0)
        b.comm(send_act=b.forward(0))
    if remaining:
        b.comm(recv_act=0)
    for i in range(remaining):
        out = b.forward(0)
        b.comm(send_act=out, recv_grad=0)
        grad = b.backward(0)
        if i == remaining - 1:
            b.comm(send_grad=grad)
        else:
            b.comm(send_grad=grad, recv_act=0)
    for _ in range(warmup):
        b.comm(recv_grad=0)
        b.comm(send_grad=b.backward(0))


def _interleaved(b: _Builder, m: int, forward_only: bool) -> None:
    pp, rank, vp = b.pp, b.rank, b.vp
    total = m * vp

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (pp * vp)) // pp
        return c if forward else vp - 1 - c

    all_warmup = False
    if forward_only:
        warmup = total
    elif m == pp:
        warmup, all_warmup = total, True
    else:
        warmup = min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
    remaining = total - warmup
    first_rank, last_rank = rank == 0, rank == pp - 1

    b.comm(recv_act=0)
    for k in range(warmup):
        out = b.forward(chunk_of(k, True))
        nxt = chunk_of(k + 1, True)
        recv_prev = not (first_rank and nxt == 0) and k != total - 1
        if k == warmup - 1 and not forward_only and not all_warmup:
            b.comm(send_act=out, recv_act=nxt if recv_prev else None,
                   recv_grad=None if last_rank else vp - 1)
        else:
            b.comm(send_act=out, recv_act=nxt if recv_prev else None)
    for k in range(remaining):
        fk = k + warmup
        out = b.forward(chunk_of(fk, True))
        grad = b.backward(chunk_of(k, False))
        recv_prev = True
        if first_rank:  # the first rank is pp - 1 forwards ahead of the last
            nxt_f = chunk_of(fk - (pp - 1), True)
            if nxt_f == vp - 1:
                recv_prev = False
            nxt_f += 1
        else:
            nxt_f = chunk_of(fk + 1, True)
        recv_next = True
        if last_rank:  # the last rank is pp - 1 backwards ahead of the first
            nxt_b = chunk_of(k - (pp - 1), False)
            if nxt_b == 0:
                recv_next = False
            nxt_b -= 1
        else:
            nxt_b = chunk_of(k + 1, False)
        if k == remaining - 1:
            recv_prev = False
        b.comm(send_act=out, recv_act=nxt_f if recv_prev else None, send_grad=grad,
               recv_grad=nxt_b if recv_next else None)
    if forward_only:
        return
    if all_warmup:
        b.comm(recv_grad=vp - 1)
    for k in range(remaining, total):
        grad = b.backward(chunk_of(k, False))
        nxt = chunk_of(k + 1, False)
        recv_next = not (last_rank and nxt == vp - 1) and k != total - 1
        b.comm(send_grad=grad, recv_grad=nxt if recv_next else None)


def build_schedule(pp: int, rank: int, vp: int, m: int, forward_only: bool = False) -> List[Action]:
    """The action table of PP rank `rank` for `m` micro-batches and `vp` chunks per rank."""
    if m < 1:
        raise ValueError("a schedule needs at least one micro-batch")
    b = _Builder(pp, rank, vp)
    if vp == 1:
        _one_f_one_b(b, m, forward_only)
    else:
        if m % pp:
            raise ValueError(f"the interleaved schedule needs micro-batches ({m}) divisible by PP ({pp})")
        _interleaved(b, m, forward_only)
    return b.actions


def check_tables(tables: Sequence[List[Action]], m: int, vp: int, forward_only: bool = False) -> None:
    """Raise AssertionError unless the tables of all PP ranks are consistent and deadlock-free.

    Checks: every (micro-batch, chunk) is run forward (and backward) exactly once per rank, in
    dependency order; the n-th message from rank a to rank b is the one b expects as its n-th
    receive from a; simulating blocking batches (a message completes when both sides posted it)
    finishes on every rank.
    """
    pp = len(tables)

    def virtual(rank: int, chunk: int) -> int:
        return chunk * pp + rank

    for r, t in enumerate(tables):
        f = [(a.mb, a.chunk) for a in t if a.kind == "F"]
        bw = [(a.mb, a.chunk) for a in t if a.kind == "B"]
        want = sorted((i, c) for i in range(m) for c in range(vp))
        assert sorted(f) == want, f"rank {r}: forwards {f}"
        assert sorted(bw) == ([] if forward_only else want), f"rank {r}: backwards {bw}"
        fwd, bwd, have_input, have_grad = set(), set(), set(), set()
        for a in t:
            if a.kind == "C":
                for c in a.comms:
                    key = (c.mb, c.chunk)
                    if c.op == "send":
                        assert key in (fwd if c.kind == ACT else bwd), f"rank {r}: {a} sends before computing {key}"
                    elif c.kind == ACT:
                        have_input.add(key)
                    else:
                        have_grad.add(key)
            elif a.kind == "F":
                assert virtual(r, a.chunk) == 0 or (a.mb, a.chunk) in have_input, f"rank {r}: {a} has no input"
                fwd.add((a.mb, a.chunk))
            else:
                last = virtual(r, a.chunk) == pp * vp - 1
                assert (a.mb, a.chunk) in fwd, f"rank {r}: {a} before its forward"
                assert last or (a.mb, a.chunk) in have_grad, f"rank {r}: {a} has no output gradient"
                bwd.add((a.mb, a.chunk))

    # Message identity: (kind, mb, receiving virtual stage).
    def peer(rank: int, c: Comm) -> int:
        forward_dir = (c.kind == ACT) == (c.op == "send")
        return (rank + (1 if forward_dir else -1)) % pp

    def ident(rank: int, c: Comm):
        v = virtual(rank, c.chunk)
        if c.op == "send":
            v = v + 1 if c.kind == ACT else v - 1
        return c.kind, c.mb, v

    sent: Dict[Tuple[int, int], list] = {}
    recv: Dict[Tuple[int, int], list] = {}
    for r, t in enumerate(tables):
        for a in t:
            for c in a.comms:
                q = peer(r, c)
                (sent if c.op == "send" else recv).setdefault((r, q) if c.op == "send" else (q, r), []).append(
                    ident(r, c))
    assert sent.keys() == recv.keys(), (sent.keys(), recv.keys())
    for k in sent:
        assert sent[k] == recv[k], f"messages {k[0]} -> {k[1]}: sent {sent[k]}, received {recv[k]}"

    # Deadlock freedom: a message completes once both its send and its receive are posted.
    posted = {k: [0, 0] for k in sent}          # (a, b) -> [sends posted, receives posted]
    pc = [0] * pp
    mine: List[Optional[List[Tuple[Tuple[int, int], int, int]]]] = [None] * pp  # (pair, side, seq)
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(tables[r]):
                a = tables[r][pc[r]]
                if a.kind != "C":
                    pc[r] += 1
                    progress = True
                    continue
                if mine[r] is None:
                    mine[r] = []
                    for c in a.comms:
                        q = peer(r, c)
                        pair, side = ((r, q), 0) if c.op == "send" else ((q, r), 1)
                        mine[r].append((pair, side, posted[pair][side]))
                        posted[pair][side] += 1
                    progress = True
                if all(posted[pair][1 - side] > seq for pair, side, seq in mine[r]):
                    mine[r] = None
                    pc[r] += 1
                    progress = True
                else:
                    break
    stuck = [r for r in range(pp) if pc[r] < len(tables[r])]
    assert not stuck, f"deadlock: ranks {stuck} wait at {[tables[r][pc[r]] for r in stuck]}"


def _backward(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """Backward from `output`, whose data may have been freed after sending (shape check skipped)."""
    if grad is None:
        output.backward()
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)  # keep_graph, create_graph, inputs, unreachable, accumulate


def free_output(t: torch.Tensor) -> None:
    """Megatron's deallocate_output_tensor: keep the autograd node, drop the values."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


@dataclass
class ScheduleStats:
    """Of the last run on this rank."""
    max_live: int = 0             # most micro-batches' activations held at once (all chunks)
    freed: int = 0                # sent activations whose values were freed (graph kept for backward)
    compute_s: float = 0.0        # time in forward/backward compute (timing on)
    total_s: float = 0.0          # wall time of the whole schedule (timing on)


class PipelineSchedule:
    """Runs the forward/backward (or forward-only) schedule of one step on this rank.

    `forward_step(chunk, mb, hidden)` runs chunk `chunk` on micro-batch `mb` (`hidden` is the
    received activation, None at virtual stage 0) and returns the activation to send, or, at
    the last virtual stage, the scalar to backpropagate. `before_backward(chunk, mb, is_last)` is
    called before each backward; `is_last` is True for the last micro-batch of that chunk (the
    ZeRO optimizer starts the gradient sync of the chunk's buckets during that backward).
    """

    def __init__(self, pp_size: int, pp_rank: int, num_chunks: int, tensor_shape: Sequence[int],
                 dtype: torch.dtype, device: torch.device, pp_group=None, next_rank: int = 0, prev_rank: int = 0,
                 timing: bool = False):
        self.pp, self.rank, self.vp = pp_size, pp_rank, num_chunks
        self.shape, self.dtype, self.device = tuple(tensor_shape), dtype, device
        self.group, self.next_rank, self.prev_rank = pp_group, next_rank, prev_rank
        self.timing = timing
        self.stats = ScheduleStats()
        self._tables: Dict[Tuple[int, bool], List[Action]] = {}
        self._warm = pp_size == 1

    @classmethod
    def from_context(cls, ctx, num_chunks: int, tensor_shape: Sequence[int], dtype: torch.dtype,
                     timing: bool = False) -> "PipelineSchedule":
        return cls(ctx.pp_size, ctx.pp_rank, num_chunks, tensor_shape, dtype, ctx.device, ctx.pp_group,
                   ctx.pp_next_rank if ctx.pp_size > 1 else 0, ctx.pp_prev_rank if ctx.pp_size > 1 else 0,
                   timing)

    def table(self, m: int, forward_only: bool) -> List[Action]:
        key = (m, forward_only)
        if key not in self._tables:
            self._tables[key] = build_schedule(self.pp, self.rank, self.vp, m, forward_only)
        return self._tables[key]

    def is_last_stage(self, chunk: int) -> bool:
        return chunk * self.pp + self.rank == self.pp * self.vp - 1

    # -------------------------------------------------------------------------------- p2p
    def _communicate(self, comms: Sequence[Comm], outputs, input_grads, inputs, out_grads, forward_only) -> None:
        if not self._warm:
            # NCCL wants the group's first operation to involve all of its ranks.
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
            self._warm = True
        ops, sent_acts = [], []
        for c in comms:
            key = (c.mb, c.chunk)
            if c.op == "send":
                if c.kind == ACT:
                    t = outputs[key]
                    sent_acts.append(key)
                    peer = self.next_rank
                else:
                    t = input_grads.pop(key)
                    peer = self.prev_rank
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group, _TAGS[c.kind]))
            else:
                t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                (inputs if c.kind == ACT else out_grads)[key] = t
                peer = self.prev_rank if c.kind == ACT else self.next_rank
                ops.append(dist.P2POp(dist.irecv, t, peer, self.group, _TAGS[c.kind]))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for key in sent_acts:
            if forward_only:
                outputs.pop(key)
            else:
                free_output(outputs[key])
                self._freed += 1

    # -------------------------------------------------------------------------------- run
    def run(self, m: int, forward_step: Callable, before_backward: Optional[Callable] = None,
            forward_only: bool = False) -> ScheduleStats:
        inputs: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}
        outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        out_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        input_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        stats = ScheduleStats()
        self._freed = 0
        cuda = self.timing and self.device.type == "cuda"
        events = []
        compute = 0.0
        if self.timing:
            if cuda:
                torch.cuda.synchronize(self.device)
            t_start = time.perf_counter()
        for a in self.table(m, forward_only):
            if a.kind == "C":
                self._communicate(a.comms, outputs, input_grads, inputs, out_grads, forward_only)
                continue
            key = (a.mb, a.chunk)
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            elif self.timing:
                t0 = time.perf_counter()
            if a.kind == "F":
                hidden = inputs.get(key)
                if hidden is not None and not forward_only:
                    hidden.requires_grad_(True)
                with torch.no_grad() if forward_only else torch.enable_grad():
                    out = forward_step(a.chunk, a.mb, hidden)
                if forward_only:
                    inputs.pop(key, None)
                    if not self.is_last_stage(a.chunk):
                        outputs[key] = out
                else:
                    outputs[key] = out
                    stats.max_live = max(stats.max_live, len(outputs))
            else:
                if before_backward is not None:
                    before_backward(a.chunk, a.mb, a.mb == m - 1)
                hidden = inputs.pop(key, None)
                _backward(outputs.pop(key), out_grads.pop(key, None))
                if hidden is not None:
                    input_grads[key] = hidden.grad
            if cuda:
                ev[1].record()
                events.append(ev)
            elif self.timing:
                compute += time.perf_counter() - t0
        assert not outputs and not out_grads and not input_grads, "schedule left tensors behind"
        stats.freed = self._freed
        if self.timing:
            if cuda:
                torch.cuda.synchronize(self.device)
                compute = sum(s.elapsed_time(e) for s, e in events) / 1e3
            stats.compute_s, stats.total_s = compute, time.perf_counter() - t_start
        self.stats = stats
        return stats
