"""Predicted step time of a layout on a machine, from the parts of the step and the machine's measured rates.

Nothing here is fitted to whole training steps: each part is counted from the model's shapes (GEMMs, bytes the
memory-bound kernels move, bytes on the wire) and divided by a primitive rate of the machine file
(`training/hardware/`: GEMM tables by shape, attention, achieved bandwidths, fused AdamW, SDP4Bit kernels,
host launch time, links). Per step:

- each micro-batch's forward and backward on each pipeline stage: the four linears' GEMMs (forward, data and
  weight gradient; bf16 or FP8 by recipe), attention (forward, backward), the memory-bound kernels (norms,
  residual adds, MLP activation, RoPE, FP8 casts and amax passes: `layer_bytes`), under TP the layer's
  collectives (all-reduce, or all-gather / reduce-scatter with sequence parallelism), recomputed forwards;
  the first stage's embedding, the last stage's output layer (bf16) and loss; a micro-batch takes at least the
  host's time to launch its kernels (a step of small kernels waits for the host), and each kernel leaves a
  short gap on the GPU;
- the pipeline: m micro-batches on the slowest stage plus the warm-up and cool-down, (pp - 1) / vp of a
  micro-batch (the bubble of `training.schedule.bubble_theory`), and the activations sent between stages;
- data-parallel sync per bucket, in the order the loop issues it (`optim/distributed.py`): with
  --overlap-grad-reduce each bucket's reduce-scatter starts when the last micro-batch's backward has produced
  its gradients, one after another on the link, and only what runs past the backward is exposed; with
  --overlap-param-gather each bucket's all-gather is waited for just before the next forward needs it; without
  the flags (and for the non-sharded optimizer's all-reduce) all of it is exposed. Bytes per bucket are the
  communication layer's own counts (plain, qWD, TLq-HS two-level), plus the SDP4Bit kernels. A transfer that
  overlaps compute still slows it by (1 - the link's `overlap`) of its time (NCCL's kernels share the GPU);
- the optimizer step: the fused AdamW over this rank's elements for its moment format, the gradient norm's
  read of the gradients, and the FP8 weight copies remade once per step (or cast at each use).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..comm.plain import ring_all_reduce_bytes, ring_shard_bytes
from ..comm.sdp4bit import SDP4BitComm
from ..config import MegacoatConfig, num_microbatches, resolve_model_defaults
from ..model.flops import flops_per_token
from ..model.gpt import padded_vocab_size
from ..model.recompute import RecomputePlan
from ..model.stages import stage_layers
from ..parallel.context import ParallelContext
from ..precision.recipe import keep_fp8_weights
from .hardware import GBPS_PER_GBYTE, Hardware, Link
from .planner import COMM_OPTIONS, RankPlan, fp8_copies_fit, peak_estimate

NO_ZERO = "all-reduce (no ZeRO)"

# Kernels per layer and micro-batch (forward, backward) of each recipe, compiled layers: counted in the 1.36B
# kernel census (benchmarks/profile_step.py --kernels; 2026-12-02_kernel-census-swiglu_h200, 1,272 kernels per
# bf16 step, 1,901 per coat step, forward / optimizer vs backward threads). tensorwise adds to bf16 an amax pass
# and a cast per linear input and output gradient (not profiled). Kernels outside the layers: about 100 a step.
KERNELS_PER_LAYER = {"bf16": (18, 31), "fp32": (18, 31), "tensorwise": (25, 38), "coat": (31, 44)}
KERNELS_PER_STEP = 100


@dataclass(frozen=True)
class Methods:
    """What the run computes with: recipe, optimizer-state format, gradient dtype, data-parallel option."""

    recipe: str            # bf16 | fp32 | tensorwise | coat
    moments: Tuple[str, str]
    grad_dtype: str        # fp32 | bf16
    comm: str              # planner.COMM_OPTIONS key, or NO_ZERO
    fp8_copies: bool       # FP8 weight copies kept for the step (else cast at each use)

    @property
    def fp8(self) -> bool:
        return self.recipe in ("tensorwise", "coat")

    @property
    def memory_format(self) -> str:
        """The planner's optimizer-state key (planner.STATE_FORMATS; mixed moment formats count as the larger)."""
        order = ["fp8", "bf16", "fp32"]
        return max(self.moments, key=order.index)


def methods_of(cfg: MegacoatConfig, dp: int) -> Methods:
    p, o, pr, t = cfg.parallel, cfg.optim, cfg.precision, cfg.train
    recipe = pr.fp8_recipe if pr.fp8_format else ("fp32" if t.fp32 else "bf16")
    moments = (o.exp_avg_dtype, o.exp_avg_sq_dtype) if o.use_precision_aware_optimizer else ("fp32", "fp32")
    comm = NO_ZERO if not p.use_distributed_optimizer else \
        {v: k for k, v in COMM_OPTIONS.items()}[(cfg.comm.quantized_weights, cfg.comm.quantized_gradients)]
    copies = recipe in ("tensorwise", "coat") and keep_fp8_weights(pr.fp8_weight_cache, num_microbatches(cfg, dp),
                                                                     p.overlap_param_gather)
    return Methods(recipe, moments, "bf16" if p.grad_reduce_in_bf16 else "fp32", comm, copies)


@dataclass
class StepTime:
    seconds: float
    parts: Dict[str, float]          # where the step's time goes (seconds; they add up to `seconds`)
    tokens_per_step: int
    world: int
    model_flops_per_gpu: float       # per step (model/flops.py), for MFU
    peak_tflops: float
    peak_format: str
    comm_detail: Dict[str, float] = field(default_factory=dict)  # total transfer time per kind, hidden or not
    host_bound: bool = False          # a micro-batch waits for the host's kernel launches

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.seconds / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops_per_gpu / self.seconds / (self.peak_tflops * 1e12)


# ----------------------------------------------------------------------------------------------- layer parts
@dataclass(frozen=True)
class Shape:
    """One layer's widths as one TP rank computes them."""

    hidden: int
    q: int            # query width (heads x head dim), TP-local
    kv: int           # key/value width each, TP-local
    ffn: int          # MLP hidden, TP-local
    mlp_in: int       # fc1's output width, TP-local (2 ffn for SwiGLU)
    seq: int
    tp: int
    sp: bool
    swiglu: bool
    dropout: bool


def layer_shape(cfg: MegacoatConfig, tp: int) -> Shape:
    m = cfg.model
    resolve_model_defaults(m)
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    swiglu = m.activation == "swiglu"
    return Shape(m.hidden_size, q // tp, kv // tp, m.ffn_hidden_size // tp,
                 (2 if swiglu else 1) * m.ffn_hidden_size // tp, m.seq_length, tp, cfg.parallel.sequence_parallel,
                 swiglu, m.hidden_dropout > 0)


def linears(s: Shape) -> Dict[str, Tuple[int, int]]:
    """(input width, output width) of each linear on one TP rank."""
    return {"qkv": (s.hidden, s.q + 2 * s.kv), "proj": (s.q, s.hidden), "fc1": (s.hidden, s.mlp_in),
            "fc2": (s.ffn, s.hidden)}


def gemm_seconds(hw: Hardware, fmt: str, s: Shape, tokens: int) -> Tuple[float, float]:
    """(forward, backward) seconds of the layer's GEMMs for `tokens` tokens: y = x W^T, dx = dy W, dW = dy^T x."""
    fwd = bwd = 0.0
    for kin, kout in linears(s).values():
        fwd += hw.gemm_seconds(fmt, tokens, kout, kin)
        bwd += hw.gemm_seconds(fmt, tokens, kin, kout) + hw.gemm_seconds(fmt, kout, kin, tokens)
    return fwd, bwd


def attention_seconds(hw: Hardware, s: Shape, tokens: int) -> Tuple[float, float]:
    """Causal fused attention (FLOPs as model/flops.py: 2 seq width per token forward, twice that backward)."""
    fwd_flops = 2.0 * s.seq * s.q * tokens
    return (fwd_flops / (hw.attention_tflops["forward"] * 1e12),
            2 * fwd_flops / (hw.attention_tflops["backward"] * 1e12))


def layer_bytes(recipe: str, s: Shape) -> Dict[str, Tuple[float, float]]:
    """Bytes per token the layer's memory-bound kernels move on one TP rank: kernel class ("elementwise": the
    compiled layer's norms, adds, activation, RoPE, dropout; "cast": FP8 casts and amax passes and COAT's fused
    FP8 norm / activation kernels) -> (forward, backward).

    Per token, h hidden, q / kv / f / mlp_in TP-local widths; norm and residual terms are divided by TP under
    sequence parallelism (replicated otherwise), a linear's FP8 input is cast on the whole sequence.
    - bf16 / fp32 / tensorwise (e bytes per element): forward norm 2h, add + norm 4h, residual add 3h, RoPE over
      q, k, v 2(q + 2kv), activation 3f (SwiGLU) or 2f; backward both norms with their residual gradients 10h,
      RoPE 2(q + 2kv), activation 5f or 3f (all times e). Dropout: 2 e + 1 (mask) per element and direction, twice.
    - tensorwise adds an amax pass and a cast with transposed copy per GEMM input (6 bytes per element), except
      the QKV output gradient whose amax RoPE hands over (4).
    - coat: norms read the stream and the pending residual branch and write the stream, y (bf16) and x in 1x16
      FP8 (9.125h), backward 7.125h each; linear inputs cast given their amax (4 per element; the projection's
      input needs its amax pass: 6), output gradients given the residual add's token (4); SwiGLU forward reads
      gate and up, writes the product and both in 1x16 (8.25f), backward straight to E5M2 in both layouts (12.5
      per element pair); RoPE as bf16, its output gradient cast (4 (q + 2kv)).
    The per-byte rates these are divided by were measured on the same kernels (hardware file `bandwidth_GBps`)."""
    h, q, kv, f, mi = s.hidden, s.q, s.kv, s.ffn, s.mlp_in
    rep = 1.0 / s.tp if s.sp else 1.0   # norms / residual adds: sequence-sharded under SP
    qkv = q + 2 * kv
    if recipe == "coat":
        cast_f = 2 * 9.125 * h * rep + 4 * h + 6 * q + (8.25 * f if s.swiglu else 6.125 * f) + 4 * f + 4 * h
        cast_b = 2 * 7.125 * h * rep + 4 * h + 4 * h + (12.5 * f if s.swiglu else 7 * f) + 4 * qkv
        return {"elementwise": (2 * qkv * 2.0, 2 * qkv * 2.0), "cast": (cast_f, cast_b)}
    e = 4.0 if recipe == "fp32" else 2.0
    act_f, act_b = (3 * f, 5 * f) if s.swiglu else (2 * f, 3 * f)
    drop = 2 * (2 * e + 1) * h * rep if s.dropout else 0.0
    ew = ((9 * h * rep + 2 * qkv + act_f) * e + drop, (10 * h * rep + 2 * qkv + act_b) * e + drop)
    out = {"elementwise": ew, "cast": (0.0, 0.0)}
    if recipe == "tensorwise":
        out["cast"] = (6 * h + 6 * q + 6 * h + 6 * f, 6 * h + 6 * mi + 6 * h + 4 * qkv)
    return out


def tp_layer_seconds(link: Link, s: Shape, tokens: int, elem: int) -> Tuple[float, float]:
    """The layer's TP collectives (forward, backward): with SP an all-gather before QKV and fc1 and a
    reduce-scatter after the projection and fc2 (each way); without, two all-reduces each way."""
    if s.tp == 1:
        return 0.0, 0.0
    n = tokens * s.hidden
    if s.sp:
        one = link.seconds(ring_shard_bytes(n, elem, s.tp), s.tp - 1)
        return 4 * one, 4 * one
    one = link.seconds(ring_all_reduce_bytes(n, elem, s.tp), 2 * (s.tp - 1))
    return 2 * one, 2 * one


# ------------------------------------------------------------------------------------------------ the step
@dataclass
class MicroBatch:
    """One micro-batch on one pipeline stage (all its chunks): seconds per part, and its kernel count."""

    parts: Dict[str, float]
    forward: float       # GPU seconds of the forward (recomputation excluded)
    backward: float      # GPU seconds of the backward (its recomputation included)
    kernels: int

    @property
    def gpu(self) -> float:
        return self.forward + self.backward


def ranks_per_node(cfg: MegacoatConfig, world: int) -> int:
    """--ranks-per-node, else every rank on one node (as the launcher's default)."""
    return cfg.parallel.ranks_per_node or cfg.parallel.world_size or world


def _tp_link(hw: Hardware, tp: int, world: int, rpn: int) -> Link:
    """The link of the TP collectives: TP groups are tp consecutive ranks, so one that a node boundary splits
    (TP over the node, or a node size TP does not divide, e.g. TP 4 on 6 GPUs a node) runs at the inter-node
    rate, and every layer waits for it."""
    across = any(g // rpn != (g + tp - 1) // rpn for g in range(0, world, tp))
    return hw.links["inter_node" if across else "intra_node"]


def _pp_link(hw: Hardware, world: int, pp: int, pp_rank: int, vp: int, rpn: int) -> Link:
    """The link of a stage's sends (activations to the next stage, gradients to the previous; interleaved, the
    last stage also feeds the first). Stages are blocks of world / pp consecutive ranks, so a hop crosses nodes
    wherever a node boundary falls between the two blocks, even when the blocks are smaller than a node; the
    stage waits for its slowest rank."""
    block = world // pp
    peers = {(pp_rank + d) % pp for d in (-1, 1)} if vp > 1 else \
        {r for r in (pp_rank - 1, pp_rank + 1) if 0 <= r < pp}
    across = block >= rpn or any((pp_rank * block + j) // rpn != (q * block + j) // rpn
                                 for q in peers for j in range(block))
    return hw.links["inter_node" if across else "intra_node"]


def micro_batch_on_stage(cfg: MegacoatConfig, hw: Hardware, methods: Methods, tp: int, pp_rank: int,
                         padded_vocab: int) -> MicroBatch:
    p, t = cfg.parallel, cfg.train
    s = layer_shape(cfg, tp)
    tokens = t.micro_batch_size * s.seq
    fmt = "fp8" if methods.fp8 else "bf16"
    kinds = layer_bytes(methods.recipe, s)
    g_f, g_b = gemm_seconds(hw, fmt, s, tokens)
    a_f, a_b = attention_seconds(hw, s, tokens)
    m_f = sum(hw.memory_seconds(tokens * v[0], k) for k, v in kinds.items())
    m_b = sum(hw.memory_seconds(tokens * v[1], k) for k, v in kinds.items())
    world = p.world_size or tp * p.pipeline_model_parallel_size
    rpn = ranks_per_node(cfg, world)
    elem = 4 if methods.recipe == "fp32" else 2
    c_f, c_b = tp_layer_seconds(_tp_link(hw, tp, world, rpn), s, tokens, elem)
    pp = p.pipeline_model_parallel_size
    chunks = stage_layers(cfg.model.num_layers, pp, p.num_layers_per_virtual_pipeline_stage,
                          p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)[pp_rank]
    vp = len(chunks)
    layers = sum(len(c) for c in chunks)
    full = selective = 0
    for c in chunks:
        plan = RecomputePlan.from_flags(t.recompute_granularity, t.recompute_method, t.recompute_num_layers, len(c))
        if plan is None:
            continue
        if plan.granularity == "selective":
            selective += len(c)
        else:
            full += sum(len(g) for r, g in plan.layer_groups(c) if r)
    layer_f = g_f + a_f + m_f + c_f
    parts = {"GEMMs": layers * (g_f + g_b), "attention": layers * (a_f + a_b),
             "memory-bound kernels": layers * (m_f + m_b), "TP communication": layers * (c_f + c_b),
             "recomputation": full * layer_f + selective * a_f}
    k_f, k_b = KERNELS_PER_LAYER[methods.recipe]
    kernels = layers * (k_f + k_b) + full * k_f
    h = cfg.model.hidden_size
    vocab = padded_vocab // tp
    first = any(c * pp + pp_rank == 0 for c in range(vp))
    last = any(c * pp + pp_rank == pp * vp - 1 for c in range(vp))
    ends = 0.0
    if first:  # the embedding's gather and its gradient's scatter-add (fp32 accumulation)
        ends += hw.memory_seconds(tokens * h * (2 * 2 + 2 + 4))
    if last:   # final norm, output layer (bf16 GEMMs also under FP8) and the loss
        ends += hw.memory_seconds(tokens * h * 2 * (2 + 5))
        ends += hw.gemm_seconds("bf16", tokens, vocab, h) + hw.gemm_seconds("bf16", tokens, h, vocab) + \
            hw.gemm_seconds("bf16", vocab, h, tokens)
        fused = cfg.precision.cross_entropy_loss_fusion is not False
        ends += hw.memory_seconds(tokens * vocab * (6 if fused else 36))
    parts["embedding, output layer, loss"] = ends
    if methods.fp8 and not methods.fp8_copies:  # weights cast at each use: W forward, W^T backward
        weights = layers * sum(a * b for a, b in linears(s).values())
        parts["FP8 weight casts"] = hw.memory_seconds(8.0 * weights, "cast")
    if pp > 1:  # activations to the next stage, gradients back, per chunk
        act = tokens * h * elem // (tp if s.sp else 1)
        link = _pp_link(hw, world, pp, pp_rank, vp, rpn)
        parts["PP sends"] = vp * 2 * link.seconds(act, 1)
    fwd = layers * layer_f + (ends / 3)
    total = sum(parts.values())
    return MicroBatch(parts, fwd, total - fwd, kernels)


def _zero_ctx(dp: int, rpn: int, tp: int) -> ParallelContext:
    """The data-parallel coordinates the SDP4Bit byte counts read (no groups)."""
    local = max(1, min(dp, rpn // tp)) if rpn >= tp else 1
    while dp % local:
        local -= 1
    return ParallelContext(dp_size=dp, dp_rank=dp - 1, dp_intra_size=local, dp_inter_size=dp // local, tp_size=tp)


@dataclass
class BucketComm:
    """One bucket's gradient and parameter sync (seconds on the link, kernels included)."""

    grad: float
    param: float


def bucket_comm(cfg: MegacoatConfig, hw: Hardware, methods: Methods, buckets: Sequence[int], dp: int, tp: int
                ) -> Tuple[List[BucketComm], Dict[str, float]]:
    """Per bucket (in the buffer's order: backward order) the sync time for this option, and the total bytes
    per kind (the communication layer's counts, equal to the dry run's `comm`)."""
    if dp == 1:
        return [BucketComm(0.0, 0.0) for _ in buckets], {}
    rpn = ranks_per_node(cfg, dp * tp)
    ctx = _zero_ctx(dp, rpn, tp)
    L, N = ctx.dp_intra_size, ctx.dp_inter_size
    intra, inter = hw.links["intra_node"], hw.links["inter_node"]
    ring = inter if N > 1 else intra
    grad_elem = 2 if methods.grad_dtype == "bf16" else 4
    param_elem = 4 if methods.recipe == "fp32" else 2
    k = hw.sdp4bit_ms_per_256M
    kernel = lambda name, n: n / 2**28 * k[name] * 1e-3  # noqa: E731
    totals: Dict[str, float] = {}
    out = []
    if methods.comm == NO_ZERO:
        for n in buckets:
            b = ring_all_reduce_bytes(n, grad_elem, dp)
            totals["grad"] = totals.get("grad", 0) + b
            out.append(BucketComm(ring.seconds(b, 2 * (dp - 1)), 0.0))
        return out, totals
    qw, qg = COMM_OPTIONS[methods.comm]
    c = dataclasses.replace(cfg.comm, quantized_weights=qw, quantized_gradients=qg)
    sdp = SDP4BitComm(c, ctx, None, 0)
    for n in buckets:
        shard = n // dp
        if qg:
            wire = sdp.grad_wire_bytes(shard)
            g = intra.seconds(wire["grad_intra"], 1) if wire["grad_intra"] else 0.0
            g += inter.seconds(wire["grad_inter"], 1) if wire["grad_inter"] else 0.0
            g += kernel("tlq_encode", n) + kernel("tlq_reduce_decode", 2 * (N * shard if L > 1 else n))
            if L > 1 and N > 1:
                g += kernel("tlq_reduce_requantize", n)
        else:
            wire = {"grad": ring_shard_bytes(n, grad_elem, dp)}
            g = ring.seconds(wire["grad"], dp - 1)
        for kind, v in wire.items():
            totals[kind] = totals.get(kind, 0) + v
        if qw:
            pb = sdp.param_wire_bytes(shard)
            prm = ring.seconds(pb, dp - 1) + kernel("qwd_encode", shard) + kernel("qwd_apply", n)
        else:
            pb = ring_shard_bytes(n, param_elem, dp)
            prm = ring.seconds(pb, dp - 1)
        totals["param"] = totals.get("param", 0) + pb
        out.append(BucketComm(g, prm))
    return out, totals


def exposed_behind(ready: Sequence[float], durations: Sequence[float], window: float) -> Tuple[float, float]:
    """Transfers issued one after another on one link, transfer i not before `ready[i]`, all wanted by `window`:
    (seconds past the window, seconds that ran within it)."""
    end = 0.0
    for r, d in zip(ready, durations):
        end = max(end, r) + d
    exposed = max(0.0, end - window)
    return exposed, sum(durations) - exposed


def exposed_before_use(needed: Sequence[float], durations: Sequence[float]) -> Tuple[float, float]:
    """Transfers issued back to back at time 0, transfer i needed by the forward at `needed[i]` (compute time
    before its first use): the forward stalls for whatever is not done; (stall seconds, seconds overlapped)."""
    end, stall = 0.0, 0.0
    for n, d in zip(needed, durations):
        end += d
        stall = max(stall, end - n)
    return stall, sum(durations) - stall


def _stage_plan(plans: Sequence[RankPlan], pp_rank: int) -> RankPlan:
    return max((pl for pl in plans if pl.pp_rank == pp_rank), key=lambda pl: pl.ranks[-1])


def predict(cfg: MegacoatConfig, world: int, plans: Sequence[RankPlan], hw: Hardware, vocab_size: int,
            methods: Optional[Methods] = None, cache: Optional[dict] = None) -> StepTime:
    """The step time of `cfg` over `world` ranks. `plans`: the planner's plans of (at least) one rank per
    pipeline stage (planner.plan_run, or planner.plan_stages), for buckets and shard sizes. `cache`: a dict kept
    between calls of one search on one machine (stage and bucket timings that do not change between layouts)."""
    p, t = cfg.parallel, cfg.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = world // (tp * pp)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(p, world_size=world))
    p = cfg.parallel
    methods = methods or methods_of(cfg, dp)
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    m = num_microbatches(cfg, dp)
    rpn = ranks_per_node(cfg, world)
    if methods.fp8 and methods.fp8_copies and cfg.precision.fp8_weight_cache == "auto":
        # auto keeps the copies only where the step's estimated peak with them fits (trainer._fit_fp8_weight_copies)
        fits = all(fp8_copies_fit(peak_estimate(pl, methods.memory_format, methods.recipe), hw.usable_bytes)
                   for pl in plans)
        methods = dataclasses.replace(methods, fp8_copies=fits)
    cache = {} if cache is None else cache
    key = (world, rpn, repr(cfg.model), t.micro_batch_size, t.recompute_granularity, t.recompute_method,
           t.recompute_num_layers, tp, pp, p.sequence_parallel, p.num_layers_per_virtual_pipeline_stage,
           p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers,
           cfg.precision.cross_entropy_loss_fusion, methods.recipe, methods.fp8_copies)
    stages = [_cached(cache, ("stage", r) + key, lambda r=r: micro_batch_on_stage(cfg, hw, methods, tp, r, padded))
              for r in range(pp)]
    host_bound = False
    per_mb = []
    for mb in stages:
        launch = mb.kernels * hw.launch_us * 1e-6
        busy = mb.gpu + mb.kernels * hw.kernel_gap_us * 1e-6
        host_bound |= launch > busy
        per_mb.append(max(busy, launch))
    slowest, mean = max(per_mb), sum(per_mb) / pp
    vp = len(stage_layers(cfg.model.num_layers, pp, p.num_layers_per_virtual_pipeline_stage,
                          p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)[0])
    pipeline = m * slowest + (pp - 1) * mean / vp
    parts: Dict[str, float] = {}
    s = stages[per_mb.index(slowest)]
    for k, v in s.parts.items():
        parts[k] = parts.get(k, 0.0) + m * v
    parts["kernel gaps and host launches"] = m * (slowest - s.gpu)
    parts["pipeline bubble"] = pipeline - m * slowest
    # Per stage: data-parallel sync and the optimizer step; the step ends with the slowest stage.
    tail, detail = 0.0, {}
    worst, seen = None, set()
    for r, mb in enumerate(stages):
        pl = _stage_plan(plans, r)
        key = (tuple(pl.buckets), pl.params, pl.layers, mb.forward, mb.backward)
        if key in seen:  # the middle stages of a pipeline are alike
            continue
        seen.add(key)
        extra = _stage_tail(cfg, hw, methods, pl, mb, dp, tp, pp, m, cache)
        total = sum(extra[0].values())
        if worst is None or total > tail:
            tail, worst, detail = total, extra[0], extra[1]
    for k, v in worst.items():
        parts[k] = parts.get(k, 0.0) + v
    parts = {k: v for k, v in parts.items() if v > 0}
    seconds = sum(parts.values())
    tokens = t.global_batch_size * cfg.model.seq_length
    flops = flops_per_token(cfg.model, padded, cfg.model.seq_length) * tokens / world
    fmt = "fp8" if methods.fp8 else "bf16"
    return StepTime(seconds, parts, tokens, world, flops, hw.peak_tflops[fmt], fmt, detail, host_bound)


def _cached(cache: dict, key: tuple, compute):
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _stage_tail(cfg: MegacoatConfig, hw: Hardware, methods: Methods, pl: RankPlan, mb: MicroBatch, dp: int,
                tp: int, pp: int, m: int, cache: dict) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(exposed data-parallel sync and optimizer seconds of one stage, total transfer seconds per kind)."""
    p = cfg.parallel
    zero = methods.comm != NO_ZERO
    rpn = ranks_per_node(cfg, dp * tp * pp)
    comms, _ = _cached(cache, ("buckets", tuple(pl.buckets), methods.comm, methods.grad_dtype, methods.recipe, dp,
                                tp, rpn, repr(cfg.comm)),
                       lambda: bucket_comm(cfg, hw, methods, pl.buckets, dp, tp))
    L = _zero_ctx(dp, rpn, tp).dp_intra_size
    link = hw.links["inter_node" if dp > L else "intra_node"]
    grads = [c.grad for c in comms]
    params = [c.param for c in comms]
    out: Dict[str, float] = {}
    if zero and p.overlap_grad_reduce and sum(grads):
        # Buckets are in backward order; each is ready once the backward has produced its share of gradients.
        total = sum(pl.buckets)
        done, ready = 0, []
        for n in pl.buckets:
            done += n
            ready.append(mb.backward * done / total)
        exposed, hidden = exposed_behind(ready, grads, mb.backward)
        exposed += (1 - link.overlap) * hidden
    else:
        exposed = sum(grads)
    out["DP gradient sync (exposed)"] = exposed
    if zero and p.overlap_param_gather and sum(params):
        # Issued after the step from the last bucket (the first layers) on; bucket i is needed once the
        # forward has run the layers before it.
        total = sum(pl.buckets)
        order = list(reversed(range(len(params))))
        done, needed = 0, []
        for i in order:
            needed.append(mb.forward * done / total)
            done += pl.buckets[i]
        stall, hidden = exposed_before_use(needed, [params[i] for i in order])
        exposed_p = stall + (1 - link.overlap) * hidden
    else:
        exposed_p = sum(params)
    out["DP parameter sync (exposed)"] = exposed_p
    # The optimizer step on this rank's elements (ZeRO: its shard of every bucket).
    elements = sum(n // dp for n in pl.buckets) if zero else pl.params
    mom = methods.moments
    step = sum(hw.optimizer_seconds(elements, f, methods.grad_dtype) for f in mom) / 2
    grad_elem = 2 if methods.grad_dtype == "bf16" else 4
    norm_hidden = not zero and dp == 1 and not (tp > 1 and p.sequence_parallel)  # grad_norm_overlap.py
    norm = 0.0 if norm_hidden else hw.memory_seconds(elements * grad_elem)
    refresh = 0.0
    if methods.fp8 and methods.fp8_copies:  # W and W^T remade once per step from the new weights
        s = layer_shape(cfg, tp)
        refresh = hw.memory_seconds(6.0 * pl.layers * sum(a * b for a, b in linears(s).values()), "cast")
    out["optimizer step"] = step + norm + refresh
    detail = {"DP gradient sync": sum(grads), "DP parameter sync": sum(params)}
    return out, detail


def format_step_time(st: StepTime, hw: Hardware) -> str:
    inter = hw.links["inter_node"].bus_GBps * GBPS_PER_GBYTE
    lines = [f"predicted step on {hw.name} (inter-node {inter:.0f} Gb/s per GPU; an estimate, docs/planner.md): "
             f"{st.seconds * 1e3:.1f} ms | {st.tokens_per_s_per_gpu:,.0f} tokens/s per GPU | MFU {st.mfu:.1%} of "
             f"{st.peak_tflops:.0f} TFLOP/s ({st.peak_format})"
             + (" | host-bound: the GPU waits for kernel launches" if st.host_bound else "")]
    lines.append("  where the time goes: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms ({v / st.seconds:.0%})" for k, v in st.parts.items()))
    if st.comm_detail and any(st.comm_detail.values()):
        lines.append("  data-parallel transfers per step, hidden or not: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in st.comm_detail.items()))
    return "\n".join(lines)
