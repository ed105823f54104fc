"""`--dry-run`: plan a run without GPUs and without starting its ranks.

For every position of the rank grid (pipeline stage x tensor-parallel rank; data-parallel ranks
of one position hold equal-sized shards), the real model and optimizer are built on the meta
device under a fake process group of `--world-size` ranks: the layout, the buffers, buckets and
shards are the ones a real run makes, so are the configuration errors. Reported per rank:

- model-state memory: weights, gradients, fp32 master weights, optimizer states for each state
  format (fp32, bf16, COAT fp8 with group statistics), as the optimizer allocates them;
- an activation estimate per micro-batch for each precision recipe (bf16, FP8 tensorwise, COAT);
  see `activation_bytes_per_token_layer` for the model (an estimate, not an allocation);
- bytes this rank sends per step for data-parallel gradient and parameter sync, for plain and
  each SDP4Bit option, from the same formulas the communication layer counts with;
- the step time predicted on the machine of --hardware (training/step_time.py).
`plan_stages` plans one rank per pipeline stage only (the layout search of tools/plan.py).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm.plain import ring_all_reduce_bytes, ring_shard_bytes
from ..comm.sdp4bit import SDP4BitComm
from ..config import ConfigError, MegacoatConfig, num_microbatches, validate_config
from ..model.gpt import padded_vocab_size
from ..model.recompute import RecomputePlan
from ..model.stages import build_model_chunks, stage_layers
from ..model.transformer import LayerContext
from ..optim.buffers import ParamGradBuffer, grad_bucket_layout, shard_alignment
from ..optim.factory import DEFAULT_BUCKET_ELEMENTS, build_optimizer
from ..parallel.context import ParallelContext, dp_groups_split_evenly
from ..precision.linear import fp8_weight_copy_bytes
from ..precision.recipe import resolve_precision

META = torch.device("meta")
STATE_FORMATS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8")}
COMM_OPTIONS = {  # name -> (quantized_weights, quantized_gradients); only with --use-distributed-optimizer
    "plain": (False, False), "qWD": (True, False), "TLq-HS": (False, True), "qWD+TLq-HS": (True, True)}


@dataclass
class RankPlan:
    ranks: List[int]                      # the global ranks of this grid position (one per DP rank)
    pp_rank: int
    tp_rank: int
    params: int                           # parameters held by each of these ranks (TP/PP-local)
    layers: int
    weights: int                          # bytes
    grads: int
    master: Dict[str, int]                # optimizer-state format -> bytes of fp32 master weights
    states: Dict[str, int]                # optimizer-state format -> bytes of the moments
    activations: Dict[str, int]           # recipe -> bytes per micro-batch (estimate)
    in_flight: int                        # micro-batches whose activations a stage holds at once (1F1B)
    comm: Dict[str, Dict[str, int]]       # option -> kind -> bytes sent per step
    buckets: List[int] = field(default_factory=list)  # bucket sizes (elements)
    fp8_weight_copies: int = 0            # bytes of kept FP8 weight copies (W and W^T, --fp8-weight-cache)
    # The non-sharded optimizer's gradient buckets exist only from their first backward to the step's end
    # (optim.buffers.GradBuffer release_between_steps); ZeRO's stay.
    grads_released: bool = False
    micro_batches: int = 1                # per step
    backward_activations: Dict[str, int] = field(default_factory=dict)  # recipe -> bytes alive in the first layers' backward
    loss: int = 0                         # last stage: the loss's peak bytes per micro-batch (loss_bytes_per_token)


def activation_bytes_per_token_layer(hidden: int, ffn: int, kv_hidden: int, recipe: str, tp: int,
                                     sequence_parallel: bool, activation: str = "swiglu") -> float:
    """Bytes saved for backward per token by one transformer layer (an estimate).

    Saved per token (h hidden, f ffn, kv key/value width), bf16 = 2 bytes per element:
      norm1 input h, norm1 output h (QKV GEMM input), q h + k kv + v kv and the attention output h (the
      attention's own backward keeps all four in bf16; flash / SDPA saves no s x s matrix), norm2 input h, norm2
      output h (MLP GEMM input), MLP: gate f + up f + product f (SwiGLU) or pre-activation f + activation f
      (GELU). GEMM inputs (norm outputs, product) are FP8 (1 byte) under tensorwise and coat; coat also keeps
      norm inputs, gate and up in FP8 with one bf16 scale per 16 values (COAT's 1x16 groups) and saves the projection's
      input as its own transposed FP8 copy next to the attention's bf16 output (bf16 and tensorwise save that
      one tensor for both). Under TP the attention and MLP parts are split over ranks; the norm / residual parts
      too with sequence parallelism. Coat's terms were checked against what its layer saves (saved-tensor hooks
      on the CPU: within 24 bytes per token, the logsumexp and rstd) and against H200 peaks at 7B micro-batch 2,
      7 and 8 (without the attention output, or with the scales miscounted, the estimate is 0.5-2.4 GiB low).
    """
    mlp = 3 * ffn if activation == "swiglu" else 2 * ffn
    fp8 = recipe in ("tensorwise", "coat")
    grouped = 1 + 2 / 16  # FP8 1x16 with a bf16 scale per group (fp8.quantize_groupwise)
    gemm_in = 1 if fp8 else 2
    norm_in = grouped if recipe == "coat" else 2
    mlp_pointwise = grouped if recipe == "coat" else 2
    projection_copy = hidden if recipe == "coat" else 0  # coat's FP8 x^T of the attention output
    replicated = 2 * norm_in * hidden + 2 * gemm_in * hidden          # norm inputs, norm outputs
    split = (2 * (2 * hidden + 2 * kv_hidden) + projection_copy         # q, k, v, attention output
             + mlp_pointwise * (mlp - ffn) + gemm_in * ffn)             # gate/up (pre-act) ; down input
    return replicated / (tp if sequence_parallel else 1) + split / tp


def loss_bytes_per_token(vocab_local: int, itemsize: int, fused: bool) -> int:
    """The loss's peak bytes per token (last PP stage), at the start of its backward: the logits saved for
    backward and their gradient (parallel/cross_entropy.py), plus the fp32 working copy of the logits where
    the fused kernels do not run (CPU, --no-cross-entropy-loss-fusion)."""
    return vocab_local * (2 * itemsize + (0 if fused else 4))


def _recompute_totals(cfg: MegacoatConfig, chunks, per_layer: float, tp: int, recipe: str):
    """(activation bytes per token over this rank's layers, layers of the largest recomputed group).
    --recompute-granularity full keeps only the input of each recomputed group (bf16, sequence-sharded under SP;
    under coat two tensors after a chunk's first group: the previous layer's deferred stream and MLP output)
    plus, during backward, one group's full activations; other layers keep everything (selective: the estimate
    does not change, the attention core saves no s x s matrix with SDPA / flash attention)."""
    t = cfg.train
    total, largest = 0.0, 0
    for chunk in chunks:
        plan = RecomputePlan.from_flags(t.recompute_granularity, t.recompute_method, t.recompute_num_layers,
                                        len(chunk.layers))
        if plan is None or plan.granularity != "full":
            total += per_layer * len(chunk.layers)
            continue
        for i, (recomputed, group) in enumerate(plan.layer_groups(chunk.layers)):
            if recomputed:
                inputs = 2 if recipe == "coat" and i > 0 else 1
                total += inputs * 2 * cfg.model.hidden_size / (tp if cfg.parallel.sequence_parallel else 1)
                largest = max(largest, len(group))
            else:
                total += per_layer * len(group)
    return total + per_layer * largest, largest


def _layers_of(chunks) -> int:
    return sum(len(c.layers) for c in chunks if hasattr(c, "layers"))


def _fake_group(rank: int, world: int) -> None:
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - torch < 2.1
        raise ConfigError("--dry-run needs torch's fake process group (torch >= 2.1).") from e
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def _tensor_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _state_bytes(opt) -> int:
    """Bytes of the optimizer's moment states as allocated (tensors of its codec)."""
    codec = opt.codec
    if hasattr(codec, "m"):  # flat codec: MomentState m, v (data + fp8 group statistics)
        return sum(_tensor_bytes(getattr(s, a)) for s in (codec.m, codec.v) for a in ("data", "s", "k", "c"))
    return sum(_tensor_bytes(st["exp_avg"]) + _tensor_bytes(st["exp_avg_sq"]) for st in codec.opt.state.values())


def _master_bytes(opt) -> int:
    if getattr(opt, "master_flat", None) is not None:
        return _tensor_bytes(opt.master_flat)
    ids = {id(p) for p in opt.params}
    return sum(_tensor_bytes(m) for m in opt.masters if id(m) not in ids)


def _grad_bytes(opt) -> int:
    if hasattr(opt, "buffer"):
        return _tensor_bytes(opt.buffer.grad_data)
    return sum(b.numel() * b.element_size() for b in opt.grad_buffer.buckets)


def _weight_bytes(opt) -> int:
    if hasattr(opt, "buffer"):
        return _tensor_bytes(opt.buffer.param_data)
    return sum(_tensor_bytes(p) for p in opt.params)


def _buffer_layout(opt) -> dict:
    """RankPlan's fields for the optimizer's parameter and gradient buffers (the same for every state format)."""
    return dict(weights=_weight_bytes(opt), grads=_grad_bytes(opt),
                buckets=[b.numel for b in opt.buffer.buckets] if hasattr(opt, "buffer") else
                [b.numel() for b in opt.grad_buffer.buckets],
                grads_released=hasattr(opt, "grad_buffer") and opt.grad_buffer.release_between_steps)


def step_activations(cfg: MegacoatConfig, ctx: ParallelContext, chunks, padded_vocab: int, params_dtype: torch.dtype,
                     target: torch.device) -> dict:
    """RankPlan's activation fields for this rank's model chunks: per recipe the bytes saved per micro-batch and
    those alive in the first layers' backward, micro-batches in flight, the loss's bytes, layers."""
    m, p = cfg.model, cfg.parallel
    kv = m.num_query_groups * m.kv_channels
    tokens = cfg.train.micro_batch_size * m.seq_length
    per_layer = {r: activation_bytes_per_token_layer(m.hidden_size, m.ffn_hidden_size, kv, r, ctx.tp_size,
                                                     p.sequence_parallel, m.activation)
                 for r in ("bf16", "tensorwise", "coat")}
    totals = {r: _recompute_totals(cfg, chunks, v, ctx.tp_size, r) for r, v in per_layer.items()}
    # The logits exist on the last stage only, one micro-batch at a time (its backward follows its forward).
    fused_loss = target.type == "cuda" and cfg.precision.cross_entropy_loss_fusion is not False
    itemsize = torch.tensor([], dtype=params_dtype).element_size()
    return dict(
        layers=_layers_of(chunks),
        activations={r: int(tokens * total) for r, (total, _) in totals.items()},
        # Alive while the backward reaches the first layers, with the gradient buffers (nearly) all
        # allocated: one layer's activations, or one recomputed group's rebuilt in full.
        backward_activations={r: int(tokens * per_layer[r] * max(largest, 1)) for r, (_, largest) in totals.items()},
        in_flight=min(ctx.pp_size - ctx.pp_rank, num_microbatches(cfg, ctx.dp_size)) * len(chunks),
        loss=(tokens * loss_bytes_per_token(padded_vocab // ctx.tp_size, itemsize, fused_loss)
              if ctx.pp_rank == ctx.pp_size - 1 else 0))


LIVE = "live"  # the state-format key of live_plan's master and states: the optimizer this run built


def live_plan(cfg: MegacoatConfig, ctx: ParallelContext, model, chunks, optimizer, padded_vocab: int,
              params_dtype: torch.dtype, device: torch.device) -> RankPlan:
    """This rank's plan from the model and optimizer the trainer built (no meta copies, no process group of its
    own): what `peak_estimate(plan, LIVE, recipe)` needs before the first step."""
    params = [q for q in model.parameters() if q.requires_grad]
    return RankPlan(ranks=[ctx.rank], pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank, params=sum(q.numel() for q in params),
                    master={LIVE: _master_bytes(optimizer)}, states={LIVE: _state_bytes(optimizer)}, comm={},
                    fp8_weight_copies=fp8_weight_copy_bytes(model), micro_batches=num_microbatches(cfg, ctx.dp_size),
                    **_buffer_layout(optimizer), **step_activations(cfg, ctx, chunks, padded_vocab, params_dtype, device))


def _comm_bytes(cfg: MegacoatConfig, ctx: ParallelContext, params, grad_dtype: torch.dtype,
                bucket_size: int) -> Dict[str, Dict[str, int]]:
    """Bytes sent per step by this rank's data-parallel sync, per option. The ZeRO layout (buckets
    padded to shard_alignment) is the same for every option; the non-sharded optimizer all-reduces
    its buckets as GradBuffer lays them out (views 16-element aligned, the gaps included)."""
    dp = ctx.dp_size
    grad_elem = torch.empty((), dtype=grad_dtype).element_size()
    param_elem = params[0].element_size()
    out: Dict[str, Dict[str, int]] = {}
    # Non-sharded: one all-reduce per bucket.
    sizes = [n for _, _, n in grad_bucket_layout([p.numel() for p in reversed(params)], bucket_size)]
    out["all-reduce (no ZeRO)"] = {"grad": sum(ring_all_reduce_bytes(n, grad_elem, dp) for n in sizes), "param": 0}
    buf = ParamGradBuffer([torch.empty_like(p, device=META).requires_grad_() for p in params], grad_dtype, dp,
                          ctx.dp_rank, bucket_size, shard_alignment(dp))
    by_node = dp_groups_split_evenly(ctx.world_size, ctx.tp_size, ctx.pp_size, ctx.ranks_per_node)  # SDP4Bit's need
    for name, (qw, qg) in COMM_OPTIONS.items():
        if (qw or qg) and not by_node:
            continue
        c = dataclasses.replace(cfg.comm, quantized_weights=qw, quantized_gradients=qg)
        sdp = SDP4BitComm(c, ctx, None, 0) if qw or qg else None
        kinds: Dict[str, int] = {}
        for b in buf.buckets:
            grad = sdp.grad_wire_bytes(b.shard_size) if qg else \
                {"grad": ring_shard_bytes(b.numel, grad_elem, dp)}
            for k, v in grad.items():
                kinds[k] = kinds.get(k, 0) + v
            kinds["param"] = kinds.get("param", 0) + (
                sdp.param_wire_bytes(b.shard_size) if qw and dp > 1 else ring_shard_bytes(b.numel, param_elem, dp))
        out[name] = kinds
    return out


def plan_position(cfg: MegacoatConfig, world: int, rank: int, vocab_size: int, target: torch.device,
                  dp_indices: Optional[Sequence[int]] = None) -> List[RankPlan]:
    """Plans of every DP rank (or of the DP indices given) at the grid position of `rank`: the model is built
    once on the meta device, the optimizer once per DP rank and state format (shards differ per DP rank: the
    last one holds the bucket padding, which the per-segment torch AdamW does not allocate)."""
    p = cfg.parallel
    _fake_group(rank, world)
    try:
        ctx0 = ParallelContext.build(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, META,
                                     p.ranks_per_node, two_level_dp=cfg.comm.sdp4bit)
        recipe = resolve_precision(cfg.train, target, p.grad_reduce_in_bf16, cfg.precision,
                                   num_microbatches(cfg, ctx0.dp_size), p.overlap_param_gather)
        padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, ctx0.tp_size)
        lc = LayerContext(ctx0.tp_group, p.sequence_parallel, None, recipe.params_dtype, META, cfg.train.seed,
                          fp8=recipe.fp8)
        model, chunks = build_model_chunks(cfg.model, p, lc, ctx0, vocab_size, padded, compile_layers=False)
        params = [q for q in model.parameters() if q.requires_grad]
        bucket = p.ddp_bucket_size or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * ctx0.dp_size)
        step = step_activations(cfg, ctx0, chunks, padded, recipe.params_dtype, target)
        plans = []
        for d, global_rank in enumerate(ctx0.dp_ranks):
            if dp_indices is not None and d not in dp_indices:
                continue
            ctx = dataclasses.replace(ctx0, dp_rank=d, rank=global_rank)
            states, masters, layout = {}, {}, None
            for fmt, (mom1, mom2) in STATE_FORMATS.items():
                c = copy.deepcopy(cfg)
                # fp32 on a GPU target: the flat codec with fp32 moments, as the optimizer picks it there
                # when the fused CUDA extension builds (optim.fp8_adam.choose_state_formats).
                c.optim.use_precision_aware_optimizer = fmt != "fp32" or target.type == "cuda"
                c.optim.exp_avg_dtype, c.optim.exp_avg_sq_dtype = mom1, mom2
                opt = build_optimizer(model, c, ctx, recipe.grad_dtype)
                states[fmt], masters[fmt] = _state_bytes(opt), _master_bytes(opt)
                layout = layout or _buffer_layout(opt)
            plans.append(RankPlan(ranks=[global_rank], pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank,
                                  params=sum(q.numel() for q in params), master=masters, states=states,
                                  comm=_comm_bytes(cfg, ctx, params, recipe.grad_dtype, bucket),
                                  fp8_weight_copies=fp8_weight_copy_bytes(model),
                                  micro_batches=num_microbatches(cfg, ctx0.dp_size), **layout, **step))
        return plans
    finally:
        dist.destroy_process_group()


def plan_run(cfg: MegacoatConfig, world: int, vocab_size: int, target: Optional[torch.device] = None) -> List[RankPlan]:
    """One plan per rank of a `world`-rank run, ordered by rank (raises ConfigError)."""
    if dist.is_initialized():
        raise ConfigError("--dry-run plans without starting ranks: run it as one process (python pretrain_gpt.py "
                          "--dry-run --world-size N ...), not under torchrun.")
    validate_config(cfg, world)
    target = target or (torch.device("cpu") if cfg.train.use_cpu else torch.device("cuda"))
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    dp = world // (tp * pp)
    plans = []
    for stage in range(pp):
        for t in range(tp):
            try:
                plans += plan_position(cfg, world, stage * dp * tp + t, vocab_size, target)
            except ValueError as e:  # layout problems found while building (e.g. uneven two-level groups)
                raise ConfigError(str(e)) from e
    return sorted(plans, key=lambda pl: pl.ranks[0])


def plan_stages(cfg: MegacoatConfig, world: int, vocab_size: int, target: Optional[torch.device] = None
                ) -> List[RankPlan]:
    """One plan per pipeline stage, of its largest rank (the last DP rank, which holds the buckets' padding; TP
    rank 0): what the step-time model and the layout search need, at the cost of a few ranks instead of the
    world. The middle stages hold equal layers (model.stages.stage_layers), so one is planned and copied."""
    if dist.is_initialized():
        raise ConfigError("plan_stages plans without starting ranks: call it from one process.")
    validate_config(cfg, world)
    target = target or (torch.device("cpu") if cfg.train.use_cpu else torch.device("cuda"))
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    dp = world // (tp * pp)
    planned: Dict[int, RankPlan] = {}
    for stage in sorted({0, min(1, pp - 1), pp - 1}):
        try:
            (planned[stage],) = plan_position(cfg, world, stage * dp * tp, vocab_size, target, dp_indices=[dp - 1])
        except ValueError as e:  # layout problems found while building (e.g. uneven two-level groups)
            raise ConfigError(str(e)) from e
    out = []
    for stage in range(pp):
        pl = planned.get(stage) or planned[1]
        chunks = pl.in_flight // min(pp - pl.pp_rank, pl.micro_batches)  # step_activations' in_flight
        out.append(dataclasses.replace(pl, ranks=[stage * dp * tp + (dp - 1) * tp], pp_rank=stage,
                                       in_flight=min(pp - stage, pl.micro_batches) * chunks))
    return out


def replan_activations(plans: Sequence[RankPlan], cfg: MegacoatConfig, world: int, vocab_size: int,
                       target: Optional[torch.device] = None) -> List[RankPlan]:
    """`plan_stages`' plans for `cfg` where only the micro-batch, the global batch or recomputation differ from
    the configuration they were planned for: the model state is kept and the activation fields are computed
    again (step_activations over the stage's layers, model.stages.stage_layers), without building anything."""
    validate_config(cfg, world)
    target = target or (torch.device("cpu") if cfg.train.use_cpu else torch.device("cuda"))
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = world // (tp * pp)
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    dtype = resolve_precision(cfg.train, target, p.grad_reduce_in_bf16, cfg.precision).params_dtype
    layers = stage_layers(cfg.model.num_layers, pp, p.num_layers_per_virtual_pipeline_stage,
                          p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)
    out = []
    for pl in plans:
        ctx = ParallelContext(world_size=world, tp_size=tp, pp_size=pp, dp_size=dp, pp_rank=pl.pp_rank)
        chunks = [_LayerCount(list(n)) for n in layers[pl.pp_rank]]
        out.append(dataclasses.replace(pl, micro_batches=num_microbatches(cfg, dp),
                                       **step_activations(cfg, ctx, chunks, padded, dtype, target)))
    return out


@dataclass
class _LayerCount:
    """A model chunk as step_activations reads it: its layers."""

    layers: list


def group_plans(plans: List[RankPlan]) -> List[RankPlan]:
    """Ranks with identical plans as one row (e.g. all DP ranks but the last)."""
    rows: Dict[tuple, RankPlan] = {}
    for pl in plans:
        key = repr(dataclasses.replace(pl, ranks=[]))
        if key in rows:
            rows[key].ranks.append(pl.ranks[0])
        else:
            rows[key] = dataclasses.replace(pl, ranks=list(pl.ranks))
    return list(rows.values())


def _phases_apart(pl: RankPlan) -> bool:
    """The gradient buckets come and go within the step (`peak_estimate`): the larger phase counts."""
    return pl.grads_released and pl.micro_batches == 1 and pl.in_flight == 1 and bool(pl.buckets)


def peak_estimate(pl: RankPlan, state_format: str, recipe: str) -> int:
    """Peak bytes of this rank in a step: model state, plus activations and the loss, plus gradients.

    Gradient buckets that exist only from their first backward to the step's end (`grads_released`: the
    non-sharded optimizer; with one micro-batch per step, and so one in flight on every pipeline stage) are
    allocated while the backward frees the activations, so the peak is the larger of two phases rather than
    their sum: the end of the forward (every activation, the loss and the first bucket) and the backward of
    the first layers (every gradient bucket and that layer's activations, or a recomputed group's).

    Against the peak allocated memory of training runs on an H200 (`STAGES=coat1,coat7 bash
    scripts/gpu_evidence.sh`, C7_MBS for the larger micro-batches), estimated vs measured GiB:
    - 1.36B micro-batch 4, one micro-batch per step: bf16 31.20 vs 31.11, tensorwise 31.71 vs 31.63, coat 29.63
      vs 29.57, coat + FP8 states 22.24 vs 22.19; eight micro-batches: bf16 36.03 vs 36.19, coat 34.46 vs 34.66;
    - 7B, one micro-batch per step: bf16 micro-batch 2 / 5 / 6: 113.46 / 129.72 / 138.00 vs 113.87 / 130.24 /
      138.37; coat (kept FP8 weights) micro-batch 2: 125.37 vs 125.88, with FP8 optimizer states 88.89 vs 89.40;
      coat without them, micro-batch 2 / 7 / 8: 113.31 / 128.53 / 134.27 vs 113.82 / 128.94 / 134.52.
    Summing both phases said 129.51 / 135.97 / 123.90 for 7B micro-batch 2."""
    base = pl.weights + pl.fp8_weight_copies + pl.master[state_format] + pl.states[state_format]
    acts = pl.activations[recipe] * pl.in_flight + pl.loss
    if _phases_apart(pl):
        largest_bucket = pl.grads * max(pl.buckets) // sum(pl.buckets)
        return base + max(acts + largest_bucket, pl.grads + pl.backward_activations[recipe])
    return base + pl.grads + acts


# --fp8-weight-cache auto keeps the FP8 weight copies while the step's estimated peak with them stays within this
# share of the GPU memory the process can have: the estimate is within 0.05-0.52 GiB of fourteen measured H200 peaks
# (peak_estimate), and the allocator's reserve runs above its allocations.
AUTO_FP8_COPIES_SHARE = 0.95


def fp8_copies_fit(peak_with_copies: int, budget: int) -> bool:
    """Whether --fp8-weight-cache auto keeps the copies: the estimated peak with them within the share of `budget`."""
    return peak_with_copies <= AUTO_FP8_COPIES_SHARE * budget


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB (small models stay readable)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_plan(cfg: MegacoatConfig, world: int, plans: List[RankPlan]) -> str:
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    zero = p.use_distributed_optimizer
    current = "all-reduce (no ZeRO)" if not zero else \
        {v: k for k, v in COMM_OPTIONS.items()}[(cfg.comm.quantized_weights, cfg.comm.quantized_gradients)]
    fmt_now = cfg.optim.exp_avg_dtype if cfg.optim.use_precision_aware_optimizer else "fp32"
    recipe_now = cfg.precision.fp8_recipe if cfg.precision.fp8_format else "bf16"
    lines = [f"dry run: world {world} = TP {tp} x PP {pp} x DP {world // (tp * pp)}; "
             f"{'ZeRO' if zero else 'non-sharded'} optimizer; micro-batch {cfg.train.micro_batch_size} x seq "
             f"{cfg.model.seq_length}; {num_microbatches(cfg, world // (tp * pp))} micro-batches per step",
             "memory per rank; * marks what this configuration uses"]
    for pl in group_plans(plans):
        ranks = pl.ranks if len(pl.ranks) <= 8 else pl.ranks[:4] + ["..."] + pl.ranks[-2:]  # its DP ranks
        lines.append(f"ranks {', '.join(map(str, ranks))} (PP stage {pl.pp_rank}, TP rank {pl.tp_rank}): "
                     f"{pl.params:,} parameters, {pl.layers} layers, {len(pl.buckets)} bucket(s)")
        copies = f" | FP8 weight copies {_gib(pl.fp8_weight_copies)}" if pl.fp8_weight_copies else ""
        lines.append(f"  weights {_gib(pl.weights)}{copies} | gradients {_gib(pl.grads)} | optimizer states (moments + "
                     f"fp32 master weights): " + ", ".join(f"{k}{'*' if k == fmt_now else ''} {_gib(v)} + "
                                                           f"{_gib(pl.master[k])}" for k, v in pl.states.items()))
        loss = f" | loss (logits and their gradient) {_gib(pl.loss)}" if pl.loss else ""
        lines.append("  activations per micro-batch (estimate): " +
                     ", ".join(f"{k}{'*' if k == recipe_now else ''} {_gib(v)}" for k, v in pl.activations.items())
                     + f" | up to {pl.in_flight} micro-batch(es) in flight{loss}")
        phases = " (one micro-batch: the larger of the forward's end and the backward's)" if _phases_apart(pl) else ""
        peak, auto = peak_estimate(pl, fmt_now, recipe_now), ""
        if pl.fp8_weight_copies and cfg.precision.fp8_weight_cache == "auto":
            auto = (f"; --fp8-weight-cache auto drops the kept FP8 weight copies ({_gib(pl.fp8_weight_copies)}) where "
                    f"the run can use less than {_gib(peak / AUTO_FP8_COPIES_SHARE)} of a GPU's memory "
                    f"({AUTO_FP8_COPIES_SHARE:.0%} of it for this peak)")
        lines.append(f"  peak with this configuration (estimate){phases}: {_gib(peak)}{auto}")
        lines.append("  bytes sent per step (data-parallel sync, MiB): " + " | ".join(
            f"{k}{'*' if k == current else ''}: " + ", ".join(f"{kind} {v / 2**20:.1f}" for kind, v in d.items())
            for k, d in pl.comm.items()))
    return "\n".join(lines)


def dry_run(cfg: MegacoatConfig, vocab_size: int, stream, launched_world: int = 1) -> List[RankPlan]:
    """Plan and print every rank of a run over --world-size ranks, else over the `launched_world` this was
    started with (the launcher's WORLD_SIZE), then the step time predicted for it on --hardware."""
    from .hardware import load_hardware
    from .step_time import format_step_time, predict

    world = cfg.parallel.world_size or launched_world
    hw = load_hardware(cfg.train.hardware, cfg.train.inter_node_gbps)  # a bad file fails before the planning
    plans = plan_run(cfg, world, vocab_size)
    print(format_plan(cfg, world, plans), file=stream, flush=True)
    if cfg.train.use_cpu:  # the step-time model describes GPUs (docs/planner.md)
        print("predicted step: none for a --use-cpu run (the step-time model describes GPUs); leave out --use-cpu to "
              f"predict the step on --hardware {cfg.train.hardware}", file=stream, flush=True)
    else:
        print(format_step_time(predict(cfg, world, plans, hw, vocab_size), hw), file=stream, flush=True)
    return plans
