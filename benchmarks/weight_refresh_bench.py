"""The FP8 weight refresh after each optimizer step, timed on the GPU: every linear weight of the 1.36B model
(24 layers: qkv 6144x2048, proj 2048x2048, fc1 11264x2048, fc2 2048x5632, bf16) quantized per tensor into its
cache (W and W^T codes, scale), one weight at a time (`quantize_tensorwise_into`: an amax and a cast launch
each) against all at once (`quantize_tensorwise_many`: two launches). Reports GPU time, host (enqueue) time
per refresh and the bandwidth counting every byte read and written (amax pass 2 B/element, cast 2 B read +
2 x 1 B written), next to a plain copy of the same bytes.

    python benchmarks/weight_refresh_bench.py [--layers 24] [--reps 20] [--out results.json]
"""
import argparse
import json
import time

import torch

from megacoat.precision import fp8
from provenance import source_commit


def _time(fn, reps: int):
    """(GPU ms per call from CUDA events, host ms per call to enqueue it)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host * 1e3 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    shapes = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * a.layers
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(s, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for s in shapes]
    dt = fp8.get_format("e4m3").dtype
    qs = [torch.empty(w.shape, dtype=dt, device="cuda") for w in ws]
    qts = [torch.empty(w.shape[::-1], dtype=dt, device="cuda") for w in ws]
    scales = [torch.empty((), device="cuda") for _ in ws]
    amaxes = [torch.empty((), device="cuda") for _ in ws]
    n = sum(w.numel() for w in ws)
    bytes_moved = n * (2 + 2 + 2)  # amax read, cast read, two 1-byte writes

    def one_at_a_time():
        for w, q, qt, s, am in zip(ws, qs, qts, scales, amaxes):
            fp8.quantize_tensorwise_into(w, "e4m3", q, qt, s, am)

    plan = [None]

    def all_at_once():
        plan[0] = fp8.quantize_tensorwise_many(ws, "e4m3", qs, qts, scales, plan[0])

    flat = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty(n // 2 * 3, dtype=torch.bfloat16, device="cuda")  # 3 B/element written: same bytes

    def copy():
        dst[: n].copy_(flat)
        dst[n:].copy_(flat[: dst.numel() - n])

    one_at_a_time()
    ref = [(q.clone(), qt.clone(), s.clone()) for q, qt, s in zip(qs, qts, scales)]
    all_at_once()
    same = all(torch.equal(q.view(torch.uint8), r[0].view(torch.uint8)) and torch.equal(qt.view(torch.uint8), r[1].view(
        torch.uint8)) and torch.equal(s, r[2]) for q, qt, s, r in zip(qs, qts, scales, ref))
    res = {"commit": source_commit(), "weights": len(ws), "elements": n, "bytes": bytes_moved, "identical_codes_and_scales": same,
           "aligned_variant": bool(plan[0] is not None and plan[0].aligned)}
    for name, fn in (("one_at_a_time", one_at_a_time), ("all_at_once", all_at_once), ("copy_same_bytes", copy)):
        gpu, host = _time(fn, a.reps)
        res[name] = {"gpu_ms": round(gpu, 3), "host_ms": round(host, 3), "TB_per_s": round(bytes_moved / gpu / 1e9, 2)}
        print(f"{name:16s} GPU {gpu:7.3f} ms  host {host:7.3f} ms  {bytes_moved / gpu / 1e9:5.2f} TB/s")
    print(f"identical codes and scales: {same}; {len(ws)} weights, {n / 1e9:.2f} G elements")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
