#!/usr/bin/env python
"""Measure a machine for the step-time model and write its machine file (megacoat/training/hardware/ format).

    python benchmarks/calibrate.py --name mygpu --out mygpu.json [--inter-node-gbps 400] [--budget-s 420]
    torchrun --nproc-per-node 8 benchmarks/calibrate.py --name mynode --out mynode.json --inter-node-gbps 200
    python tools/plan.py --hardware mygpu.json ...        # then plan with it

On one GPU (rank 0 of a launch):
- gemm: bf16 and FP8 (E4M3, torch._scaled_mm, the heuristic's algorithm) GEMMs over the shapes of transformer
  layers: tokens 2048-16384 x widths 2048-28672, forward / data-gradient / weight-gradient layouts; CUDA events
  around back-to-back repetitions, no L2 flush (inside a training step the inputs come straight from the
  previous kernel). TFLOP/s per [m, n, k].
- attention: torch's causal scaled_dot_product_attention (bf16, head dim 128, seq 2048 and 4096) forward and
  forward + backward, TFLOP/s as model/flops.py counts them.
- bandwidth: a device copy (hbm_copy); a compiled SwiGLU forward and backward (elementwise: bytes it must move over
  its time); megacoat's FP8 cast with transposed copy given the amax, and its amax pass (cast).
- optimizer: the fused AdamW step over 64M elements per moment format and gradient dtype
  (benchmarks/optimizer_bench.py's cases), scaled to 256M.
- host: the host time to enqueue one kernel of a compiled transformer layer's forward and backward (a small
  layer, so that the host is the bottleneck; kernels counted by the profiler), and the GPU's gap between queued
  kernels (many tiny kernels queued behind a long one).
- SDP4Bit kernels: the h200 file's times scaled by the ratio of device-copy bandwidths (not timed here).
With several GPUs (torchrun), every rank joins NCCL's all-gather, reduce-scatter and all-reduce of 256 MB and of
8 bytes: bus bandwidth and latency of the node's link (intra_node); across nodes (when the launch spans several)
the same numbers describe inter_node. `--inter-node-gbps` sets the inter-node bandwidth by hand (Gb/s per GPU).
Links not measured keep the h200 file's values, and the file says so in its `source` fields.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

from bench_timing import timed  # noqa: E402
from megacoat.config import ConfigError  # noqa: E402
from megacoat.training.hardware import (GBPS_PER_GBYTE, check_inter_node_gbps, load_hardware,  # noqa: E402
                                       parse_hardware)

TOKENS = (2048, 4096, 8192, 16384)
WIDTHS = ((2048, 2048), (2048, 6144), (2048, 11264), (5632, 2048), (4096, 4096), (4096, 12288), (4096, 22016),
          (11008, 4096), (8192, 8192), (8192, 10240), (8192, 57344), (28672, 8192), (1024, 1024), (512, 2048))


def _time_ms(fn, reps: int = 10) -> float:
    """Milliseconds per call: one sample of `reps` calls back to back (bench_timing.timed), as a full queue runs."""
    return timed(fn, iters=1, reps=reps)


def part_gemm(deadline: float) -> dict:
    """[m, n, k, TFLOP/s] per format: y = x W^T (m = tokens), dx = dy W, dW = dy^T x (k = tokens)."""
    out = {"bf16": [], "fp8": []}
    fp8_ok = hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9)
    for t in TOKENS:
        for kin, kout in WIDTHS:
            for m, n, k in ((t, kout, kin), (t, kin, kout), (kout, kin, t)):
                if time.time() > deadline:
                    return out
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                flops = 2.0 * m * n * k
                ms = _time_ms(lambda: torch.mm(a, b.t()))
                out["bf16"].append([m, n, k, round(flops / ms / 1e9, 1)])
                if fp8_ok:
                    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                    one = torch.ones((), device="cuda")
                    ms = _time_ms(lambda: torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16, use_fast_accum=True))
                    out["fp8"].append([m, n, k, round(flops / ms / 1e9, 1)])
                del a, b
    return out


def part_attention() -> dict:
    import torch.nn.functional as F
    fwd, bwd = [], []
    for seq, heads, batch in ((2048, 32, 4), (4096, 32, 2)):
        q, k, v = (torch.randn(batch, heads, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops_fwd = 2.0 * seq * heads * 128 * batch * seq  # model/flops.py: 2 seq width per token, causal
        f_ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        g = torch.randn(batch, heads, seq, 128, device="cuda", dtype=torch.bfloat16)
        fb_ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g))
        fwd.append(flops_fwd / f_ms / 1e9)
        bwd.append(2 * flops_fwd / max(fb_ms - f_ms, 1e-6) / 1e9)
    return {"forward_tflops": round(sum(fwd) / len(fwd), 1), "backward_tflops": round(sum(bwd) / len(bwd), 1)}


def part_bandwidth() -> dict:
    n = 2**28
    x = torch.empty(n, device="cuda", dtype=torch.float32)
    copy = 2 * 4 * n / _time_ms(lambda: x.clone()) / 1e6
    del x
    t, f = 16384, 5632
    gate_up = torch.randn(t, 2 * f, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def swiglu(h):
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    fn = torch.compile(swiglu)
    dy = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: fn(gate_up).backward(dy))
    elementwise = t * f * 2 * (3 + 5) / ms / 1e6  # step_time.layer_bytes: 3f forward, 5f backward, bf16
    out = {"hbm_copy": round(copy, 1), "elementwise": round(elementwise, 1)}
    try:
        from megacoat.precision import fp8
        y = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
        a = fp8.amax(y)
        cast_ms = _time_ms(lambda: fp8.cast_tensorwise(y, a, "e4m3", True), reps=20)
        amax_ms = _time_ms(lambda: fp8.amax(y), reps=20)
        out["cast"] = round(y.numel() * (4 + 2) / (cast_ms + amax_ms) / 1e6, 1)
    except Exception:  # noqa: BLE001 - no FP8 kernels on this machine: the copy's share the h200 measured
        out["cast"] = round(copy * 3461.0 / 4246.0, 1)
    return out


def part_optimizer() -> dict:
    from optimizer_bench import codec_case
    n = 2**26
    out = {}
    for moments in ("fp32", "bf16", "fp8"):
        out[moments] = {}
        for grad_name, grad_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            codec, _ = codec_case(n, moments, True, grad_dtype)
            norm = torch.tensor(0.5, device="cuda")
            ms = _time_ms(lambda: codec.step(1e-4, norm), reps=5)
            out[moments][grad_name] = round(ms * 2**28 / n, 3)
            del codec
            torch.cuda.empty_cache()
    return out


def part_host() -> dict:
    """Host enqueue time per kernel of a compiled layer (small, so the host is the bottleneck), and the GPU's gap
    between queued tiny kernels."""
    from megacoat.config import ModelConfig, resolve_model_defaults
    from megacoat.model.rope import RotaryEmbedding
    from megacoat.model.transformer import LayerContext, TransformerLayer
    from megacoat.parallel.random import seed_everything
    dev, seq = torch.device("cuda"), 128
    m = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=4, seq_length=seq, attention_dropout=0.0,
                    hidden_dropout=0.0)
    resolve_model_defaults(m)
    layer = TransformerLayer(m, LayerContext(None, False, seed_everything(1, 0, dev), torch.bfloat16, dev, 1), 0)
    layer = torch.compile(layer.to(dev))
    rope = RotaryEmbedding(m.kv_channels, seq, m.rotary_base, device=dev)(torch.arange(seq, device=dev).unsqueeze(0),
                                                                          torch.bfloat16)
    x = torch.randn(seq, 2, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x, rope).float().sum().backward()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    tiny = torch.zeros(1, device=dev)
    n = 2000
    torch.mm(big, big)  # the queue fills behind it
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        tiny.add_(1)
    b.record()
    b.synchronize()
    return {"launch_us": round(host / max(kernels, 1) * 1e6, 1), "kernel_gap_us": round(a.elapsed_time(b) / n * 1e3, 2)}


def part_links(world: int, rank: int) -> dict:
    import torch.distributed as dist
    nbytes = 256 * 2**20
    out = {}
    x = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    shard = torch.empty(nbytes // 2 // world, device="cuda", dtype=torch.bfloat16)
    tests = {"all_gather": (lambda: dist.all_gather_into_tensor(x, shard), (world - 1) / world),
             "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, x), (world - 1) / world),
             "all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world)}
    for name, (fn, factor) in tests.items():
        ms = _time_ms(fn, reps=10)
        out[name] = round(nbytes * factor / ms / 1e6, 1)
    small = torch.zeros(2, device="cuda")
    out["latency_us"] = round(_time_ms(lambda: dist.all_reduce(small), reps=50) * 1e3 / max(2 * (world - 1), 1), 1)
    return out


def _bad_flag(args) -> str:
    """What is wrong with the flags, in one line ("" if nothing)."""
    try:
        check_inter_node_gbps(args.inter_node_gbps)
    except ConfigError as e:
        return str(e)
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        return f"--budget-s {args.budget_s} must be > 0 (seconds for the GEMM sweep, e.g. 420)."
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        return f"--out {args.out}: its directory does not exist."
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the machine's name (the file's `name`)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--inter-node-gbps", type=float, default=None, help="the link between nodes, Gb/s per GPU")
    ap.add_argument("--budget-s", type=float, default=420.0, help="time for the GEMM sweep (default 420 s)")
    args = ap.parse_args(argv)
    bad = _bad_flag(args)
    if bad:  # refused before minutes of measuring, not after
        print(f"benchmarks/calibrate.py: error: {bad}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("benchmarks/calibrate.py: error: measures a GPU; none is visible.", file=sys.stderr)
        return 2
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ref = load_hardware("h200")
    raw = json.loads(json.dumps(ref.raw))  # the h200 file as the template: what is not measured stays its
    stamp = f"benchmarks/calibrate.py on {torch.cuda.get_device_name()} ({torch.__version__}), " \
            f"{datetime.date.today().isoformat()}"
    raw.update(name=args.name, description=f"measured by {stamp}")
    links = None
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl")
        links = part_links(world, rank)
        dist.destroy_process_group()
    if rank != 0:
        return 0
    t0 = time.time()
    parts = {"gemm": lambda: part_gemm(t0 + args.budget_s), "attention": part_attention,
             "bandwidth_GBps": part_bandwidth, "optimizer_ms_per_256M": part_optimizer, "host": part_host}
    for key, fn in parts.items():
        try:
            got = fn()
            if key == "gemm" and not got["fp8"]:
                got["fp8"] = raw["gemm"]["fp8"]
                got["source"] = f"bf16 {stamp}; fp8: no FP8 GEMMs on this GPU, the h200 file's rows"
            raw[key] = dict(got, source=got.get("source", stamp))
            print(f"{key}: done ({time.time() - t0:.0f} s)", flush=True)
        except Exception:  # noqa: BLE001 - keep the h200 values for this part and say so
            raw[key]["source"] = f"not measured ({traceback.format_exc(limit=1).strip().splitlines()[-1]}): " \
                                 f"the h200 file's values"
            print(f"{key}: failed, h200 values kept", flush=True)
    scale = raw["bandwidth_GBps"]["hbm_copy"] / ref.bandwidth_GBps["hbm_copy"]
    raw["sdp4bit_ms_per_256M"] = {k: round(v / scale, 4) for k, v in ref.sdp4bit_ms_per_256M.items()}
    raw["sdp4bit_ms_per_256M"]["source"] = "the h200 file's kernel times scaled by the device-copy bandwidth ratio"
    raw["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2)
    if links is not None:
        bus = min(links["all_gather"], links["reduce_scatter"], links["all_reduce"])
        cls = "intra_node" if local == world else "inter_node"
        raw["links"][cls].update(bus_GBps=bus, latency_us=links["latency_us"])
        raw["links"]["source"] = f"{cls}: NCCL at 256 MB over {world} ranks ({links}), {stamp}; others: h200's"
    if args.inter_node_gbps is not None:
        raw["links"]["inter_node"]["bus_GBps"] = args.inter_node_gbps / GBPS_PER_GBYTE
        raw["links"]["source"] += f"; inter_node bandwidth {args.inter_node_gbps} Gb/s per GPU given by hand"
    try:
        parse_hardware(raw, args.out)  # a file the planner would refuse is not written
    except ConfigError as e:
        print(f"benchmarks/calibrate.py: error: {e} Nothing was written.", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(raw, f, indent=1)
    print(f"wrote {args.out}; plan with: python tools/plan.py --hardware {args.out} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
