"""What to change when a step runs out of GPU memory: the flags that shrink this run, each with what it saves.

The model-state savings come from the optimizer's own byte counts per parameter (what each flag changes
in the model state; a flag may also move when memory peaks, as said where it does); the activation flags
say what they act on, since activation memory is only estimated (`--dry-run`).
"""
from __future__ import annotations

from typing import Dict, List

from ..config import MegacoatConfig
from ..optim.fp8_adam import moment_bytes_per_element

FP8_STATE_BYTES = 2 * moment_bytes_per_element("fp8")


def _gib(bytes_: float) -> str:
    return f"{bytes_ / 2**30:.1f} GiB"


def memory_saving_flags(cfg: MegacoatConfig, memory: Dict[str, float], dp_size: int) -> List[str]:
    """One line per flag that would use less memory in this configuration. `memory`: bytes per parameter
    on this rank by kind (`memory_report()` of the optimizer, plus `fp8_weight_copies` when kept) and the
    rank's parameter count under `params`."""
    n = memory["params"]
    p, o, t, pr = cfg.parallel, cfg.optim, cfg.train, cfg.precision
    out = []
    copies = memory.get("fp8_weight_copies", 0.0)
    if copies > 0:
        out.append(f"--fp8-weight-cache none: -{_gib(copies * n)} (FP8 weight copies cast at each use instead of "
                   "kept for the step; measured 2% slower at 7B)")
    states = memory["optimizer_states"]
    dtypes = (o.exp_avg_dtype, o.exp_avg_sq_dtype) if o.use_precision_aware_optimizer else ("fp32", "fp32")
    now = sum(moment_bytes_per_element(d) for d in dtypes)  # bytes per element of the moments as they are
    if now > FP8_STATE_BYTES:
        saved = states * (1 - FP8_STATE_BYTES / now) * n  # `states` is per parameter of this rank (ZeRO: its share)
        out.append(f"--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8: -{_gib(saved)} "
                   "(COAT's FP8 Adam moments)")
    if memory["grads"] >= 4 and not p.accumulate_allreduce_grads_in_fp32:
        out.append(f"--grad-reduce-in-bf16: -{_gib(memory['grads'] / 2 * n)} (bf16 gradient buffers)")
    if dp_size > 1 and not p.use_distributed_optimizer:
        # Each rank keeps 1/DP of the moments and an fp32 master shard (4/DP bytes per parameter, also where
        # the parameters are fp32 and need no master today); the gradient buffers then stay allocated.
        saved = (states * (1 - 1 / dp_size) + memory["master"] - 4 / dp_size) * n
        if saved > 0:
            out.append(f"--use-distributed-optimizer: -{_gib(saved)} (fp32 masters and Adam moments sharded over "
                       f"the {dp_size} data-parallel ranks; gradient buffers then stay allocated between steps)")
    if t.recompute_granularity != "full":
        out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1: keeps only "
                   "each layer's input for backward (activations; ~30% more compute)")
    if t.micro_batch_size > 1:  # the largest smaller size that still divides the global batch
        mbs = t.micro_batch_size
        smaller = max(d for d in range(1, mbs) if mbs % d == 0)
        gbs = t.global_batch_size or mbs * dp_size  # its default (micro-batch x DP) would shrink with the micro-batch
        out.append(f"--micro-batch-size {smaller} --global-batch-size {gbs} ({mbs // smaller}x the "
                   f"micro-batches per step): about {smaller}/{mbs} of the activations")
    if pr.fp8_format is None and not t.fp32:  # FP8 needs bf16 parameters
        out.append("--fp8-format hybrid --fp8-recipe coat: FP8 GEMMs and activations saved in FP8 (sm_89+ GPUs)")
    elif pr.fp8_format is not None and pr.fp8_recipe == "tensorwise":
        out.append("--fp8-recipe coat: activations saved in FP8 (tensorwise saves them in bf16)")
    return out


def out_of_memory_message(cfg: MegacoatConfig, memory: Dict[str, float], dp_size: int, iteration: int) -> str:
    """The text added to a CUDA out-of-memory error raised by a training step."""
    n = memory["params"]
    held = ", ".join(f"{k} {_gib(memory[k] * n)}" for k in
                     ("weights", "fp8_weight_copies", "grads", "master", "optimizer_states") if memory.get(k))
    lines = [f"megacoat: out of GPU memory in training step {iteration + 1}. Model state on this rank: {held}. "
             "`--dry-run` estimates the whole budget. Flags that use less memory here:"]
    lines += [f"  {flag}" for flag in memory_saving_flags(cfg, memory, dp_size)]
    return "\n".join(lines)
