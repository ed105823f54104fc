#!/usr/bin/env python
"""Operations on one GPU: activation recomputation (time and memory) and how true --dry-run's
numbers are (model-state bytes exact, activation estimate vs the measured peak).

For each (precision recipe, recomputation) pair a Trainer is built in-process (eager layers, so
several configurations fit in the time budget; ZeRO buffers so gradients are allocated up front),
a few steps run, and we record: mean step time (CUDA events), tokens/s, model-state memory after
set-up, peak memory of the steps, the activation peak (peak - model state) and the planner's
activation estimate for that pair, and the planner's model-state bytes vs the ones allocated.

    python benchmarks/operations_bench.py --out operations.json
    python benchmarks/operations_bench.py --out /tmp/ops.json --smoke      # tiny shapes (CPU ok)
Each configuration is isolated: a failure is recorded and the next one runs.
"""
import argparse
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import source_commit  # noqa: E402

import torch  # noqa: E402

MODEL = ["--num-layers", "8", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
         "--seq-length", "2048", "--micro-batch-size", "4", "--global-batch-size", "8", "--vocab-size", "32000"]
SMOKE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "301",
         "--make-vocab-size-divisible-by", "8"]
COMMON = ["--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0",
          "--eval-interval", "0", "--eval-iters", "0", "--no-torch-compile", "--use-distributed-optimizer",
          "--train-iters", "1000"]
RECIPES = {"bf16": ["--bf16"], "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
           "coat": ["--fp8-format", "hybrid", "--fp8-recipe", "coat"]}
RECOMPUTE = {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--recompute-granularity", "full"]}


def measure(flags, steps, device):
    from megacoat.config import parse_args
    from megacoat.training.planner import _grad_bytes, _master_bytes, _state_bytes, _weight_bytes, plan_run
    from megacoat.training.trainer import Trainer

    cfg = parse_args(flags)
    fmt = cfg.optim.exp_avg_dtype if cfg.optim.use_precision_aware_optimizer else "fp32"
    recipe = cfg.precision.fp8_recipe if cfg.precision.fp8_format else "bf16"
    (plan,) = plan_run(parse_args(flags), 1, cfg.data.vocab_size, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tr = Trainer(parse_args(flags))
    opt = tr.optimizer
    planned_state = (plan.weights, plan.grads, plan.master[fmt], plan.states[fmt])
    real_state = (_weight_bytes(opt), _grad_bytes(opt), _master_bytes(opt), _state_bytes(opt))
    it = tr.data_iterators().train
    cuda = device.type == "cuda"
    times = []
    base = torch.cuda.memory_allocated() if cuda else 0
    for i in range(steps):
        batches = tr._next_micro_batches(it)
        if cuda:
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        rec = tr.train_step(batches)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 1:  # the first step allocates lazily and warms up
            times.append(ms)
    loss = rec.loss
    peak = torch.cuda.max_memory_allocated() if cuda else None
    step_ms = sum(times) / len(times)
    tokens = tr.cfg.train.global_batch_size * tr.cfg.model.seq_length
    out = dict(recipe=recipe, step_ms=step_ms, tokens_per_s=tokens / step_ms * 1e3, loss_last=loss,
               model_state_bytes_after_setup=base, peak_bytes=peak,
               activation_peak_bytes=(peak - base) if cuda else None,
               activation_estimate_bytes_per_micro_batch=plan.activations[recipe],
               planned_model_state=planned_state, allocated_model_state=real_state,
               model_state_equal=planned_state == real_state)
    if cuda:
        out["activation_measured_over_estimate"] = out["activation_peak_bytes"] / max(plan.activations[recipe], 1)
    del tr, opt, it
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script; CPU works)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = SMOKE if args.smoke else MODEL
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name() if
               device.type == "cuda" else "cpu", "torch": torch.__version__, "model": model, "runs": {}}
    results["commit"] = source_commit()
    for rname, rflags in RECIPES.items():
        for cname, cflags in RECOMPUTE.items():
            key = f"{rname}/{cname}"
            flags = model + COMMON + rflags + cflags + (["--use-cpu", "--bf16"] if device.type != "cuda" else [])
            t0 = time.time()
            try:
                results["runs"][key] = measure(flags, args.steps, device)
            except Exception as e:  # noqa: BLE001 - one failing configuration must not stop the others
                results["runs"][key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            results["runs"][key]["wall_s"] = time.time() - t0
            r = results["runs"][key]
            if "error" in r:
                print(f"{key:22s} ERROR {r['error']}", flush=True)
            else:
                act = r["activation_peak_bytes"]
                print(f"{key:22s} step {r['step_ms']:8.1f} ms | {r['tokens_per_s']:9.0f} tok/s | peak "
                      f"{(r['peak_bytes'] or 0) / 2**30:6.2f} GiB | activations measured "
                      f"{(act or 0) / 2**30:6.2f} GiB vs estimate {r['activation_estimate_bytes_per_micro_batch'] / 2**30:6.2f}"
                      f" GiB | model state planned == allocated: {r['model_state_equal']}", flush=True)
            with open(args.out, "w") as f:  # after every configuration: a later crash keeps the rest
                json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
