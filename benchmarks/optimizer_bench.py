#!/usr/bin/env python
"""Optimizer-step benchmark on one GPU, one 256M-element shard:

  kernels    the fused AdamW kernel (csrc/fused_adamw.cu) with FP8 moments (expansion in the
             exp2/log2 form; absmax), bf16 moments and fp32 moments, each in the kernel configuration
             its format runs (csrc/fused_adamw.cu ConfigFor), writing the bf16 weights in the same pass,
             bf16 or fp32 gradients; torch.optim.AdamW(fused=True) with fp32 states (alone and
             followed by the separate master -> bf16 copy); the torch reference under
             torch.compile (what runs when the kernel is missing). Time per step (CUDA events,
             median), bytes read + written, GB/s and the fraction of ~4.3 TB/s; a device copy
             of the same bytes (what the memory system delivers); the target for FP8 with
             expansion (<= 1.0 ms per 256M shard, >= 60% of 4.3 TB/s,
             faster than torch.optim.AdamW(fused=True) with fp32 states).
  agreement  on the GPU, the expansion's exp2/log2 form (the codec's) vs COAT's powf form after 20
             steps of the torch reference from the same start: identical codes, max code distance,
             identical k, parameter difference.
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
from megacoat.optim.fp8_adam import (GROUP, AdamHyper, Chunk, MomentState, PrecisionAwareAdamW,  # noqa: E402
                                     dequantize_groups, fused_extension, group_stats, moment_bytes_per_element,
                                     quantize_groups, reference_step)

from bench_timing import HBM_GBPS, timed  # noqa: E402


def step_bytes(fmt: str, grad_bytes: int, weight_bytes: int = 2) -> float:
    """Bytes per element one fused step reads + writes: master r/w, gradient, both moments r/w
    (FP8: codes plus s, k, c per group), the bf16 weight written."""
    return 8 + grad_bytes + 2 * 2 * moment_bytes_per_element(fmt) + weight_bytes


def codec_case(n: int, fmt: str, expand: bool, grad_dtype, use_kernel=True):
    dev = torch.device("cuda")
    master = torch.randn(n, device=dev) * 0.02
    grad = (torch.randn(n, device=dev) * 1e-3).to(grad_dtype)
    weight = torch.empty(n, dtype=torch.bfloat16, device=dev)
    decay = torch.ones(n // GROUP, dtype=torch.bool, device=dev)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    codec = PrecisionAwareAdamW(master, [Chunk(0, n, grad, weight)], decay, cfg, fmt, fmt, expand=expand,
                                use_kernel=use_kernel)
    return codec, grad


CASES = [("fp8_expand_bf16grad", "fp8", True, torch.bfloat16),
         ("fp8_expand_fp32grad", "fp8", True, torch.float32),
         ("fp8_absmax_bf16grad", "fp8", False, torch.bfloat16),
         ("bf16_states_bf16grad", "bf16", True, torch.bfloat16),
         ("fp32_states_fp32grad", "fp32", True, torch.float32),
         ("fp32_states_bf16grad", "fp32", True, torch.bfloat16)]


def bench_kernels(n: int, iters: int, out: dict) -> None:
    if fused_extension() is None:
        raise RuntimeError("the fused AdamW extension did not build")
    norm = torch.tensor(0.5, device="cuda")
    for name, fmt, expand, gd in CASES:
        try:
            codec, _ = codec_case(n, fmt, expand, gd)
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


def bench_fast_vs_exact(n: int, steps: int, out: dict) -> None:
    """The expansion's two forms (the reference's fast=True, what the codec runs, and fast=False, COAT's powf
    form) from the same start, the same gradients: the torch reference on the GPU."""
    hp = AdamHyper(0.9, 0.95, 1e-8, 0.1)
    decay = torch.ones(n // GROUP, dtype=torch.bool, device="cuda")
    runs = []
    for fast in (False, True):
        torch.manual_seed(0)
        master = torch.randn(n, device="cuda") * 0.02
        m, v = MomentState("fp8", n, "cuda", True, fast), MomentState("fp8", n, "cuda", True, fast)
        step = torch.zeros((), device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        for t in range(steps):
            rows = torch.exp(torch.randn(n // GROUP, 1, generator=gen, device="cuda") * 1.5)
            grad = (torch.randn(n // GROUP, GROUP, generator=gen, device="cuda") * rows * 1e-3).view(-1)
            reference_step(master, [Chunk(0, n, grad)], m, v, decay, hp, 1e-3, torch.ones((), device="cuda"), step)
            step += 1
        runs.append((master, m, v))
    (pa, ma, va), (pb, mb, vb) = runs
    for name, qa, qb in (("m", ma, mb), ("v", va, vb)):
        ia, ib = qa.data.int(), qb.data.int()
        oa, ob = torch.where(ia >= 128, 128 - ia, ia), torch.where(ib >= 128, 128 - ib, ib)
        out[name] = {"codes_identical": (qa.data == qb.data).float().mean().item(),
                     "max_code_distance": int((oa - ob).abs().max()),
                     "k_identical": (qa.k == qb.k).float().mean().item()}
    out["master_rel_l2"] = ((pa - pb).norm() / pa.norm()).item()
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
    ap.add_argument("--parts", default="", help="comma-separated subset of kernels,torch_adamw,"
                    "fast_vs_exact,compiled_reference,quantization_error (default: all)")
    ap.add_argument("--step-only", metavar="CASE", default="",
                    help="only run 3 steps of one case (a name of CASES) and exit: the target for a profiler, "
                    "e.g. ncu --kernel-name regex:adamw_kernel --launch-skip 2")
    args = ap.parse_args()
    want = set(filter(None, args.parts.split(",")))
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    n = args.elements // GROUP * GROUP
    if args.step_only:
        spec = {c[0]: c[1:] for c in CASES}
        if args.step_only not in spec:
            sys.exit(f"--step-only CASE, got {args.step_only!r}: CASE one of {sorted(spec)}")
        fmt, expand, gd = spec[args.step_only]
        codec, _ = codec_case(n, fmt, expand, gd)
        if codec.ext is None:
            sys.exit("--step-only: the fused AdamW extension did not build (nothing to profile)")
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
