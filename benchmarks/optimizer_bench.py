#!/usr/bin/env python
"""Optimizer-step benchmark on one GPU, one 256M-element shard:

  kernels    the fused AdamW kernel (csrc/fused_adamw.cu) with FP8 moments (expansion in the
             fast exp2/log2 form, the default, and in COAT's exact powf form; absmax),
             bf16 moments and fp32 moments, each writing the bf16 weights in the same pass,
             bf16 or fp32 gradients; torch.optim.AdamW(fused=True) with fp32 states (alone and
             followed by the separate master -> bf16 copy); the torch reference under
             torch.compile (what runs when the kernel is missing). Time per step (CUDA events,
             median), bytes read + written, GB/s and the fraction of ~4.3 TB/s; a device copy
             of the same bytes (what the memory system delivers); the target for FP8 with
             expansion (<= 1.0 ms per 256M shard, >= 60% of 4.3 TB/s,
             faster than torch.optim.AdamW(fused=True) with fp32 states).
  variants   every kernel case above under every variant of the kernel (csrc/fused_adamw.cu Variant0-7:
             0-3 work distributions with the same operations, 4-7 with the update's sqrt and division
             approximate; `kernels` times the codec's choice, FASTEST_VARIANT of optim/fp8_adam.py):
             ms and % of HBM per case x variant, and for each variant its state after a few steps
             equal to variant 0's (0-3: masters, weights, codes, s/k/c bit for bit; 4-7: all but the
             master and weights bit for bit, the master within 1e-6 relative), per format and
             gradient dtype, on chunks not multiples of 128 with misaligned gradients.
  agreement  on the GPU, fast vs exact form after 20 steps of the kernel from the same start:
             identical codes, max code distance, identical k, parameter difference.
  memory     optimizer-state bytes per parameter of each format.
  error      quantization error of m / sqrt(v) with FP8 moments without vs with expansion, on
             moments captured from a short training run of a small GPT (megacoat's model, fp32
             states) on synthetic Markov-chain tokens (no data set needed; stated in the output).

    python benchmarks/optimizer_bench.py --out optimizer_bench.json

Every part is independent: a failure is recorded in the JSON and the others still run.
"""
import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import source_commit  # noqa: E402

import torch  # noqa: E402

from megacoat.config import OptimizerConfig  # noqa: E402
from megacoat.optim.fp8_adam import (EXACT_VARIANTS, GROUP, KERNEL_VARIANTS, Chunk, PrecisionAwareAdamW,  # noqa: E402
                                     decay_table, dequantize_groups, fused_extension, group_stats,
                                     moment_bytes_per_element, quantize_groups)

from bench_timing import HBM_GBPS, timed  # noqa: E402


def step_bytes(fmt: str, grad_bytes: int, weight_bytes: int = 2) -> float:
    """Bytes per element one fused step reads + writes: master r/w, gradient, both moments r/w
    (FP8: codes plus s, k, c per group), the bf16 weight written."""
    return 8 + grad_bytes + 2 * 2 * moment_bytes_per_element(fmt) + weight_bytes


def codec_case(n: int, fmt: str, expand: bool, grad_dtype, use_kernel=True, fast=True):
    dev = torch.device("cuda")
    master = torch.randn(n, device=dev) * 0.02
    grad = (torch.randn(n, device=dev) * 1e-3).to(grad_dtype)
    weight = torch.empty(n, dtype=torch.bfloat16, device=dev)
    decay = torch.ones(n // GROUP, dtype=torch.bool, device=dev)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    codec = PrecisionAwareAdamW(master, [Chunk(0, n, grad, weight)], decay, cfg, fmt, fmt, expand=expand,
                                use_kernel=use_kernel, fast_expansion=fast)
    return codec, grad


CASES = [("fp8_expand_bf16grad", "fp8", True, torch.bfloat16, True),
         ("fp8_expand_fp32grad", "fp8", True, torch.float32, True),
         ("fp8_expand_exact_bf16grad", "fp8", True, torch.bfloat16, False),
         ("fp8_absmax_bf16grad", "fp8", False, torch.bfloat16, True),
         ("bf16_states_bf16grad", "bf16", True, torch.bfloat16, True),
         ("fp32_states_fp32grad", "fp32", True, torch.float32, True),
         ("fp32_states_bf16grad", "fp32", True, torch.bfloat16, True)]
# As in csrc/fused_adamw.cu (registers: ptxas for sm_90a, no spills in any).
VARIANT_NAMES = {0: "8 lanes x 16 elements per group, 4 groups/warp, 2 blocks/SM (<= 128 regs)",
                 1: "variant 0 + L2 bulk prefetch of the warp's next unit",
                 2: "16 lanes x 8 elements per group, 2 groups/warp, 3 blocks/SM (<= 85 regs)",
                 3: "variant 2 + L2 bulk prefetch of the warp's next unit",
                 4: "variant 0, the update's sqrt and division approximate (MUFU; master within 1e-6)",
                 5: "variant 2, the update's sqrt and division approximate (MUFU; master within 1e-6)",
                 6: "variant 4, the next unit's loads as cp.async into shared memory (FP8 moments; else 4)",
                 7: "variant 5, the next unit's loads as cp.async into shared memory (FP8 moments; else 5)"}


def bench_kernels(n: int, iters: int, out: dict) -> None:
    if fused_extension() is None:
        raise RuntimeError("the fused AdamW extension did not build")
    norm = torch.tensor(0.5, device="cuda")
    for name, fmt, expand, gd, fast in CASES:
        try:
            codec, _ = codec_case(n, fmt, expand, gd, fast=fast)
            assert codec.ext is not None
            ms = timed(lambda: codec.step(1e-3, norm), iters)
            nbytes = step_bytes(fmt, torch.tensor([], dtype=gd).element_size()) * n
            out[name] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6, "frac_of_hbm": nbytes / ms / 1e6 / HBM_GBPS}
            print(f"{name:28s} {ms:8.3f} ms  {nbytes / ms / 1e6:8.0f} GB/s ({100 * nbytes / ms / 1e6 / HBM_GBPS:.0f}% "
                  f"of {HBM_GBPS:.0f})", flush=True)
            del codec
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            print(f"{name}: FAILED {e}", flush=True)
        torch.cuda.empty_cache()
    try:  # what the memory system delivers for the FP8 step's bytes: a device copy (half read, half written)
        nbytes = step_bytes("fp8", 2) * n
        src = torch.empty(int(nbytes) // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = timed(lambda: dst.copy_(src), iters)
        out["copy_same_bytes_as_fp8_bf16grad"] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}
        print(f"{'copy of the same bytes':28s} {ms:8.3f} ms  {nbytes / ms / 1e6:8.0f} GB/s", flush=True)
        del src, dst
    except Exception as e:  # noqa: BLE001
        out["copy_same_bytes_as_fp8_bf16grad"] = {"error": f"{type(e).__name__}: {e}"}
    fast = out.get("fp8_expand_bf16grad", {})
    if "ms" in fast:
        per_256m = fast["ms"] * (256 * 2 ** 20) / n
        out["target_fp8_expand"] = {"ms_per_256M": per_256m, "frac_of_hbm": fast["frac_of_hbm"],
                                    "meets_1ms": per_256m <= 1.0, "meets_60pct": fast["frac_of_hbm"] >= 0.6}
        print(f"target (FP8 expand, bf16 grads): {per_256m:.3f} ms per 256M (<= 1.0), "
              f"{100 * fast['frac_of_hbm']:.0f}% of HBM (>= 60%)", flush=True)


def bench_variants(n: int, iters: int, out: dict) -> None:
    """The bit-for-bit check of each variant against variant 0 (first: small, so a failing variant
    shows there), then every case x every variant on the same codec (same data), each variant
    timed twice (order 0..V-1, then back) keeping the faster median, so drift favours none."""
    if fused_extension() is None:
        raise RuntimeError("the fused AdamW extension did not build")
    out["names"] = {str(v): VARIANT_NAMES.get(v, "") for v in range(KERNEL_VARIANTS)}
    out["same_state_as_variant0"] = variants_same_state()
    norm = torch.tensor(0.5, device="cuda")
    variants = list(range(KERNEL_VARIANTS))
    timing = out["timing"] = {}
    for name, fmt, expand, gd, fast in CASES:
        row = timing[name] = {}
        try:
            codec, _ = codec_case(n, fmt, expand, gd, fast=fast)
            assert codec.ext is not None
            nbytes = step_bytes(fmt, torch.tensor([], dtype=gd).element_size()) * n
            best = {}
            for v in variants + variants[::-1]:
                codec.variant = v
                best[v] = min(best.get(v, float("inf")), timed(lambda: codec.step(1e-3, norm), iters))
            for v in variants:
                row[str(v)] = {"ms": best[v], "frac_of_hbm": nbytes / best[v] / 1e6 / HBM_GBPS}
            row["fastest"] = min(variants, key=lambda v: best[v])
            row["fastest_exact"] = min(range(EXACT_VARIANTS), key=lambda v: best[v])  # bit-identical to the reference
            del codec
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"variants {name}: FAILED {e}", flush=True)
        torch.cuda.empty_cache()
    print(f"{'case':28s}" + "".join(f"{'variant ' + str(v):>17s}" for v in variants) + "  fastest (exact)", flush=True)
    for name, row in timing.items():
        if "error" in row:
            continue
        cells = "".join(f"{row[str(v)]['ms']:8.3f} ms {100 * row[str(v)]['frac_of_hbm']:3.0f}% " for v in variants)
        print(f"{name:28s}{cells}  {row['fastest']} ({row['fastest_exact']})", flush=True)


def variants_same_state(steps: int = 4) -> dict:
    """Per format and gradient dtype: each variant's state after `steps` steps equal to variant
    0's, from the same start and gradients (several chunks, none a multiple of 128, gradients at
    an odd offset: the scalar paths and chunk ends; clipping and exact zeros on some steps)."""
    sizes = [3_000_001, 77, 4099, 131_077]
    res = {}
    for tag, fmt, expand, fast in (("fp8_expand", "fp8", True, True), ("fp8_expand_exact", "fp8", True, False),
                                   ("fp8_absmax", "fp8", False, True), ("bf16_states", "bf16", True, True),
                                   ("fp32_states", "fp32", True, True)):
        for gd in (torch.bfloat16, torch.float32):
            key = f"{tag}_{'bf16' if gd == torch.bfloat16 else 'fp32'}grad"
            try:
                states = []
                for v in range(KERNEL_VARIANTS):
                    codec, grad_buf = variant_codec(sizes, fmt, expand, fast, gd)
                    codec.variant = v
                    gen = torch.Generator(device="cuda").manual_seed(1)
                    for t in range(steps):
                        x = torch.randn(grad_buf.numel(), generator=gen, device="cuda") * 10.0 ** (-(t % 4))
                        if t == 2:
                            x[7:5000] = 0
                        grad_buf.copy_(x.to(gd))
                        codec.step(1e-3, grad_buf.float().norm())
                    states.append([codec.master, codec.step_count] + codec.m.tensors() + codec.v.tensors()
                                  + [c.weight for c in codec.chunks])
                res[key] = {str(v): same_state(states[0], states[v], v < EXACT_VARIANTS, len(sizes))
                            for v in range(1, KERNEL_VARIANTS)}
            except Exception as e:  # noqa: BLE001
                res[key] = {"error": f"{type(e).__name__}: {e}"}
            print(f"same state as variant 0 ({key}; 0-3 bit for bit, 4-7 moments bit for bit and master within 1e-6): "
                  f"{res[key]}", flush=True)
            torch.cuda.empty_cache()
    res["all"] = all(ok is True for r in res.values() for ok in r.values())
    return res


def same_state(ref, other, exact: bool, n_weights: int) -> bool:
    """[master, step, moment tensors..., n_weights bf16 weights] of two runs: equal bit for bit (exact
    variants), or (FAST_UPDATE variants) the step and moments bit for bit, the master within 1e-6
    relative and each weight the bf16 rounding of its own run's master (checked by the tests)."""
    if exact:
        return all(torch.equal(a, b) for a, b in zip(ref, other))
    rel = ((ref[0] - other[0]).abs().max() / ref[0].abs().max()).item()
    end = len(ref) - n_weights
    return bool(rel <= 1e-6 and all(torch.equal(a, b) for a, b in zip(ref[1:end], other[1:end])))


def variant_codec(sizes, fmt, expand, fast, grad_dtype):
    """A codec over chunks of `sizes` elements (padded to groups), gradients at offset 3 of one
    buffer, weights written; the same masters for every call."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    offsets, n = [], 0
    for s in sizes:
        offsets.append(n)
        n += -(-s // GROUP) * GROUP
    master = torch.zeros(n, device=dev)
    grad_buf = torch.zeros(sum(sizes) + 3, dtype=grad_dtype, device=dev)
    chunks, pos = [], 3
    for s, off in zip(sizes, offsets):
        master[off: off + s] = torch.randn(s, generator=gen, device=dev) * 0.02
        chunks.append(Chunk(off, off + -(-s // GROUP) * GROUP, grad_buf[pos: pos + s],
                            torch.zeros(s, dtype=torch.bfloat16, device=dev)))
        pos += s
    decay = decay_table([(off, s, i % 2 == 0) for i, (off, s) in enumerate(zip(offsets, sizes))], n, dev)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    codec = PrecisionAwareAdamW(master, chunks, decay, cfg, fmt, fmt, expand=expand, fast_expansion=fast)
    assert codec.ext is not None
    return codec, grad_buf


def bench_fast_vs_exact(n: int, steps: int, out: dict) -> None:
    """The kernel's fast and exact expansion forms from the same start, the same gradients."""
    runs = []
    for fast in (False, True):
        torch.manual_seed(0)
        codec, grad = codec_case(n, "fp8", True, torch.bfloat16, fast=fast)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for t in range(steps):
            rows = torch.exp(torch.randn(n // GROUP, 1, generator=gen, device="cuda") * 1.5)
            grad.copy_((torch.randn(n // GROUP, GROUP, generator=gen, device="cuda") * rows * 1e-3).view(-1))
            codec.step(1e-3, torch.zeros((), device="cuda"))
        runs.append(codec)
    a, b = runs
    for name in ("m", "v"):
        qa, qb = getattr(a, name), getattr(b, name)
        ia, ib = qa.data.int(), qb.data.int()
        oa, ob = torch.where(ia >= 128, 128 - ia, ia), torch.where(ib >= 128, 128 - ib, ib)
        out[name] = {"codes_identical": (qa.data == qb.data).float().mean().item(),
                     "max_code_distance": int((oa - ob).abs().max()),
                     "k_identical": (qa.k == qb.k).float().mean().item()}
    out["master_rel_l2"] = ((a.master - b.master).norm() / a.master.norm()).item()
    out["steps"], out["elements"] = steps, n
    print("fast vs exact after", steps, "steps:", {k: out[k] for k in ("m", "v", "master_rel_l2")}, flush=True)


def bench_torch_adamw(n: int, iters: int, out: dict) -> None:
    p = torch.nn.Parameter(torch.randn(n, device="cuda") * 0.02)
    p.grad = torch.randn(n, device="cuda") * 1e-3
    w = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ms = timed(opt.step, iters)
    nbytes = 28.0 * n  # param r/w, fp32 grad, both fp32 moments r/w
    out["torch_adamw_fused_fp32"] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                                     "frac_of_hbm": nbytes / ms / 1e6 / HBM_GBPS}
    print(f"{'torch_adamw_fused_fp32':28s} {ms:8.3f} ms  {nbytes / ms / 1e6:8.0f} GB/s", flush=True)

    def step_and_copy():
        opt.step()
        w.copy_(p.detach())
    ms2 = timed(step_and_copy, iters)
    out["torch_adamw_fused_fp32_plus_bf16_copy"] = {"ms": ms2, "bytes": 34.0 * n, "GBps": 34.0 * n / ms2 / 1e6}
    print(f"{'  + separate bf16 copy':28s} {ms2:8.3f} ms", flush=True)
    del opt, p, w
    torch.cuda.empty_cache()


def bench_compiled_reference(n: int, iters: int, out: dict) -> None:
    codec, _ = codec_case(n, "fp8", True, torch.bfloat16, use_kernel=False)
    norm = torch.tensor(0.5, device="cuda")
    t0 = time.time()
    codec.step(1e-3, norm)  # compiles
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    ms = timed(lambda: codec.step(1e-3, norm), iters, warmup=1)
    nbytes = step_bytes("fp8", 2) * n
    out["reference_compiled_fp8_expand"] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                                            "first_call_s": compile_s}
    print(f"{'reference (torch.compile)':28s} {ms:8.3f} ms  (first call {compile_s:.1f} s)", flush=True)


def small_gpt_moments(steps: int, device: str = "cuda", batch: int = 16):
    """Adam moments (fp32) of a small GPT trained `steps` steps on synthetic Markov-chain tokens."""
    from megacoat.config import ModelConfig, resolve_model_defaults
    from megacoat.model.gpt import GPTModel, padded_vocab_size
    from megacoat.model.loss import masked_mean_loss
    from megacoat.model.transformer import LayerContext
    from megacoat.parallel.context import ParallelContext
    from megacoat.parallel.random import seed_everything

    dev = torch.device(device)
    ctx = ParallelContext.single(dev)
    m = ModelConfig(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256)
    resolve_model_defaults(m)
    vocab = 4096
    rng = seed_everything(1234, 0, dev)
    model = GPTModel(m, LayerContext(ctx.tp_group, False, rng, torch.float32, dev, 1234), vocab,
                     padded_vocab_size(vocab, 128, 1))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g, device=dev)  # each token has 4 likely successors
    losses = []
    for step in range(steps):
        b, s = batch, m.seq_length
        tok = torch.empty(b, s + 1, dtype=torch.long, device=dev)
        tok[:, 0] = torch.randint(0, vocab, (b,), generator=g, device=dev)
        choice = torch.randint(0, 4, (b, s), generator=g, device=dev)
        noise = torch.rand(b, s, generator=g, device=dev) < 0.1
        rand = torch.randint(0, vocab, (b, s), generator=g, device=dev)
        for i in range(s):
            tok[:, i + 1] = torch.where(noise[:, i], rand[:, i], nxt[tok[:, i], choice[:, i]])
        pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits_loss = model(tok[:, :-1], pos, labels=tok[:, 1:])
        loss = masked_mean_loss(logits_loss, torch.ones(b, s, device=dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    moments = [(opt.state[p]["exp_avg"].reshape(-1), opt.state[p]["exp_avg_sq"].reshape(-1)) for p in params]
    return moments, losses


def quantization_error(moments, eps: float = 1e-8) -> dict:
    """MSE of m / (sqrt(v) + eps) after FP8 round trips of both moments (groups of 128 per tensor)."""
    out = {}
    for expand, fast in ((False, False), (True, False), (True, True)):
        se, ref_sq, count = 0.0, 0.0, 0
        for m, v in moments:
            n = m.numel()
            size = -(-n // GROUP) * GROUP
            mm = torch.zeros(size, device=m.device)
            vv = torch.zeros(size, device=m.device)
            mm[:n], vv[:n] = m, v
            rt = []
            for x in (mm, vv):
                x2 = x.view(-1, GROUP)
                s, k, c = group_stats(x2, expand)
                q = quantize_groups(x2, s, k, c, expand, fast)
                rt.append(dequantize_groups(q, s, k, c, expand, fast).view(-1)[:n])
            r = m / (v.sqrt() + eps)
            rq = rt[0] / (rt[1].clamp_min(0).sqrt() + eps)
            se += float(((rq - r) ** 2).sum())
            ref_sq += float((r ** 2).sum())
            count += n
        name = ("expand_fast" if fast else "expand") if expand else "absmax"
        out[name] = {"mse": se / count, "relative_mse": se / ref_sq}
    out["ratio_expand_over_absmax"] = out["expand"]["mse"] / out["absmax"]["mse"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--elements", type=int, default=256 * 2 ** 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--parts", default="", help="comma-separated subset of kernels,variants,torch_adamw,"
                    "fast_vs_exact,compiled_reference,quantization_error (default: all)")
    ap.add_argument("--step-only", metavar="CASE:VARIANT", default="",
                    help="only run 3 steps of one case (a name of CASES) under one kernel variant and exit: the "
                    "target for a profiler, e.g. ncu --kernel-name regex:adamw_kernel --launch-skip 2")
    args = ap.parse_args()
    want = set(filter(None, args.parts.split(",")))
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    n = args.elements // GROUP * GROUP
    if args.step_only:
        case, _, variant = args.step_only.rpartition(":")
        spec = {c[0]: c[1:] for c in CASES}
        if case not in spec or not variant.isdigit() or int(variant) >= KERNEL_VARIANTS:
            sys.exit(f"--step-only CASE:VARIANT, got {args.step_only!r}: CASE one of {sorted(spec)}, "
                     f"VARIANT 0-{KERNEL_VARIANTS - 1}")
        fmt, expand, gd, fast = spec[case]
        codec, _ = codec_case(n, fmt, expand, gd, fast=fast)
        if codec.ext is None:
            sys.exit("--step-only: the fused AdamW extension did not build (nothing to profile)")
        codec.variant = int(variant)
        for _ in range(3):
            codec.step(1e-3, torch.tensor(0.5, device="cuda"))
        torch.cuda.synchronize()
        return
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "elements": n, "hbm_GBps_assumed": HBM_GBPS, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    res["commit"] = source_commit()
    res["state_bytes_per_param"] = {f"{a}/{b}": moment_bytes_per_element(a) + moment_bytes_per_element(b)
                                    for a, b in (("fp32", "fp32"), ("bf16", "bf16"), ("fp8", "fp8"), ("bf16", "fp8"))}
    print("optimizer-state bytes per parameter:", res["state_bytes_per_param"], flush=True)
    parts = [("kernels", lambda r: bench_kernels(n, args.iters, r)),
             ("variants", lambda r: bench_variants(n, args.iters, r)),
             ("torch_adamw", lambda r: bench_torch_adamw(n, args.iters, r)),
             ("fast_vs_exact", lambda r: bench_fast_vs_exact(min(n, 16 * 2 ** 20), 20, r))]
    if not args.skip_compiled:
        parts.append(("compiled_reference", lambda r: bench_compiled_reference(n, max(3, args.iters // 4), r)))
    parts = [p for p in parts if not want or p[0] in want]
    for name, fn in parts:
        res[name] = {}
        t0 = time.time()
        try:
            fn(res[name])
        except Exception as e:  # noqa: BLE001 - record and go on
            res[name]["error"] = f"{type(e).__name__}: {e}"
            res[name]["trace"] = traceback.format_exc()[-3000:]
            print(f"{name}: FAILED {e}", flush=True)
        res[name]["wall_s"] = time.time() - t0
        torch.cuda.empty_cache()
    fp8 = res.get("kernels", {}).get("fp8_expand_bf16grad", {})
    torch_fused = res.get("torch_adamw", {}).get("torch_adamw_fused_fp32", {})
    if "ms" in fp8 and "ms" in torch_fused:  # the fused FP8 step should beat torch's fp32 AdamW alone
        res["kernels"]["target_fp8_expand"]["faster_than_torch_fused_fp32"] = fp8["ms"] < torch_fused["ms"]
        print(f"FP8 expand (bf16 grads) {fp8['ms']:.3f} ms vs torch AdamW(fused) fp32 {torch_fused['ms']:.3f} ms",
              flush=True)
    if not want or "quantization_error" in want:
        try:
            t0 = time.time()
            moments, losses = small_gpt_moments(args.train_steps)
            err = quantization_error(moments)
            err["moments_from"] = (f"megacoat GPT 4 layers x 512, vocab 4096, seq 256, batch 16, {args.train_steps} "
                                   "steps of torch AdamW (fp32 states, bf16 autocast) on synthetic Markov-chain tokens")
            err["loss_first_last"] = [losses[0], losses[-1]]
            err["wall_s"] = time.time() - t0
            res["quantization_error"] = err
            print(f"m/sqrt(v) MSE: absmax {err['absmax']['mse']:.4g}, expand {err['expand']['mse']:.4g} "
                  f"(fast form {err['expand_fast']['mse']:.4g}), ratio "
                  f"{err['ratio_expand_over_absmax']:.3f} (COAT: 0.61; target <= 0.65)", flush=True)
        except Exception as e:  # noqa: BLE001
            res["quantization_error"] = {"error": f"{type(e).__name__}: {e}",
                                         "trace": traceback.format_exc()[-3000:]}
            print(f"quantization error: FAILED {e}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
