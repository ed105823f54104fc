"""SDP4Bit (qWD and TLq-HS) on one GPU: kernel times and bandwidth, wire bytes per step.

Part 1 (needs CUDA + Triton): each fused kernel on 256M elements, timed with
triton.testing.do_bench; bytes moved = bytes read + bytes written by the kernel (its minimum
traffic); GB/s and the fraction of 4300 GB/s (the H200's measured copy bandwidth). SDP4Bit's own
kernels measured on this GPU for comparison (ms): 4-bit quantizer 1.22; Hadamard + 8-bit quantize +
reorder 1.30; dequantize + reduce + requantize 0.67; dequantize + reduce + inverse Hadamard 0.34.
TLq-HS kernels are sized as one rank of 2 nodes x 2 GPUs with a 256M-element fp32 bucket.
Also: a plain fp32 copy of 256M elements, the torch references on 32M elements (eager baseline),
the first version of these kernels (FIRST_VERSION_MS), a sweep of the tile (elements per program) and warps, and
kernel == reference bit for bit on 8M elements for every kernel. The TLq-HS encode is timed twice:
the Triton kernel (`tlq_encode_*`) and the CUDA C++ one of csrc/sdp4bit_encode.cu (`*_cuda`, which
`encode_partitioned` runs where it is built), on the same data; CUDA == Triton is checked too. The same
for the reduce-requantize (`tlq_reduce_requantize_int8_to_int4[_cuda]`).

Part 2 (CPU is enough): bytes each rank sends per step for the 1.36B model (h 2048, 24 layers, ffn
5632, vocab 32000, tied embedding, default 40M-element buckets), plain vs qWD at DP=2 and plain vs
TLq-HS at 4 ranks as 2 x 2. Single-process emulation: the real bucket layout (ParamGradBuffer over
parameters of the model's shapes on the meta device) and, per bucket, the byte counts the
strategies add to CommStats (SDP4BitComm.grad_wire_bytes / param_wire_bytes, plain's ring counts).

Usage: python benchmarks/sdp4bit_bench.py --out results.json   (one failing part is recorded, the others run)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import source_commit  # noqa: E402

from megacoat.comm import codecs as C  # noqa: E402
from megacoat.config import round_to_fp32  # noqa: E402

HBM_GBS = 4300.0
SDP4BIT_MS = {"qwd_encode_delta_int4": 1.22, "tlq_encode_hadamard_int8": 1.30, "tlq_encode_hadamard_int8_cuda": 1.30,
              "tlq_reduce_requantize_int8_to_int4": 0.67, "tlq_reduce_requantize_int8_to_int4_cuda": 0.67,
              "tlq_reduce_decode_inverse_hadamard": 0.34, "fp32_copy": 0.52}
# The first version of these Triton kernels (per-element 64-bit index division), timed by this benchmark on an
# H200 at commit c69e89a.
FIRST_VERSION_MS = {"qwd_encode_delta_int4": 0.7617, "qwd_apply_delta_int4": 1.5073, "tlq_encode_hadamard_int8": 1.1853,
                    "tlq_reduce_requantize_int8_to_int4": 0.5976, "tlq_reduce_decode_inverse_hadamard": 0.1457}
# Tile sweep (elements per program, warps): the launchers read these module constants per call.
SWEEP = [(4096, 4), (4096, 8), (8192, 4), (16384, 8)]
# The CUDA kernels' grid cap (their max_blocks argument, read per call; None = each kernel's default: the encode
# uncapped, one unit of work per warp; the requantize kernels.sdp4bit.REQUANTIZE_BLOCKS_PER_SM per SM) and the
# caps the grid sweep tries, in blocks per SM (0 = uncapped).
CUDA_MAX_BLOCKS = None
GRID_SWEEP_PER_SM = [0, 2, 4, 8, 16, 32]


def _bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100)


def _record(results, name, ms, nbytes, extra=None):
    gbs = nbytes / ms / 1e6
    rec = {"ms": round(ms, 4), "bytes": int(nbytes), "GB/s": round(gbs, 1), "frac_of_4300": round(gbs / HBM_GBS, 3)}
    if name in SDP4BIT_MS:
        rec["sdp4bit_ms"] = SDP4BIT_MS[name]
        rec["speedup_vs_sdp4bit"] = round(SDP4BIT_MS[name] / ms, 2)
    if name in FIRST_VERSION_MS:
        rec["first_version_ms"] = FIRST_VERSION_MS[name]
        rec["speedup_vs_first_version"] = round(FIRST_VERSION_MS[name] / ms, 2)
    rec.update(extra or {})
    results[name] = rec
    print(f"{name:42s} {ms:8.3f} ms {gbs:8.0f} GB/s ({100 * gbs / HBM_GBS:5.1f}% of {HBM_GBS:.0f})"
          + (f"  SDP4Bit {SDP4BIT_MS[name]} ms" if name in SDP4BIT_MS else ""), flush=True)


def _safe(results, name, fn):
    try:
        fn()
    except Exception as e:  # keep going: one failing part must not hide the others
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
    finally:
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _cuda_encode(K, *args):
    """The CUDA C++ encode (csrc/sdp4bit_encode.cu); an error if it did not run (not built / not covered)."""
    if not K.encode_partitioned_cuda(*args, max_blocks=CUDA_MAX_BLOCKS or 0):
        raise RuntimeError("the CUDA encode did not run (extension not built or disabled, or case not covered)")


def _cuda_requant(K, *args):
    """The CUDA C++ reduce-requantize (csrc/sdp4bit_encode.cu); an error if it did not run."""
    if not K.reduce_requantize_cuda(*args, max_blocks=CUDA_MAX_BLOCKS):
        raise RuntimeError("the CUDA reduce-requantize did not run (extension not built or disabled, or case not "
                           "covered)")


def kernel_cases(n, dev, key):
    """name -> (run, bytes moved, description, reference run or None) on n elements (TLq: 2 x 2).
    `tlq_encode_*` entries run the Triton kernel; `*_cuda` the CUDA C++ one on the same data."""
    from megacoat.kernels import sdp4bit as K
    g = torch.Generator(device=dev).manual_seed(0)
    master = torch.randn(n, device=dev, generator=g) * 0.02
    w = (master + 1e-3 * torch.randn(n, device=dev, generator=g)).bfloat16()
    msg = torch.empty(C.message_bytes(n, 4, 2048), dtype=torch.uint8, device=dev)
    w2 = w.clone()  # n weights = the shards of 2 ranks, n/2 each
    msgs = torch.empty(2, C.message_bytes(n // 2, 4, 2048), dtype=torch.uint8, device=dev)
    for r in range(2):
        K.encode_delta(master[r * n // 2:(r + 1) * n // 2], w[r * n // 2:(r + 1) * n // 2], msgs[r], 4, 2048, key,
                       False)
    L, N = 2, 2
    S = n // (L * N)
    grad = torch.randn(n, device=dev, generator=g)
    grad[::4097] *= 50  # outliers, as in real gradients
    m1 = torch.empty(L, C.message_bytes(N * S, 8, 128), dtype=torch.uint8, device=dev)
    K.encode_partitioned(grad, m1, S, 0, S, L, N, 8, 128, True, key)
    grad16 = grad.bfloat16()
    m2 = torch.empty(N, C.message_bytes(S, 4, 128), dtype=torch.uint8, device=dev)
    K.reduce_requantize(m1, m2, N * S, 8, 128, 4, 128, N, key)
    out = torch.empty(S, device=dev)
    scale = round_to_fp32(1 / 128)

    def enc(src, hadamard, cuda, what):
        """A TLq encode entry: the Triton or CUDA kernel on `src`, its bytes, and its reference check."""
        args = (src, m1, S, 0, S, L, N, 8, 128, hadamard, key)
        run = (lambda: _cuda_encode(K, *args)) if cuda else (lambda: K.encode_partitioned_triton(*args))
        return (run, src.element_size() * n + m1.numel(), what,
                (m1, lambda o: C.encode_partitioned_reference(src, o, *args[2:])))

    return {
        "qwd_encode_delta_int4": (lambda: K.encode_delta(master, w, msg, 4, 2048, key, False), 6 * n + msg.numel(),
                                  "fp32 master + bf16 weights -> int4 delta message (G 2048)",
                                  (msg, lambda o: C.encode_delta_reference(master, w, o, 4, 2048, key, False))),
        "qwd_apply_delta_int4": (lambda: K.apply_delta(msgs, w2, 4, 2048, False), 4 * n + msgs.numel(),
                                 "bf16 weights += dequant(int4 messages of 2 ranks)", None),
        "tlq_encode_hadamard_int8": enc(grad, True, False,
                                        "fp32 bucket -> Hadamard -> int8 (G 128) in partition order, 2 x 2"),
        "tlq_encode_int8_no_hadamard": enc(grad, False, False, "the same without the Hadamard transform (TLq)"),
        "tlq_encode_hadamard_int8_cuda": enc(
            grad, True, True, "CUDA C++ kernel: fp32 bucket -> Hadamard -> int8 (G 128) in partition order, 2 x 2"),
        "tlq_encode_int8_no_hadamard_cuda": enc(grad, False, True, "CUDA C++ kernel without the Hadamard transform"),
        "tlq_encode_hadamard_int8_bf16": enc(grad16, True, False,
                                             "Triton: bf16 bucket -> Hadamard -> int8 (G 128), 2 x 2"),
        "tlq_encode_hadamard_int8_bf16_cuda": enc(grad16, True, True,
                                                  "CUDA C++: bf16 bucket -> Hadamard -> int8 (G 128), 2 x 2"),
        "tlq_reduce_requantize_int8_to_int4": (
            lambda: K.reduce_requantize_triton(m1, m2, N * S, 8, 128, 4, 128, N, key), m1.numel() + m2.numel(),
            "2 int8 messages of n/2 -> fp32 sum -> int4 (G 128), 2 destinations",
            (m2, lambda o: C.reduce_requantize_reference(m1, o, N * S, 8, 128, 4, 128, N, key))),
        "tlq_reduce_requantize_int8_to_int4_cuda": (
            lambda: _cuda_requant(K, m1, m2, N * S, 8, 128, 4, 128, N, key), m1.numel() + m2.numel(),
            "CUDA C++: 2 int8 messages of n/2 -> fp32 sum -> int4 (G 128), 2 destinations",
            (m2, lambda o: C.reduce_requantize_reference(m1, o, N * S, 8, 128, 4, 128, N, key))),
        "tlq_reduce_decode_inverse_hadamard": (
            lambda: K.reduce_decode(m2, out, S, 4, 128, True, scale), m2.numel() + 4 * S,
            "2 int4 messages of n/4 -> fp32 sum -> inverse Hadamard -> fp32 shard",
            (out, lambda o: C.reduce_decode_reference(m2, o, S, 4, 128, True, scale))),
    }


def kernel_part(results, n=256 * 2 ** 20, sweep_budget_s=60.0, exact_n=8 * 2 ** 20, device="cuda"):
    from megacoat.kernels import sdp4bit as K
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    key = C.derive_key(1, 2, 3)

    def copy():
        x = torch.randn(n, device=dev, generator=g)
        y = torch.empty_like(x)
        _record(results, "fp32_copy", _bench(lambda: y.copy_(x)), 8 * n)
        del x, y
    _safe(results, "fp32_copy", copy)

    cases = {}
    _safe(results, "kernel_setup", lambda: cases.update(kernel_cases(n, dev, key)))
    default = (K.TILE, K.WARPS)
    for name, (run, nbytes, what, _) in cases.items():
        def one(name=name, run=run, nbytes=nbytes, what=what):
            run()  # compile outside the timing
            _record(results, name, _bench(run), nbytes, {"what": what, "tile": default[0], "warps": default[1]})
        _safe(results, name, one)

    def sweep():
        """Other (elements per program, warps): informs the default (launchers read K.TILE/K.WARPS)."""
        t0, table = time.time(), {}
        try:
            for tile, warps in SWEEP:
                if time.time() - t0 > sweep_budget_s:
                    table["stopped"] = f"time budget {sweep_budget_s} s"
                    break
                K.TILE, K.WARPS = tile, warps
                for name, (run, nbytes, _, _) in cases.items():
                    if name.endswith("_cuda"):  # TILE / WARPS are the Triton kernels' parameters
                        continue
                    try:
                        run()
                        ms = _bench(run)
                        table.setdefault(name, {})[f"{tile}x{warps}"] = {
                            "ms": round(ms, 4), "frac_of_4300": round(nbytes / ms / 1e6 / HBM_GBS, 3)}
                    except Exception as e:
                        table.setdefault(name, {})[f"{tile}x{warps}"] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            K.TILE, K.WARPS = default
        for name, row in table.items():
            if isinstance(row, dict):
                cells = "  ".join(f"{k}: {v.get('ms', 'err')}" for k, v in row.items())
                print(f"sweep {name:40s} {cells}", flush=True)
        results["tile_sweep"] = table
    _safe(results, "tile_sweep", sweep)

    def grid_sweep():
        """The CUDA kernels with a capped grid (warps loop over units) and uncapped, against their defaults."""
        global CUDA_MAX_BLOCKS
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        table = {}
        try:
            for per_sm in GRID_SWEEP_PER_SM:
                CUDA_MAX_BLOCKS = per_sm * sms
                for name, (run, nbytes, _, _) in cases.items():
                    if name.endswith("_cuda"):
                        ms = _bench(run)
                        table.setdefault(name, {})[f"{per_sm}/SM" if per_sm else "uncapped"] = {
                            "ms": round(ms, 4), "frac_of_4300": round(nbytes / ms / 1e6 / HBM_GBS, 3)}
        finally:
            CUDA_MAX_BLOCKS = None
        for name, row in table.items():
            base = results.get(name, {}).get("ms")
            cells = "  ".join(f"{k}: {v['ms']}" for k, v in row.items())
            print(f"grid {name:40s} default: {base}  {cells}", flush=True)
        results["cuda_grid_sweep"] = table
    _safe(results, "cuda_grid_sweep", grid_sweep)

    def references():
        m = min(32 * 2 ** 20, n)
        grad = torch.randn(m, device=dev, generator=g)
        S2 = m // 4
        m1 = torch.empty(2, C.message_bytes(2 * S2, 8, 128), dtype=torch.uint8, device=dev)
        ms = _bench(lambda: C.encode_partitioned_reference(grad, m1, S2, 0, S2, 2, 2, 8, 128, True, key))
        _record(results, "torch_reference_encode_hadamard_int8_32M", ms, 4 * m + m1.numel())
        ms = _bench(lambda: K.encode_partitioned_triton(grad, m1, S2, 0, S2, 2, 2, 8, 128, True, key))
        _record(results, "triton_encode_hadamard_int8_32M", ms, 4 * m + m1.numel())
    _safe(results, "references", references)
    cases.clear()
    torch.cuda.empty_cache()

    def exactness():
        """Kernel output == torch reference output, bit for bit, on 8M elements (each checked kernel)."""
        small = kernel_cases(exact_n, dev, key)
        exact = {}
        for name, (run, _, _, ref) in small.items():
            if ref is None:
                continue
            buf, ref_run = ref
            run()
            got = buf.clone()
            ref_run(buf)
            exact[name] = bool(torch.equal(got, buf))
        # apply: kernel vs reference on the same messages and weights
        h = exact_n // 2
        w = (torch.randn(exact_n, device=dev, generator=g) * 0.02).bfloat16()
        msgs = torch.empty(2, C.message_bytes(h, 4, 2048), dtype=torch.uint8, device=dev)
        for r in range(2):
            C.encode_delta_reference(w[r * h:(r + 1) * h].float() * 1.01, w[r * h:(r + 1) * h], msgs[r], 4, 2048, key,
                                     False)
        w1, w2 = w.clone(), w.clone()
        K.apply_delta(msgs, w1, 4, 2048, False)
        C.apply_delta_reference(msgs, w2, 4, 2048, False)
        exact["qwd_apply_delta_int4"] = bool(torch.equal(w1, w2))
        # CUDA vs Triton encode on the same 8M-element bucket (fp32 and bf16, with and without Hadamard)
        S = exact_n // 4
        src = torch.randn(exact_n, device=dev, generator=g) * 3
        src[::4097] *= 50
        for dt in (torch.float32, torch.bfloat16):
            for had in (True, False):
                a = torch.empty(2, C.message_bytes(2 * S, 8, 128), dtype=torch.uint8, device=dev)
                b = torch.empty_like(a)
                K.encode_partitioned_triton(src.to(dt), a, S, 0, S, 2, 2, 8, 128, had, key)
                ran = K.encode_partitioned_cuda(src.to(dt), b, S, 0, S, 2, 2, 8, 128, had, key)
                exact[f"cuda_eq_triton_encode_{'had' if had else 'plain'}_{str(dt)[6:]}"] = ran and bool(torch.equal(a, b))
        # CUDA vs Triton reduce-requantize on those messages (2 sources of n/2 -> 2 int4 messages)
        m1 = torch.empty(2, C.message_bytes(2 * S, 8, 128), dtype=torch.uint8, device=dev)
        K.encode_partitioned(src, m1, S, 0, S, 2, 2, 8, 128, True, key)
        a = torch.empty(2, C.message_bytes(S, 4, 128), dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        K.reduce_requantize_triton(m1, a, 2 * S, 8, 128, 4, 128, 2, key)
        ran = K.reduce_requantize_cuda(m1, b, 2 * S, 8, 128, 4, 128, 2, key)
        exact["cuda_eq_triton_reduce_requantize"] = ran and bool(torch.equal(a, b))
        results["bit_exact"] = {"elements": exact_n, **exact}
        print(f"kernel == reference ({exact_n} elements):", exact, flush=True)
    _safe(results, "exactness", exactness)


def model_params_meta(h=2048, layers=24, ffn=5632, vocab=32000):
    """Parameters of the 1.36B Llama-style model (tied embedding, no biases) in registration order."""
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (3 * h, h), (h, h), (h,), (2 * ffn, h), (h, ffn)]
    shapes += [(h,)]
    return [torch.nn.Parameter(torch.empty(s, device="meta", dtype=torch.bfloat16)) for s in shapes]


def bytes_part(results):
    from megacoat.comm.base import CommStats
    from megacoat.comm.plain import ring_shard_bytes
    from megacoat.comm.sdp4bit import SDP4BitComm
    from megacoat.config import CommConfig
    from megacoat.optim.buffers import ParamGradBuffer, shard_alignment
    from megacoat.parallel.context import ParallelContext

    params = model_params_meta()
    nparams = sum(p.numel() for p in params)
    out = {"params": nparams}
    for name, dp, (L, N), cfg in [
            ("dp2_qwd", 2, (2, 1), CommConfig(quantized_weights=True)),
            ("2x2_tlq_hs", 4, (2, 2), CommConfig(quantized_gradients=True, hadamard_transform=True)),
            ("2x2_tlq_hs_and_qwd", 4, (2, 2), CommConfig(quantized_gradients=True, hadamard_transform=True,
                                                          quantized_weights=True))]:
        buf = ParamGradBuffer(params, torch.float32, dp, 0, max(40_000_000, 1_000_000 * dp), shard_alignment(dp))
        ctx = ParallelContext(world_size=dp, dp_size=dp, dp_intra_size=L, dp_inter_size=N)
        comm = SDP4BitComm(cfg, ctx, CommStats(), seed=1)
        plain = {"grad": 0, "param": 0}
        quant = {}
        for b in buf.buckets:
            plain["grad"] += ring_shard_bytes(b.numel, 4, dp)
            plain["param"] += ring_shard_bytes(b.numel, 2, dp)
            for k, v in comm.grad_wire_bytes(b.numel // dp).items():
                quant[k] = quant.get(k, 0) + v
            quant["param"] = quant.get("param", 0) + comm.param_wire_bytes(b.numel // dp)
        rec = {"dp": dp, "ranks_per_node": L, "nodes": N, "buckets": len(buf.buckets),
               "plain_bytes": plain, "sdp4bit_bytes": quant,
               "plain_MiB": {k: round(v / 2 ** 20, 1) for k, v in plain.items()},
               "sdp4bit_MiB": {k: round(v / 2 ** 20, 1) for k, v in quant.items()}}
        sent = sum(v for v in quant.values())
        rec["total_ratio_plain_over_sdp4bit"] = round(sum(plain.values()) / sent, 2)
        shard = sum(b.numel for b in buf.buckets) // dp
        # elements each level carries away from this rank: intra (L-1) peers x N shards (one shard
        # without an inter level), inter (N-1) shards, parameters (dp-1) copies of the shard
        sent_elems = {"grad_intra": (L - 1) * (N if N > 1 else 1) * shard, "grad_inter": (N - 1) * shard,
                      "grad": (dp - 1) * shard, "param": (dp - 1) * shard}
        rec["bits_per_element_sent"] = {k: round(8 * v / sent_elems[k], 3) for k, v in quant.items() if v}
        out[name] = rec
        print(name, json.dumps({k: rec[k] for k in ("plain_MiB", "sdp4bit_MiB", "bits_per_element_sent",
                                                     "total_ratio_plain_over_sdp4bit")}), flush=True)
    results["bytes_per_step_1p36B"] = out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--elements", type=int, default=256 * 2 ** 20)
    args = ap.parse_args()
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__}
    results["commit"] = source_commit()
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name()
        try:
            import triton
            results["triton"] = triton.__version__
            kernel_part(results, args.elements)
        except Exception as e:
            results["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    else:
        results["kernels"] = "skipped: no CUDA device"
    _safe(results, "bytes_per_step_1p36B", lambda: bytes_part(results))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
