"""What the training loop's per-step bookkeeping costs on the GPU: the log's
device-side sums and the skipped/NaN counters (which replaced per-step records kept for the whole
run) must not make the host wait for the device, and must cost next to nothing per step.

    python benchmarks/step_bookkeeping.py --out step_bookkeeping.json

Parts (each runs even if another fails; errors are recorded):
- `bookkeeping_us`: host time per step of `IterationLogger.record_step` + `TrainState.count_step`,
  and the device time of the kernels they launch (CUDA events), over many steps;
- `no_host_sync`: the same calls under `torch.cuda.set_sync_debug_mode("error")`;
- `tiny_training`: a short run of a small model through `Trainer.train` (the whole loop, with a
  checkpoint save), ms per step and the memory held by bookkeeping after N steps (no growth).
"""
import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.config import parse_args  # noqa: E402
from megacoat.parallel.context import ParallelContext  # noqa: E402
from megacoat.training.log import IterationLogger  # noqa: E402
from megacoat.training.trainer import StepRecord, Trainer, TrainState  # noqa: E402

TINY = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--mock-data", "--vocab-size", "4096",
        "--eval-interval", "0", "--eval-iters", "0", "--num-workers", "0", "--no-torch-compile"]


def _records(dev, n):
    out = []
    for i in range(n):
        bad = i % 50 == 49
        out.append(StepRecord(i + 1, 1e-3, torch.tensor(3.0, device=dev),
                              torch.tensor(float("nan") if bad else 1.0, device=dev), torch.tensor(not bad, device=dev)))
    return out


def bookkeeping_us(dev, steps=2000):
    cfg = parse_args(TINY + ["--train-iters", str(steps)])
    logger = IterationLogger(cfg, ParallelContext.single(dev), dev, "bf16", None, stream=open(os.devnull, "w"))
    state = TrainState()
    recs = _records(dev, steps)
    for rec in recs[:50]:  # warm-up
        logger.record_step(rec, {})
        state.count_step(rec)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for rec in recs:
        logger.record_step(rec, {})
        state.count_step(rec)
    end.record()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    state.resolve_counters()
    return {"steps": steps, "host_us_per_step": 1e6 * host_s / steps,
            "device_us_per_step": 1e3 * start.elapsed_time(end) / steps,
            "skipped_counted": state.skipped_iters, "nan_counted": state.nan_iters,
            "expected_skipped": (steps + 50) // 50}


def no_host_sync(dev):
    cfg = parse_args(TINY + ["--train-iters", "10"])
    logger = IterationLogger(cfg, ParallelContext.single(dev), dev, "bf16", None, stream=open(os.devnull, "w"))
    state = TrainState()
    recs = _records(dev, 100)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rec in recs:
            logger.record_step(rec, {})
            state.count_step(rec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"ok": True, "steps": len(recs)}


def tiny_training(dev, steps=200):
    out = {}
    with tempfile.TemporaryDirectory() as save:
        cfg = parse_args(TINY + ["--train-iters", str(steps), "--log-interval", "50", "--save", save,
                                 "--save-interval", "100"])
        t = Trainer(cfg, log_stream=open(os.devnull, "w"))
        times = []

        def on_step(trainer, rec):
            times.append(time.perf_counter())
            if trainer.state.iteration == 20:
                torch.cuda.synchronize()
                out["allocated_after_20_steps"] = torch.cuda.memory_allocated(dev)

        t.train(on_step=on_step)
        torch.cuda.synchronize()
        out["allocated_after_all_steps"] = torch.cuda.memory_allocated(dev)
        out["ms_per_step_after_warmup"] = 1e3 * (times[-1] - times[20]) / (len(times) - 21)
        out["steps"] = steps
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if not torch.cuda.is_available():
        results["error"] = "needs a CUDA GPU"
    else:
        dev = torch.device("cuda")
        for name, fn in (("bookkeeping_us", bookkeeping_us), ("no_host_sync", no_host_sync),
                         ("tiny_training", tiny_training)):
            t0 = time.perf_counter()
            try:
                results[name] = fn(dev)
            except Exception as e:  # noqa: BLE001 - one failing part must not stop the others
                results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            results[name]["wall_s"] = time.perf_counter() - t0
            print(name, json.dumps(results[name], indent=1), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
