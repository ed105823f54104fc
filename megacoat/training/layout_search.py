"""The layout search of `tools/plan.py`: every layout and method choice that fits in memory, ranked by predicted
tokens/s per GPU.

Searched (a flag given on the command line keeps its value): TP (1, 2, 4, ... up to the node; sequence
parallelism with TP > 1), PP (divisors of the layers), interleaved virtual stages (2 or 4 chunks per rank), the
micro-batch (powers of two dividing the global batch over DP), full recomputation of every layer or none, the
FP8 recipe (bf16, tensorwise, coat), the optimizer-state format (fp32, bf16, fp8), bf16 gradient buffers, and with
DP > 1 the ZeRO optimizer with overlapped sync and each SDP4Bit option (plain, qWD, TLq-HS, both); the
non-sharded optimizer only at DP = 1, where it has no collectives and overlaps the gradient norm.
Left out, because the models here never prefer them: selective recomputation (the memory planner sees no
saving from it with flash attention), ZeRO without its overlap flags, DP > 1 without ZeRO.

Memory: the planner's estimate per pipeline stage (`planner.plan_stages`, one model build per layout; micro-batch
and recomputation variants by `planner.replan_activations`) must fit the machine's memory; under FP8 the
weight copies are dropped where `--fp8-weight-cache auto` would drop them. Speed: `step_time.predict`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..config import ConfigError, MegacoatConfig, parse_args, resolve_model_defaults, validate_config
from ..parallel.context import dp_groups_split_evenly
from .hardware import Hardware
from .planner import (AUTO_FP8_COPIES_SHARE, RankPlan, peak_estimate, plan_stages, replan_activations)
from .step_time import NO_ZERO, StepTime, methods_of, predict

RECIPES = ("bf16", "tensorwise", "coat")
STATES = ("fp32", "bf16", "fp8")
COMMS = ("plain", "qWD", "TLq-HS", "qWD+TLq-HS")
GPU = torch.device("cuda")

# Flags whose value the search chooses, grouped by the choice they make: given on the command line, that
# choice stays as given.
CHOICE_FLAGS = {
    "tp": ("--tensor-model-parallel-size",),
    "sp": ("--sequence-parallel",),
    "pp": ("--pipeline-model-parallel-size", "--decoder-first-pipeline-num-layers",
           "--decoder-last-pipeline-num-layers"),
    "vp": ("--num-layers-per-virtual-pipeline-stage",),
    "mbs": ("--micro-batch-size",),
    "recompute": ("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                  "--recompute-activations"),  # Megatron's alias of --recompute-granularity selective
    "recipe": ("--fp8-format", "--fp8-recipe", "--fp32"),
    "states": ("--use-precision-aware-optimizer", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
    "grads": ("--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"),
    "zero": ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
    "comm": ("--quantized-weights", "--quantized-gradients", "--hadamard-transform"),
}
# Flags of tools/plan.py that pretrain_gpt.py would not train with (the planning target).
PLANNING_FLAGS = ("--world-size", "--hardware", "--inter-node-gbps", "--dry-run")


def given_choices(argv: Sequence[str]) -> set:
    names = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {c for c, flags in CHOICE_FLAGS.items() if names & set(flags)}


@dataclass
class Candidate:
    flags: List[str]          # the chosen flags, added to the user's
    step: StepTime
    peak_bytes: int           # the largest stage's estimated peak
    fp8_copies: bool
    summary: str

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.step.tokens_per_s_per_gpu


@dataclass
class SearchResult:
    candidates: List[Candidate]
    layouts_tried: int = 0
    configurations: int = 0     # layout x batch x method combinations examined
    too_large: int = 0          # of them, over the memory
    invalid: List[str] = field(default_factory=list)
    seconds: float = 0.0
    plan_seconds: float = 0.0   # of which in the memory planner


def _powers_of_two(limit: int) -> List[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _layouts(base: MegacoatConfig, world: int, fixed: set,
             refused: List[str]) -> Iterable[Tuple[int, int, Optional[int]]]:
    """(TP, PP, layers per virtual stage) to try; a size given on the command line that cannot divide the world
    is named in `refused` (the search leaves out such sizes of its own without a word)."""
    m, p = base.model, base.parallel
    rpn = p.ranks_per_node or world
    tps = [p.tensor_model_parallel_size] if "tp" in fixed else \
        [t for t in _powers_of_two(min(rpn, world)) if m.num_attention_heads % t == 0 and
         m.num_query_groups % t == 0 and m.ffn_hidden_size % t == 0 and m.seq_length % t == 0]
    for tp in tps:
        if world % tp:
            if "tp" in fixed:
                refused.append(f"--tensor-model-parallel-size {tp} does not divide --world-size {world}")
            continue
        pps = [p.pipeline_model_parallel_size] if "pp" in fixed else \
            [q for q in range(1, m.num_layers + 1) if m.num_layers % q == 0 and (world // tp) % q == 0]
        for pp in pps:
            if world % (tp * pp):
                if "pp" in fixed:
                    refused.append(f"--pipeline-model-parallel-size {pp} does not divide --world-size {world}"
                                   if world % pp else f"TP {tp} x --pipeline-model-parallel-size {pp} does not "
                                   f"divide --world-size {world}")
                continue
            vps: List[Optional[int]] = [p.num_layers_per_virtual_pipeline_stage] if "vp" in fixed else [None]
            if "vp" not in fixed and pp > 1:
                vps += [m.num_layers // (pp * c) for c in (2, 4) if m.num_layers % (pp * c) == 0]
            for vp in vps:
                yield tp, pp, vp


def _with(cfg: MegacoatConfig, **sections) -> MegacoatConfig:
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


def _method_configs(cfg: MegacoatConfig, fixed: set, dp: int, recipes, states, comms,
                    by_node: bool = True) -> Iterable[MegacoatConfig]:
    """The configuration of each method combination of one layout (recipe x states x data-parallel option; the
    gradient dtype and the optimizer kind belong to the layout: they change its buffers). `by_node`: the layout's
    DP groups split evenly over nodes, as SDP4Bit's options need."""
    rs = [None] if "recipe" in fixed else [r for r in recipes if r in RECIPES]
    ss = [None] if "states" in fixed else [s for s in states if s in STATES]
    zero = cfg.parallel.use_distributed_optimizer
    cs = [None] if "comm" in fixed else ([c for c in comms if c in COMMS and (by_node or c == "plain")]
                                         if dp > 1 and zero else ["plain"])
    for r in rs:
        pr = {} if r is None else {"fp8_format": None if r == "bf16" else "hybrid",
                                   "fp8_recipe": "coat" if r in (None, "bf16") else r}
        for st in ss:
            o = {} if st is None else {"use_precision_aware_optimizer": st != "fp32", "exp_avg_dtype": st,
                                       "exp_avg_sq_dtype": st}
            for c in cs:
                comm = {} if c is None else {
                    "quantized_weights": c in ("qWD", "qWD+TLq-HS"),
                    "quantized_gradients": c in ("TLq-HS", "qWD+TLq-HS"),
                    "hadamard_transform": c in ("TLq-HS", "qWD+TLq-HS")}
                yield _with(cfg, precision=pr, optim=o, comm=comm)


def _fit(plans: Sequence[RankPlan], cfg: MegacoatConfig, hw: Hardware) -> Tuple[bool, int, bool]:
    """(fits, largest peak, FP8 weight copies kept): the copies go where --fp8-weight-cache auto drops them."""
    methods = methods_of(cfg, 1)
    fmt, recipe = methods.memory_format, methods.recipe if methods.recipe != "fp32" else "bf16"
    copies = methods.fp8 and cfg.precision.fp8_weight_cache != "none"
    peaks = [peak_estimate(pl if copies else dataclasses.replace(pl, fp8_weight_copies=0), fmt, recipe)
             for pl in plans]
    if copies and cfg.precision.fp8_weight_cache == "auto" and max(peaks) > AUTO_FP8_COPIES_SHARE * hw.usable_bytes:
        copies = False
        peaks = [peak_estimate(dataclasses.replace(pl, fp8_weight_copies=0), fmt, recipe) for pl in plans]
    return max(peaks) <= hw.usable_bytes, max(peaks), copies


def choice_flags(cfg: MegacoatConfig, fixed: set) -> List[str]:
    """The pretrain_gpt.py flags of the choices the search made (not those the user gave)."""
    p, t, pr, o, c = cfg.parallel, cfg.train, cfg.precision, cfg.optim, cfg.comm
    out: List[str] = []
    if "tp" not in fixed:
        out += ["--tensor-model-parallel-size", str(p.tensor_model_parallel_size)]
    if "sp" not in fixed and p.sequence_parallel:
        out += ["--sequence-parallel"]
    if "pp" not in fixed:
        out += ["--pipeline-model-parallel-size", str(p.pipeline_model_parallel_size)]
    if "vp" not in fixed and p.num_layers_per_virtual_pipeline_stage:
        out += ["--num-layers-per-virtual-pipeline-stage", str(p.num_layers_per_virtual_pipeline_stage)]
    if "mbs" not in fixed:
        out += ["--micro-batch-size", str(t.micro_batch_size)]
    if "recompute" not in fixed and t.recompute_granularity:
        out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if "recipe" not in fixed and pr.fp8_format:
        out += ["--fp8-format", pr.fp8_format, "--fp8-recipe", pr.fp8_recipe]
    if "states" not in fixed and o.use_precision_aware_optimizer:
        out += ["--use-precision-aware-optimizer", "--exp-avg-dtype", o.exp_avg_dtype, "--exp-avg-sq-dtype",
                o.exp_avg_sq_dtype]
    if "grads" not in fixed and p.grad_reduce_in_bf16:
        out += ["--grad-reduce-in-bf16"]
    if "zero" not in fixed and p.use_distributed_optimizer:
        out += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    if "comm" not in fixed:
        out += ["--quantized-weights"] if c.quantized_weights else []
        out += ["--quantized-gradients", "--hadamard-transform"] if c.quantized_gradients else []
    return out


def summary(cfg: MegacoatConfig, world: int, copies: bool) -> str:
    p, t = cfg.parallel, cfg.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    m = methods_of(cfg, world // (tp * pp))
    vp = f" vp {cfg.model.num_layers // (pp * p.num_layers_per_virtual_pipeline_stage)}" \
        if p.num_layers_per_virtual_pipeline_stage else ""
    states = m.moments[0] if m.moments[0] == m.moments[1] else "/".join(m.moments)
    return (f"TP {tp}{' SP' if p.sequence_parallel else ''} PP {pp}{vp} DP {world // (tp * pp)}, micro-batch "
            f"{t.micro_batch_size}{f', {t.recompute_granularity} recompute' if t.recompute_granularity else ''}; "
            f"{m.recipe}"
            f"{' (FP8 weights cast per use)' if m.fp8 and not copies else ''}, {states} states, {m.grad_dtype} "
            f"grads, {'ZeRO ' + m.comm if m.comm != NO_ZERO else 'non-sharded optimizer'}")


def _check_machine_and_batch(base: MegacoatConfig, world: int, fixed: set) -> None:
    """What no layout can mend, refused up front (else every layout is refused, and the message blames fit)."""
    rpn, gbs = base.parallel.ranks_per_node, base.train.global_batch_size
    if world < 1:
        raise ConfigError(f"--world-size {world} must be >= 1 (the GPUs to plan for).")
    if rpn is not None and rpn < 1:
        raise ConfigError(f"--ranks-per-node {rpn} must be >= 1 (the GPUs of one node).")
    if rpn and world > rpn and world % rpn:  # a launcher starts the same number of ranks on every node
        whole = world - world % rpn
        raise ConfigError(f"--world-size {world} is not a multiple of --ranks-per-node {rpn}: plan for whole nodes "
                          f"(--world-size {whole} or {whole + rpn}).")
    if gbs < 1:
        raise ConfigError(f"--global-batch-size {gbs} must be >= 1.")
    mbs = base.train.micro_batch_size
    if "mbs" in fixed and mbs >= 1 and gbs % mbs:  # every layout needs global batch = DP x micro-batch x micro-batches
        raise ConfigError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs}: no data-parallel "
                          f"size can split it; give a micro-batch that divides it, or leave the flag out and the "
                          f"search chooses.")


def search(argv: Sequence[str], world: int, hw: Hardware, vocab_size: int, recipes: Sequence[str] = RECIPES,
           states: Sequence[str] = STATES, comms: Sequence[str] = COMMS, max_micro_batch: int = 16,
           recompute: bool = True, plans_cache: Optional[dict] = None) -> SearchResult:
    """Every configuration of `argv` (pretrain_gpt.py flags) over `world` ranks that fits, fastest first.
    `plans_cache`: a dict kept between searches of the same model (the memory plans do not depend on the machine)."""
    t0 = time.perf_counter()
    fixed = given_choices(argv)
    base = parse_args(list(argv))
    resolve_model_defaults(base.model)
    if base.train.global_batch_size is None:
        raise ConfigError("tools/plan.py needs --global-batch-size (the samples per step it keeps while it "
                          "chooses the layout).")
    _check_machine_and_batch(base, world, fixed)
    if base.train.fp32:
        recipes = ["fp32"]
    res = SearchResult([])
    cache: dict = {}
    stage_plans = plans_cache if plans_cache is not None else {}  # one dry run per layout
    for tp, pp, vp in _layouts(base, world, fixed, res.invalid):
        dp = world // (tp * pp)
        par = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                   num_layers_per_virtual_pipeline_stage=vp)
        if "sp" not in fixed:
            par["sequence_parallel"] = tp > 1
        per_dp = base.train.global_batch_size // dp if base.train.global_batch_size % dp == 0 else 0
        mbss = [base.train.micro_batch_size] if "mbs" in fixed else \
            [b for b in _powers_of_two(min(max_micro_batch, max(per_dp, 1))) if per_dp and per_dp % b == 0]
        rcs = [None] if "recompute" in fixed else ([False, True] if recompute else [False])
        if not mbss:
            res.invalid.append(f"TP {tp} PP {pp}: --global-batch-size {base.train.global_batch_size} is not a "
                               f"multiple of DP {dp} x a micro-batch")
            continue
        by_node = dp_groups_split_evenly(world, tp, pp, base.parallel.ranks_per_node or world)
        for grads in ([None] if "grads" in fixed else [False, True]):
            for zero in ([None] if "zero" in fixed else ([True] if dp > 1 else [True, False])):
                zpar = {} if zero is None else dict(use_distributed_optimizer=zero, overlap_grad_reduce=zero,
                                                        overlap_param_gather=zero)
                layout = _with(base, parallel=dict(par, **zpar, **({} if grads is None else
                                                                   {"grad_reduce_in_bf16": grads})),
                               train=dict(micro_batch_size=mbss[0]))
                if any(r in ("tensorwise", "coat") for r in recipes) and "recipe" not in fixed:
                    layout = _with(layout, precision=dict(fp8_format="hybrid"))  # counts the FP8 weight copies
                res.layouts_tried += 1
                tp0 = time.perf_counter()
                try:
                    key = (world, vocab_size, repr(layout))
                    if key not in stage_plans:
                        stage_plans[key] = plan_stages(layout, world, vocab_size, GPU)
                    plans0 = stage_plans[key]
                except ConfigError as e:
                    res.invalid.append(f"TP {tp} PP {pp}{f' vp layers {vp}' if vp else ''}: {e}")
                    continue
                finally:
                    res.plan_seconds += time.perf_counter() - tp0
                for mbs in mbss:
                    for rc in rcs:
                        tr = {"micro_batch_size": mbs}
                        if rc is not None:
                            tr.update(recompute_granularity="full" if rc else None,
                                      recompute_method="uniform" if rc else None,
                                      recompute_num_layers=1 if rc else None)
                        batch = _with(layout, train=tr)
                        try:
                            plans = replan_activations(plans0, batch, world, vocab_size, GPU)
                        except ConfigError:
                            continue
                        for cfg in _method_configs(batch, fixed, dp, recipes, states, comms, by_node):
                            res.configurations += 1
                            try:
                                validate_config(cfg, world)
                            except ConfigError:
                                continue
                            fits, peak, copies = _fit(plans, cfg, hw)
                            if not fits:
                                res.too_large += 1
                                continue
                            st = predict(cfg, world, plans, hw, vocab_size, cache=cache)
                            res.candidates.append(Candidate(choice_flags(cfg, fixed), st, peak, copies,
                                                            summary(cfg, world, copies)))
    res.candidates.sort(key=lambda c: -c.tokens_per_s_per_gpu)
    res.seconds = time.perf_counter() - t0
    return res


def inexactness(c: Candidate) -> int:
    """How many lossy choices a candidate makes beyond bf16 compute: quantized communication, non-fp32 optimizer
    states, bf16 gradients (the recipe is the user's to narrow)."""
    return (("ZeRO plain" not in c.summary and "non-sharded" not in c.summary) + ("fp32 states" not in c.summary)
            + ("bf16 grads" in c.summary))


def preferred(candidates: Sequence[Candidate], margin: float = 0.005) -> Optional[Candidate]:
    """Of the candidates within `margin` of the fastest, the one with the fewest lossy choices (then the fastest):
    a quantized format that buys less than half a percent is not worth its error."""
    if not candidates:
        return None
    fastest = max(c.tokens_per_s_per_gpu for c in candidates)
    close = [c for c in candidates if c.tokens_per_s_per_gpu >= (1 - margin) * fastest]
    return min(close, key=lambda c: (inexactness(c), -c.tokens_per_s_per_gpu))


def layout_of(c: Candidate) -> str:
    """A candidate's summary without its state, gradient and communication formats."""
    head, methods = c.summary.split(";", 1)
    return head + ";" + methods.split(",")[0]


def distinct(candidates: Sequence[Candidate], top: int, margin: float = 0.005) -> List[Candidate]:
    """The `top` fastest configurations that differ in more than the optimizer-state, gradient and communication
    formats: of each such group the `preferred` one."""
    groups: Dict[str, List[Candidate]] = {}
    for c in candidates:
        groups.setdefault(layout_of(c), []).append(c)
    out = [preferred(g, margin) for g in groups.values()]
    return sorted(out, key=lambda c: -c.tokens_per_s_per_gpu)[:top]


def command_line(argv: Sequence[str], cand: Candidate) -> List[str]:
    """pretrain_gpt.py's flags for a candidate: the user's (without the planning-only flags) plus the choices."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in PLANNING_FLAGS:
            skip = "=" not in a and name != "--dry-run"
            continue
        out.append(a)
    return out + cand.flags


def no_fit_message(res: SearchResult, world: int, hw: Hardware) -> str:
    """Why the search found nothing. One reason for every layout refused (a flag in conflict with another, a
    size given that cannot be) is the configuration's fault, not the fit's: it is given alone."""
    refusals = list(dict.fromkeys(res.invalid))  # the vp variants of a layout repeat its refusal
    causes = list(dict.fromkeys(r.split(": ", 1)[1] if r.startswith("TP ") and ": " in r else r for r in refusals))
    where = f"on {world} GPUs of {hw.name}"
    if not res.too_large and len(causes) == 1:
        return f"no layout can run {where}: {causes[0]}"
    why = (f"{res.too_large} of {res.configurations} configurations over {hw.memory_gib - hw.reserved_gib:.1f} GiB "
           f"per GPU" if res.too_large else "no valid layout")
    hint = "; ".join(refusals[:3])
    # Memory is a cause only where some configuration was too large; otherwise the refusals are the fix.
    advice = ("Give more GPUs, a smaller --global-batch-size or model, or fewer fixed flags" if res.too_large
              else "Change or drop the fixed flags the refusals name")
    return f"nothing fits: {why} {where}" + (f" (layouts refused: {hint})" if hint else "") + f". {advice}."


def best_by(res: SearchResult, key) -> Dict[str, Candidate]:
    """The fastest candidate per value of key(candidate)."""
    out: Dict[str, Candidate] = {}
    for c in res.candidates:
        out.setdefault(key(c), c)
    return out
