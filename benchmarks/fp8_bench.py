"""COAT's FP8 training path on one GPU (H200): FP8 kernels, saved-activation bytes, FP8 linear vs bf16,
one transformer layer per recipe.

    python benchmarks/fp8_bench.py --out fp8_bench.json [--parts kernels,saved,linear,layer,wgrad,gemms,host,swiglubwd]
                                   [--no-sweep] [--no-compile] [--budget-s 160] [--sweep-budget-s 300]
    python benchmarks/fp8_bench.py --out /tmp/tiles.json --parts tiles     # the 1x16 tile sweep alone

Parts (each runs on its own: a failing part is recorded with its error and the others go on):
- kernels: every FP8 kernel on a 16384 x 4096 bf16 tensor (GPU time: triton.testing.do_bench of a CUDA
  graph replay, the eager-launch time beside it; bytes
  moved, GB/s and % of 4300 GB/s), against COAT's own Triton kernels measured on an H200 (COAT_US) and
  a plain copy; the eager per-tensor quantize + transpose as the unfused anchor (EAGER_QUANT_T_US).
  With sweep: a few tile configurations per kernel, the best reported (to pick the defaults).
- tiles: the sweep alone (no table rows): for each 1x16 kernel (quantize, dequantize, SiLU fwd/bwd,
  SwiGLU fwd/bwd) every (rows, groups, warps, split) of TILE_SWEEP, timed on the same data, each
  checked bit for bit against the default tiles' outputs (and the default's saved FP8 copies against
  the torch reference); the fastest identical one is reported with the TILES line to paste.
  `--sweep-budget-s` bounds it (default 300 s, so that `--parts tiles` or `kernels` fits a 10-minute run).
- saved: bytes saved for backward by one Llama layer (hidden 4096, ffn 11008, 32 heads, seq 2048,
  micro-batch 1), counted with saved-tensor hooks (storages deduplicated, weights and FP8 weight
  copies excluded), in U = batch * seq * hidden * 2 bytes: bf16 vs tensorwise vs coat (target: coat
  <= 0.60x bf16; COAT's table: 22.66U / TE 18.33U / COAT 13.33U); also the allocator's view.
- linear: forward + dgrad + wgrad of one layer's four linears at the 1.36B (8192 tokens) and 7B (4096
  tokens) shapes: bf16 vs FP8 (the full path: quantize, GEMMs, main_grad accumulation) and FP8 GEMMs
  alone (torch._scaled_mm tensorwise vs bf16 mm on an H200, torch 2.11: 3.33 -> 1.93 ms and 6.84 -> 3.72 ms).
- reductions: the amax and the norm backward (+ residual gradient) at the training shapes under every config
  of AMAX_SWEEP / NORM_BWD_SWEEP: time, % of HBM, checked against the default config.
- gemms: every FP8 GEMM of a 1.36B and a 7B layer (fwd, dgrad, wgrad of each linear): torch._scaled_mm vs
  the cuBLASLt extension with the heuristic's first algorithm vs tuned (fastest of `--gemm-candidates`).
- layer: one TransformerLayer (1.36B shape, seq 2048, micro-batch 4) forward + backward per recipe,
  eager and compiled: time and peak memory.
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

from megacoat.kernels import fp8 as K  # noqa: E402
from megacoat.kernels import fp8_act as KA  # noqa: E402
from megacoat.precision import fp8  # noqa: E402
from megacoat.precision.linear import Fp8WeightCache, fp8_gemm, fp8_linear, refresh_fp8_weights  # noqa: E402
from megacoat.precision.recipe import Fp8Recipe  # noqa: E402

HBM_GBS = 4300.0
# COAT's own Triton kernels (NVlabs/COAT) timed on an H200, 16384 x 4096 bf16, in us
COAT_US = {"quantize_1x16": 68.0, "copy": 67.0, "rmsnorm_fwd": 140.0, "silu_fwd": 79.0, "swiglu_fwd": 156.0}
EAGER_QUANT_T_US = 985.0  # eager-PyTorch per-tensor quantize + transpose of the same tensor, same H200
RECIPES = {"bf16": None, "tensorwise": Fp8Recipe(fp8_activations=False), "coat": Fp8Recipe()}


DEV = "cuda"
SMOKE = False  # --smoke: tiny shapes on the CPU, to check this script's logic without a GPU

# (rows, 16-groups, num_warps, split) tried per 1x16 kernel (the TILES entries of megacoat/kernels/fp8.py
# and fp8_act.py; split = threads per 16-group). Most likely first: the budget may stop a sweep early.
_Q_TILES = [(16, 16, 4, 1), (8, 32, 4, 1), (32, 16, 8, 1), (32, 8, 4, 1), (64, 8, 8, 1), (16, 32, 8, 1),
            (16, 16, 4, 2), (32, 16, 8, 2), (8, 32, 4, 2), (16, 32, 8, 2), (8, 16, 4, 2), (4, 64, 4, 2),
            (64, 16, 8, 2), (4, 64, 4, 1), (2, 128, 8, 2)]
_EW_TILES = [(16, 16, 4, 2), (8, 16, 4, 2), (32, 16, 8, 2), (8, 32, 8, 2), (4, 32, 4, 2), (2, 64, 4, 2),
             (16, 16, 4, 1), (8, 32, 4, 1), (8, 16, 4, 1), (32, 16, 8, 1), (4, 64, 8, 2), (16, 32, 8, 2),
             (32, 8, 4, 2), (64, 8, 8, 2)]
TILE_SWEEP = {"quantize_1x16": _Q_TILES, "dequantize_1x16": _Q_TILES, "act_fwd": _EW_TILES, "act_bwd": _EW_TILES,
              "swiglu_fwd": _EW_TILES, "swiglu_bwd": _EW_TILES}


# How the last bench_us call timed (read by _row): the timer and, with graph replay, the eager-launch time.
LAST_TIMING: dict = {}


def _graph_of(fn):
    """fn captured in a CUDA graph (one replay = one call of fn, no Python), or None if it cannot be."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up on the capture stream (allocator pools, lazy init)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph
    except Exception:  # a host sync or an uncapturable op inside fn: time its eager launches instead
        torch.cuda.synchronize()
        return None


def bench_us(fn, graph: bool = True) -> float:
    """GPU time of one call of fn, in us: triton's do_bench (L2 flushed before every repetition) of a CUDA
    graph replay of fn (`graph=False`: of fn's eager launches, what an eager step sees). Timed eager
    launches can include host time: the GPU reaches the start event after the L2 flush (~60 us) and then
    waits for the launches of a wrapper whose Python takes longer (both times are recorded; on the H200 they
    agreed within 2% for every kernel of `--parts kernels`)."""
    LAST_TIMING.clear()
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)
    from triton.testing import do_bench
    fn()  # compile / autotune outside the timed region (do_bench sizes its loop from a first call)
    torch.cuda.synchronize()
    eager_us = 1000.0 * do_bench(fn, warmup=25, rep=100)
    if not graph:
        LAST_TIMING.update(timer="eager launches")
        return eager_us
    graph = _graph_of(fn)
    if graph is None:
        LAST_TIMING.update(timer="eager launches (capture failed)")
        return eager_us
    LAST_TIMING.update(timer="CUDA graph replay", eager_launch_us=round(eager_us, 2))
    return 1000.0 * do_bench(graph.replay, warmup=25, rep=100)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _mem():
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


def _row(name, us, nbytes, anchor=None):
    gbs = nbytes / (us * 1e-6) / 1e9
    r = dict(kernel=name, time_us=round(us, 2), bytes=int(nbytes), gb_s=round(gbs, 1),
             pct_of_hbm=round(100 * gbs / HBM_GBS, 1), **LAST_TIMING)
    if anchor is not None:
        r["coat_us"] = anchor
        r["ours_over_coat"] = round(us / anchor, 3)
    eager = f" (eager launches {LAST_TIMING['eager_launch_us']:.1f})" if "eager_launch_us" in LAST_TIMING else ""
    print(f"  {name:34s} {us:9.1f} us {gbs:8.0f} GB/s {r['pct_of_hbm']:5.1f}%{eager}"
          + (f"  COAT {anchor:.0f} us -> x{us / anchor:.2f}" if anchor else ""), flush=True)
    return r


def part_kernels(args):
    if SMOKE:
        return dict(skipped="the Triton kernels need a GPU (tests/test_fp8_triton_interp.py checks them on CPU)")
    m, k = 16384, 4096
    n = m * k
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(m, k, device=dev, generator=g)).to(torch.bfloat16)
    x2 = (torch.randn(m, k, device=dev, generator=g)).to(torch.bfloat16)
    h = (torch.randn(m, 2 * k, device=dev, generator=g)).to(torch.bfloat16)
    w = torch.randn(k, device=dev, generator=g).to(torch.bfloat16)
    amax_x = K.amax(x)
    rows = []
    rows.append(_row("copy (x.clone)", bench_us(lambda: x.clone()), 4 * n, COAT_US["copy"]))
    rows.append(_row("amax (one pass, atomic max)", bench_us(lambda: K.amax(x)), 2 * n))
    rows.append(_row("cast e4m3 (given amax)", bench_us(lambda: K.cast_tensorwise(x, amax_x, "e4m3", False)), 3 * n))
    rows.append(_row("cast e4m3 + transposed copy", bench_us(lambda: K.cast_tensorwise(x, amax_x, "e4m3", True)),
                     4 * n))
    rows.append(_row("quantize_tensorwise+T (amax+cast)",
                     bench_us(lambda: fp8.quantize_tensorwise(x, "e4m3", transpose=True)), 6 * n))
    rows.append(_row("eager torch quantize+T (reference)",
                     bench_us(lambda: fp8.cast_tensorwise_reference(x, fp8.amax_reference(x), "e4m3", True)),
                     6 * n, EAGER_QUANT_T_US))
    # 1x16: read 2 bytes, write 1 byte + a bf16 scale per 16 elements
    rows.append(_row("quantize_1x16 e4m3", bench_us(lambda: K.quantize_1x16(x, "e4m3")), 3.125 * n,
                     COAT_US["quantize_1x16"]))
    q, s = K.quantize_1x16(x, "e4m3")
    rows.append(_row("dequantize_1x16 -> bf16", bench_us(lambda: K.dequantize_1x16(q, s, torch.bfloat16)), 3.125 * n))
    rows.append(_row("rmsnorm fwd (y bf16 + x 1x16 + rstd)",
                     bench_us(lambda: KA.norm_fwd(x, None, w, None, 1e-5, True)), 5.125 * n, COAT_US["rmsnorm_fwd"]))
    rows.append(_row("add + rmsnorm fwd (stream, y, 1x16)",
                     bench_us(lambda: KA.norm_fwd(x, x2, w, None, 1e-5, True)), 9.125 * n))
    out = KA.norm_fwd(x, None, w, None, 1e-5, True)
    rows.append(_row("rmsnorm bwd", bench_us(lambda: KA.norm_bwd(x2, out[3], out[4], out[5], out[6], w, False, True)),
                     5.125 * n))
    rows.append(_row("silu fwd (y + x 1x16)", bench_us(lambda: KA.act_fwd(x, "silu")), 5.125 * n, COAT_US["silu_fwd"]))
    rows.append(_row("gelu fwd (y + x 1x16)", bench_us(lambda: KA.act_fwd(x, "gelu")), 5.125 * n))
    a = KA.act_fwd(x, "silu")
    rows.append(_row("silu bwd", bench_us(lambda: KA.act_bwd(x2, a[2], a[3], "silu")), 5.125 * n))
    rows.append(_row("swiglu fwd (2 x [16384,4096] in)", bench_us(lambda: KA.swiglu_fwd(h)), 8.25 * n,
                     COAT_US["swiglu_fwd"]))
    sw = KA.swiglu_fwd(h)
    rows.append(_row("swiglu bwd", bench_us(lambda: KA.swiglu_bwd(x2, sw[2], sw[3])), 8.25 * n))
    result = {"shape": [m, k], "rows": rows}
    if args.sweep:
        result["sweep"] = _sweep(x, h, amax_x, n)
        result["tile_sweep"] = tile_sweep(x, x2, h, n, args.sweep_budget_s)
    return result


def part_swiglubwd(args):
    """The SwiGLU backward as the FP8 linear consumes it (per-tensor E5M2 codes in both layouts): the bf16 dh
    kernel + the cast (the path before) against the fused amax pass + recomputing cast, at the 1.36B model's
    [8192, 2 x 5632] and at [16384, 2 x 4096]; and the fused cast's tile sweep (same bytes required)."""
    if SMOKE:
        return dict(skipped="the Triton kernels need a GPU (tests/test_fp8_triton_interp.py checks them on CPU)")
    out = {}
    for m, f in ((8192, 5632), (16384, 4096)):
        n = m * f
        g = torch.Generator(device=DEV).manual_seed(1)
        h = torch.randn(m, 2 * f, device=DEV, generator=g).to(torch.bfloat16)
        dp = torch.randn(m, f, device=DEV, generator=g).to(torch.bfloat16)
        _, _, hq, hs = KA.swiglu_fwd(h)
        dh, dh_amax = KA.swiglu_bwd(dp, hq, hs)

        def two_kernels():
            d, a = KA.swiglu_bwd(dp, hq, hs)
            return K.cast_tensorwise(d, a, "e5m2", True)

        # bytes: dp 2n, the saved codes 2n, their bf16 scales n/4; dh / its codes 4n / 2n per layout
        rows = [_row("swiglu bwd (bf16 dh)", bench_us(lambda: KA.swiglu_bwd(dp, hq, hs)), 8.25 * n),
                _row("cast e5m2 + T of dh", bench_us(lambda: K.cast_tensorwise(dh, dh_amax, "e5m2", True)), 8 * n),
                _row("both (the path before)", bench_us(two_kernels), 16.25 * n),
                _row("fused: amax pass + cast", bench_us(lambda: KA.swiglu_bwd_quantized(dp, hq, hs, "e5m2")),
                     12.5 * n)]
        # the amax pass alone (the 1x16 kernel storing nothing): reads 4.25n bytes
        tile, grid = KA._ew_grid("swiglu_bwd_amax", m, f // 16)
        amax_only = lambda: KA._k().swiglu_bwd_kernel[grid](  # noqa: E731
            dp, hq, hs, dp, torch.zeros((), device=DEV), m, f, f // 16, STORE=False, **tile)
        rows.append(_row("the amax pass alone", bench_us(amax_only), 4.25 * n))
        want = two_kernels()
        sweep = []
        for name, tiles in (("swiglu_bwd_cast", ((128, 64, 8), (64, 128, 8), (64, 64, 4), (32, 128, 4), (32, 64, 4),
                                                 (16, 128, 4), (32, 256, 8), (64, 64, 2), (32, 128, 2))),
                            ("swiglu_bwd_amax", ((8, 16, 4, 1), (4, 64, 8, 2), (8, 64, 8, 2), (16, 32, 8, 2),
                                                 (8, 32, 4, 2), (16, 64, 8, 2), (32, 32, 8, 1)))):
            for tile in tiles:
                old = KA.TILES[name]
                KA.TILES[name] = tile
                try:
                    got = KA.swiglu_bwd_quantized(dp, hq, hs, "e5m2")
                    sweep.append(dict(table=name, tile=list(tile), same_codes=_identical(got[:3], want),
                                      time_us=round(bench_us(lambda: KA.swiglu_bwd_quantized(dp, hq, hs, "e5m2")), 2)))
                except Exception as e:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
                    sweep.append(dict(table=name, tile=list(tile), error=f"{type(e).__name__}: {str(e)[:200]}"))
                finally:
                    KA.TILES[name] = old
                print(f"  {name} {tile}: {sweep[-1].get('time_us', sweep[-1].get('error'))} us "
                      f"same codes {sweep[-1].get('same_codes')}", flush=True)
        out[f"{m}x{f}"] = dict(rows=rows, same_codes=_identical(KA.swiglu_bwd_quantized(dp, hq, hs, "e5m2")[:3], want),
                               tile_sweep=sweep)
    return out


def part_tiles(args):
    """The 1x16 tile sweep alone (same data as part kernels). With --smoke it runs under
    TRITON_INTERPRET=1 on the CPU (two tiles per kernel: checks this code, measures nothing)."""
    if SMOKE:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return dict(skipped="on the CPU the sweep needs TRITON_INTERPRET=1")
        m, k = 40, 200  # odd: masked row and group edges
    else:
        m, k = 16384, 4096
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(m, k, device=DEV, generator=g)).to(torch.bfloat16)
    x2 = (torch.randn(m, k, device=DEV, generator=g)).to(torch.bfloat16)
    h = (torch.randn(m, 2 * k, device=DEV, generator=g)).to(torch.bfloat16)
    return {"shape": [m, k], "tile_sweep": tile_sweep(x, x2, h, m * k, args.sweep_budget_s)}


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _identical(a, b) -> bool:
    """Every output tensor equal bit for bit (fp8 codes compared as bytes)."""
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return len(a) == len(b) and all(u.shape == v.shape and u.dtype == v.dtype and torch.equal(_bits(u), _bits(v))
                                    for u, v in zip(a, b))


def _timed_trials(configs, apply, restore, fn, check, nbytes, budget_s, t0, ok_key="ok"):
    """Each config applied (until `budget_s` after t0), fn timed and its output checked (`check(out)`, recorded
    under ok_key); `restore` afterwards -> (trials, the fastest that passed or None)."""
    res = []
    try:
        for cfg in configs:
            if time.time() - t0 > budget_s:
                res.append(dict(stopped=f"sweep budget {budget_s} s"))
                break
            apply(cfg)
            try:
                ok = check(fn())
                us = bench_us(fn)
                res.append({"config": list(cfg), "time_us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1),
                            "pct_of_hbm": round(100 * nbytes / us / 1e3 / HBM_GBS, 1), ok_key: ok})
            except Exception as e:  # noqa: BLE001 - a config may not compile (registers): record it
                res.append(dict(config=list(cfg), error=f"{type(e).__name__}: {str(e)[:200]}"))
    finally:
        restore()
    good = [r for r in res if "time_us" in r and r[ok_key]]
    return res, (min(good, key=lambda r: r["time_us"]) if good else None)


def tile_sweep(x, x2, h, n, budget_s=300.0):
    """Each 1x16 kernel under every TILE_SWEEP tile: time (same data) and bit-identity with the default
    tiles' outputs. -> {kernel: {default, default_us, trials, best, speedup_vs_default, tiles_line}}."""
    t0 = time.time()
    out = {}
    act_out = KA.act_fwd(x, "silu")
    sw_out = KA.swiglu_fwd(h)
    q, s = K.quantize_1x16(x, "e4m3")
    # the defaults' saved FP8 copies against the torch references (bit-exact by design)
    ref_q = fp8.quantize_1x16_reference(x, "e4m3")
    ref_h = fp8.quantize_1x16_reference(h.view(h.shape[0], 2, -1), "e4m3")
    out["default_matches_reference"] = dict(quantize_1x16=_identical((q, s), ref_q),
                                            act_fwd_saved=_identical(act_out[2:], ref_q),
                                            swiglu_fwd_saved=_identical(sw_out[2:], ref_h))
    print(f"  tile sweep: defaults vs torch references {out['default_matches_reference']}", flush=True)
    cases = {  # kernel: (TILES table, launcher, bytes moved)
        "quantize_1x16": (K.TILES, lambda: K.quantize_1x16(x, "e4m3"), 3.125 * n),
        "dequantize_1x16": (K.TILES, lambda: K.dequantize_1x16(q, s, torch.bfloat16), 3.125 * n),
        "act_fwd": (KA.TILES, lambda: KA.act_fwd(x, "silu"), 5.125 * n),
        "act_bwd": (KA.TILES, lambda: KA.act_bwd(x2, act_out[2], act_out[3], "silu"), 5.125 * n),
        "swiglu_fwd": (KA.TILES, lambda: KA.swiglu_fwd(h), 8.25 * n),
        "swiglu_bwd": (KA.TILES, lambda: KA.swiglu_bwd(x2, sw_out[2], sw_out[3]), 8.25 * n),
    }
    for name, (table, fn, nbytes) in cases.items():
        default = tuple(table[name])
        want = fn()
        cfgs = [default] + [c for c in TILE_SWEEP[name] if tuple(c) != default]
        res, best = _timed_trials(cfgs[:3] if SMOKE else cfgs, lambda c: table.__setitem__(name, tuple(c)),
                                  lambda: table.__setitem__(name, default), fn, lambda out: _identical(out, want),
                                  nbytes, budget_s, t0, ok_key="identical")
        d_us = res[0].get("time_us") if res and "time_us" in res[0] else None
        entry = dict(default=list(default), default_us=d_us, trials=res, best=best,
                     not_identical=[r["config"] for r in res if r.get("identical") is False])
        if best and d_us:
            entry["speedup_vs_default"] = round(d_us / best["time_us"], 3)
            entry["tiles_line"] = f'"{name}": {tuple(best["config"])}'
        out[name] = entry
        print(f"  tile sweep {name:16s} default {list(default)} {d_us} us -> best {best and best['config']} "
              f"{best and best['time_us']} us ({best and best['pct_of_hbm']}% of HBM)"
              + (f"; NOT IDENTICAL: {entry['not_identical']}" if entry["not_identical"] else ""), flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _sweep(x, h, amax_x, n):
    """Tiles of the per-tensor cast and the norm (the 1x16 kernels: tile_sweep); the defaults are
    whatever K.TILES / KA.TILES hold."""
    out = {}
    saved_k, saved_ka = dict(K.TILES), dict(KA.TILES)
    trials = {  # the 1x16 kernels: tile_sweep
        "cast+T": ("cast", [(32, 128, 4), (64, 64, 4), (64, 128, 8), (128, 128, 8)],
                   lambda: K.cast_tensorwise(x, amax_x, "e4m3", True), 4 * n, K.TILES),
    }
    for name, (key, configs, fn, nbytes, table) in trials.items():
        res = []
        for cfg in configs:
            table[key] = cfg
            try:
                us = bench_us(fn)
                res.append(dict(config=list(cfg), time_us=round(us, 2), gb_s=round(nbytes / us / 1e3, 1)))
            except Exception as e:  # noqa: BLE001 - a config may not compile (registers): record it
                res.append(dict(config=list(cfg), error=f"{type(e).__name__}: {str(e)[:200]}"))
        K.TILES.update(saved_k)
        KA.TILES.update(saved_ka)
        ok = [r for r in res if "time_us" in r]
        best = min(ok, key=lambda r: r["time_us"]) if ok else None
        print(f"  sweep {name}: best {best}", flush=True)
        out[name] = dict(trials=res, best=best)
    for e in (1024, 2048, 8192):  # elements (rows x hidden) per norm program
        KA.TILES["norm_elems_per_program"] = e
        w = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
        us = bench_us(lambda: KA.norm_fwd(x, None, w, None, 1e-5, True))
        out.setdefault("rmsnorm fwd", {}).setdefault("trials", []).append(dict(elems=e, time_us=round(us, 2)))
    KA.TILES.update(saved_ka)
    return out


AMAX_SWEEP = [(b, i, w) for b in (1024, 2048, 4096, 8192) for i in (1, 2, 4, 8) for w in (4, 8)]
# (a wider sweep, elements 2048-16384 x programs per SM 2-16 x warps 0/4/8/16, had its winners at 2048-4096 with
# 2-8 programs per SM on the H200; `--parts reductions` times this narrower one)
NORM_BWD_SWEEP = [(e, p, w, st) for e in (2048, 4096) for p in (2, 4, 8) for w in (0, 8, 16) for st in (1, 2)]
# (tokens, hidden) of the norms and amax passes in training: 1.36B (mbs 4), 7B (mbs 2), and COAT's 16384 x 4096;
# the amax also on the 1.36B qkv gradient (tokens x 3 * hidden).
REDUCTION_SHAPES = [(8192, 2048), (4096, 4096), (16384, 4096)]
AMAX_EXTRA_SHAPES = [(8192, 6144)]


def part_reductions(args):
    """The per-tensor amax and the norm backward (with the fused residual gradient: the post-attention norm's)
    at the training shapes, under every AMAX_SWEEP / NORM_BWD_SWEEP config: time, % of HBM and a check
    against the default config (amax equal; dx bit for bit, dw within fp32 summation-order error). The amax
    and the norm backward are the two kernels of the coat step furthest from the memory roofline (69% and
    57% of HBM at 16384 x 4096 on the H200, `--parts kernels`)."""
    t0 = time.time()
    out = {}
    shapes = [(40, 200)] if SMOKE else REDUCTION_SHAPES
    gen = torch.Generator(device=DEV).manual_seed(0)
    for m, k in shapes + ([] if SMOKE else AMAX_EXTRA_SHAPES):
        x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
        want = K.amax(x)
        default = tuple(K.TILES["amax"])
        cfgs = [default] + [c for c in AMAX_SWEEP if c != default]
        res, best = _timed_trials(cfgs[:3] if SMOKE else cfgs, lambda c: K.TILES.__setitem__("amax", c),
                                  lambda: K.TILES.__setitem__("amax", default), lambda: K.amax(x),
                                  lambda a: bool(torch.equal(a, want)), 2 * m * k, args.sweep_budget_s, t0)
        out[f"amax {m}x{k}"] = dict(default=list(default), trials=res, best=best)
        print(f"  amax {m}x{k}: default {res[0].get('time_us')} us -> best {best}", flush=True)
    for m, k in shapes:
        x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
        dy = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
        dres = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(torch.bfloat16)
        saved = KA.norm_fwd(x, None, w, None, 1e-5, True)

        def run():
            return KA.norm_bwd(dy, saved[3], saved[4], saved[5], saved[6], w, False, True, dres, want_amax=True)

        want = run()

        def check(got):
            # dx within a bf16 rounding of the default's (another tile sums the row in another order), the amax
            # of the dx written
            d = (got[0].float() - want[0].float()).abs()
            return (bool((d <= 2 ** -7 * want[0].float().abs() + 1e-6).all())
                    and bool(torch.allclose(got[1].float(), want[1].float(), rtol=1e-2, atol=1e-2))
                    and bool(torch.equal(got[3], got[0].float().abs().amax())))

        default = tuple(KA.TILES["norm_bwd"])
        cfgs = [default] + [c for c in NORM_BWD_SWEEP if c != default]
        # reads dy, dres (bf16), the saved 1x16 copy (1 byte + a bf16 scale per 16); writes dx (bf16)
        res, best = _timed_trials(cfgs[:3] if SMOKE else cfgs, lambda c: KA.TILES.__setitem__("norm_bwd", c),
                                  lambda: KA.TILES.__setitem__("norm_bwd", default), run, check,
                                  7.125 * m * k, args.sweep_budget_s, t0)
        out[f"norm_bwd+res {m}x{k}"] = dict(default=list(default), trials=res, best=best)
        print(f"  norm bwd + residual {m}x{k}: default {res[0].get('time_us')} us -> best {best}", flush=True)
    return out


# ------------------------------------------------------------------------------------ layers
def _llama_layer(recipe, hidden, ffn, heads, seq, compile_layer=False):
    from megacoat.config import ModelConfig, resolve_model_defaults
    from megacoat.model.transformer import LayerContext, TransformerLayer
    from megacoat.parallel.random import seed_everything

    m = ModelConfig(num_layers=24, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                    seq_length=seq, max_position_embeddings=seq, attention_dropout=0.0, hidden_dropout=0.0)
    resolve_model_defaults(m)
    dev = torch.device(DEV)
    rng = seed_everything(1, 0, dev)
    lc = LayerContext(None, False, rng, torch.bfloat16, dev, 1, fp8=recipe)
    layer = TransformerLayer(m, lc, 0)
    if compile_layer:
        layer.compile()
    return layer, m


def _rope(m, seq, dev):
    from megacoat.model.rope import RotaryEmbedding
    pos = torch.arange(seq, device=dev).unsqueeze(0)
    return RotaryEmbedding(m.kv_channels, seq, m.rotary_base, device=dev)(pos, torch.bfloat16)


def part_saved(args):
    hidden, ffn, heads, seq, mbs = (4096, 11008, 32, 2048, 1) if not SMOKE else (256, 688, 4, 64, 1)
    unit = mbs * seq * hidden * 2
    out = {"unit_bytes": unit, "shape": dict(hidden=hidden, ffn=ffn, heads=heads, seq=seq, micro_batch=mbs)}
    for name, recipe in RECIPES.items():
        try:
            layer, m = _llama_layer(recipe, hidden, ffn, heads, seq)
            refresh_fp8_weights(layer)
            rope = _rope(m, seq, torch.device(DEV))
            excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            for mod in layer.modules():
                c = getattr(mod, "fp8_cache", None)
                if c is not None and c.wq is not None:
                    excluded |= {t.untyped_storage().data_ptr() for t in (c.wq, c.wqt, c.scale)}
            for t in rope:
                excluded.add(t.untyped_storage().data_ptr())
            seen, by_dtype = {}, {}

            def pack(t):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in excluded and ptr not in seen:
                    seen[ptr] = st.nbytes()
                    key = str(t.dtype).replace("torch.", "")
                    by_dtype[key] = by_dtype.get(key, 0) + st.nbytes()
                return t

            x = torch.randn(seq, mbs, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            _sync()
            before = _mem()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x, rope)
            _sync()
            alloc = _mem() - before - y.numel() * y.element_size()
            total = sum(seen.values())
            out[name] = dict(saved_bytes=total, saved_U=round(total / unit, 2),
                             by_dtype_U={k: round(v / unit, 2) for k, v in by_dtype.items()},
                             allocator_delta_U=round(alloc / unit, 2))
            print(f"  {name:10s} saved {total / unit:6.2f} U  (allocator: {alloc / unit:6.2f} U)  {out[name]['by_dtype_U']}",
                  flush=True)
            del y, layer
            if DEV == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
            print(f"  {name}: FAILED {e}", flush=True)
    if "saved_U" in out.get("bf16", {}):
        for name in ("tensorwise", "coat"):
            if "saved_U" in out.get(name, {}):
                out[name]["ratio_vs_bf16"] = round(out[name]["saved_bytes"] / out["bf16"]["saved_bytes"], 3)
                print(f"  {name} / bf16 = {out[name]['ratio_vs_bf16']:.3f}", flush=True)
    return out


def part_linear(args):
    shapes = {"1.36B": dict(tokens=8192, h=2048, ffn=5632), "7B": dict(tokens=4096, h=4096, ffn=11008)}
    if SMOKE:
        shapes = {"1.36B": dict(tokens=64, h=64, ffn=176), "7B": dict(tokens=32, h=128, ffn=352)}
    anchors = {"1.36B": (3.33, 1.93), "7B": (6.84, 3.72)}
    out = {}
    dev = DEV
    hw = DEV == "cuda"
    from megacoat.kernels.fp8_gemm import lt_gemm_ops
    lt = hw and lt_gemm_ops() is not None  # the GEMMs training runs: the extension's C++ ops where they exist
    for name, s in shapes.items():
        t, h, f = s["tokens"], s["h"], s["ffn"]
        linears = {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, 2 * f), "fc2": (f, h)}
        res = {"bf16_ms": 0.0, "fp8_ms": 0.0, "fp8_given_amax_ms": 0.0, "fp8_gemms_only_ms": 0.0, "per_linear": {}}
        for lname, (kin, kout) in linears.items():
            x = torch.randn(t, kin, device=dev, dtype=torch.bfloat16)
            w = (torch.randn(kout, kin, device=dev) * 0.02).to(torch.bfloat16)
            g = torch.randn(t, kout, device=dev, dtype=torch.bfloat16)
            xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

            def bf16():
                y = torch.nn.functional.linear(xb, wb)
                y.backward(g)

            wf = w.clone().requires_grad_(True)
            wf.main_grad = torch.zeros(kout, kin, device=dev)
            wf.main_grad_overwrite = torch.ones(1, dtype=torch.bool)
            cache = Fp8WeightCache("e4m3")
            cache.refresh(wf)
            xf = x.clone().requires_grad_(True)
            amax = fp8.amax(x)

            def fp8_path(given=False):
                wf.main_grad_overwrite.fill_(True)  # one micro-batch per step: the GEMM writes main_grad
                y = fp8_linear(xf, wf, None, cache, Fp8Recipe(), x_amax=amax if given else None, fuse_wgrad=True,
                               hw_gemm=hw, lt_gemm=lt)
                y.backward(g)

            qx, qxt, sx = fp8.quantize_tensorwise(x, "e4m3", transpose=True)
            qg, qgt, sg = fp8.quantize_tensorwise(g, "e5m2", transpose=True)

            def gemms():
                fp8_gemm(qx, sx, cache.wq, cache.scale, torch.bfloat16, fast_accum=True, hw=hw, lt=lt)
                fp8_gemm(qg, sg, cache.wqt, cache.scale, torch.bfloat16, hw=hw, lt=lt)
                fp8_gemm(qgt, sg, qxt, sx, torch.float32, hw=hw, lt=lt)

            per = dict(bf16_ms=bench_us(bf16, graph=False) / 1000, fp8_ms=bench_us(fp8_path, graph=False) / 1000,
                       fp8_given_amax_ms=bench_us(lambda: fp8_path(True), graph=False) / 1000,
                       fp8_gemms_only_ms=bench_us(gemms, graph=False) / 1000)
            res["per_linear"][lname] = {k: round(v, 4) for k, v in per.items()}
            for k2, v in per.items():
                res[k2] += v
            # host (Python) time per call: when it reaches the GPU time, the path is launch-bound
            res["per_linear"][lname]["fp8_host_ms"] = round(_host_ms(fp8_path), 4)
            res["per_linear"][lname]["bf16_host_ms"] = round(_host_ms(bf16), 4)
            if lname == "proj" and not SMOKE:
                res["proj_profile"] = _profile_table(fp8_path)
        for k2 in ("bf16_ms", "fp8_ms", "fp8_given_amax_ms", "fp8_gemms_only_ms"):
            res[k2] = round(res[k2], 4)
        res["speedup_fp8"] = round(res["bf16_ms"] / res["fp8_ms"], 3)
        res["speedup_gemms_only"] = round(res["bf16_ms"] / res["fp8_gemms_only_ms"], 3)
        res["anchor_bf16_ms"], res["anchor_fp8_ms"] = anchors[name]
        print("  host ms per call (fp8 / bf16): " + ", ".join(
            f"{ln} {v['fp8_host_ms']:.3f}/{v['bf16_host_ms']:.3f}" for ln, v in res["per_linear"].items()), flush=True)
        print(f"  {name}: bf16 {res['bf16_ms']:.2f} ms | fp8 {res['fp8_ms']:.2f} ms (given amax "
              f"{res['fp8_given_amax_ms']:.2f}) x{res['speedup_fp8']:.2f} | FP8 GEMMs alone "
              f"{res['fp8_gemms_only_ms']:.2f} ms | anchors {anchors[name]}", flush=True)
        out[name] = res
    return out


def part_wgrad(args):
    """The weight-gradient GEMM into the fp32 gradient buffer, per linear of the 1.36B and 7B layers: the
    step's first micro-batch (overwrite: `_scaled_mm(out=)` vs the cuBLASLt extension with beta = 0) and
    the later ones (accumulate: `_scaled_mm` into a temporary + add, as before the extension, vs the
    extension with beta = 1). CUDA-graph replays, L2 flushed."""
    from megacoat.kernels.fp8_gemm import cuda_extension, fp8_wgrad_gemm
    shapes = {"1.36B": dict(tokens=8192, h=2048, ffn=5632), "7B": dict(tokens=4096, h=4096, ffn=11008)}
    if SMOKE:
        shapes = {"1.36B": dict(tokens=64, h=64, ffn=176)}
    have_ext = DEV == "cuda" and cuda_extension() is not None
    out = {"extension_built": have_ext}
    for name, s in shapes.items():
        t, h, f = s["tokens"], s["h"], s["ffn"]
        res = {}
        for lname, (kin, kout) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, 2 * f), "fc2": (f, h)}.items():
            qgt, _, sg = fp8.quantize_tensorwise(torch.randn(kout, t, device=DEV, dtype=torch.bfloat16), "e5m2")
            qxt, _, sx = fp8.quantize_tensorwise(torch.randn(kin, t, device=DEV, dtype=torch.bfloat16), "e4m3")
            mg = torch.zeros(kout, kin, device=DEV)
            flops = 2.0 * t * kin * kout
            row = {}

            def old_first():
                torch._scaled_mm(qgt, qxt.t(), scale_a=sg, scale_b=sx, out_dtype=torch.float32, out=mg)

            def old_accumulate():
                mg.add_(torch._scaled_mm(qgt, qxt.t(), scale_a=sg, scale_b=sx, out_dtype=torch.float32))

            runs = {} if SMOKE else {"scaled_mm_out_first": old_first, "scaled_mm_tmp_add_accumulate": old_accumulate}
            if have_ext:
                runs["ext_first"] = lambda: fp8_wgrad_gemm(mg, qgt, sg, qxt, sx, False)
                runs["ext_accumulate"] = lambda: fp8_wgrad_gemm(mg, qgt, sg, qxt, sx, True)
            for rname, fn in runs.items():
                if rname.startswith("ext") and fn() is not True:  # declined: timing it would time nothing
                    raise RuntimeError(f"the FP8 wgrad extension declined {lname} of {name}")
                us = bench_us(fn)
                row[rname] = dict(time_us=round(us, 1), tflops=round(flops / us / 1e6, 1))
            if "ext_accumulate" in row and "scaled_mm_tmp_add_accumulate" in row:
                row["accumulate_saving_us"] = round(row["scaled_mm_tmp_add_accumulate"]["time_us"]
                                                    - row["ext_accumulate"]["time_us"], 1)
            print(f"  {name} {lname} [{kout}x{kin}]x{t}: " + ", ".join(
                f"{k} {v['time_us']:.0f} us ({v['tflops']:.0f} TF/s)" for k, v in row.items() if isinstance(v, dict)),
                flush=True)
            res[lname] = row
        out[name] = res
    return out


def _layer_gemms(t, h, ffn):
    """The FP8 linear's GEMM problems of one Llama layer at `t` tokens, as the extension takes them: name ->
    (a rows, b rows, inner, a format, b format, out dtype, accumulate, fast_accum). fwd: y = xq wq^T (fast
    accumulation, as the forward runs it); dgrad: dx = gq wqt^T; wgrad: main_grad += gqt xqt^T."""
    out = {}
    for lname, (kin, kout) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, 2 * ffn), "fc2": (ffn, h)}.items():
        out[f"{lname} fwd"] = (t, kout, kin, "e4m3", "e4m3", torch.bfloat16, False, True)
        out[f"{lname} dgrad"] = (t, kin, kout, "e5m2", "e4m3", torch.bfloat16, False, False)
        out[f"{lname} wgrad"] = (kout, kin, t, "e5m2", "e4m3", torch.float32, True, False)
    return out


def part_gemms(args):
    """Every FP8 GEMM of the 1.36B and 7B layers: torch._scaled_mm (the forward and dgrad before the extension's
    ops), the cuBLASLt extension with the heuristic's first algorithm (candidates=1) and tuned (the extension's
    choice among up to `--gemm-candidates` algorithms, timed on the problem's first call). CUDA-graph replays, L2
    flushed; the tuned output is checked against _scaled_mm's."""
    from megacoat.kernels.fp8_gemm import cuda_extension
    ext = cuda_extension() if DEV == "cuda" else None
    if ext is None:
        return {"extension_built": False}
    shapes = {"1.36B": dict(t=8192, h=2048, ffn=5632), "7B": dict(t=4096, h=4096, ffn=11008)}
    out = {"extension_built": True, "candidates": args.gemm_candidates}
    for name, s in shapes.items():
        res, totals = {}, {"today": 0.0, "scaled_mm": 0.0, "heuristic": 0.0, "tuned": 0.0}
        for pname, (m, n, k, fa, fb, odt, acc, fast) in _layer_gemms(s["t"], s["h"], s["ffn"]).items():
            a, _, sa = fp8.quantize_tensorwise(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), fa)
            b, _, sb = fp8.quantize_tensorwise(torch.randn(n, k, device=DEV, dtype=torch.bfloat16), fb)
            o = torch.zeros(m, n, device=DEV, dtype=odt)
            flops = 2.0 * m * n * k
            reference = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                                         use_fast_accum=fast)
            runs = {"heuristic": lambda: ext.fp8_gemm(o, a, sa, b, sb, acc, fast, 1),
                    "tuned": lambda: ext.fp8_gemm(o, a, sa, b, sb, acc, fast, args.gemm_candidates)}
            if not acc:  # the weight gradient runs the extension already (no _scaled_mm adds into its output)
                runs["scaled_mm"] = lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=odt,
                                                             use_fast_accum=fast)
            row = {}
            for rname in ("scaled_mm", "heuristic", "tuned"):
                if rname not in runs:
                    continue
                if rname != "scaled_mm":
                    o.zero_()
                    if runs[rname]() is not True:
                        raise RuntimeError(f"the FP8 GEMM extension declined {pname} of {name}")
                    if rname == "tuned":
                        err = ((o.float() - reference).abs().max() / reference.abs().max()).item()
                        row["tuned_max_rel_diff_vs_scaled_mm"] = float(f"{err:.3g}")
                us = bench_us(runs[rname])
                row[rname] = dict(time_us=round(us, 1), tflops=round(flops / us / 1e6, 1))
                totals[rname] += us
            today = row["scaled_mm" if "scaled_mm" in row else "heuristic"]
            totals["today"] += today["time_us"]
            print(f"  {name} {pname:11s} [{m}x{k}]x[{n}x{k}]^T: " + ", ".join(
                f"{r} {row[r]['time_us']:.0f} us ({row[r]['tflops']:.0f} TF/s)" for r in ("scaled_mm", "heuristic",
                                                                                            "tuned") if r in row),
                flush=True)
            res[pname] = row
        res["layer_total_us"] = {k: round(v, 1) for k, v in totals.items()}
        print(f"  {name} per layer: today {totals['today']:.0f} us, heuristic {totals['heuristic']:.0f} us, "
              f"tuned {totals['tuned']:.0f} us", flush=True)
        out[name] = res
    out["tuning_report"] = [dict(m=r[0], n=r[1], k=r[2], a=r[3], b=r[4], out=r[5], accumulate=r[6], chosen=r[7],
                                 ms=[round(x, 4) for x in r[8]]) for r in ext.tuning_report()]
    for r in out["tuning_report"]:
        print(f"  tuned [{r['m']}x{r['k']}]x[{r['n']}x{r['k']}]^T {r['a']}/{r['b']}->{r['out']}: chose {r['chosen']} "
              f"of {len(r['ms'])}: " + " ".join(f"{x * 1e3:.0f}" for x in r["ms"]) + " us", flush=True)
    return out


def part_host(args):
    """Host time per call (us) of the calls a coat step makes hundreds of times, on problems too small for the GPU
    to be the limit: is a GEMM's host cost cuBLASLt's, the dispatcher's or ours? n calls queued without a sync."""
    from megacoat.kernels.fp8_gemm import cuda_extension, lt_gemm_ops
    ext = cuda_extension() if DEV == "cuda" else None
    ops = lt_gemm_ops() if ext is not None else None
    n, d = (20, 64) if SMOKE else (2000, 256)
    x = torch.randn(d, d, device=DEV, dtype=torch.bfloat16)
    a, _, sa = fp8.quantize_tensorwise(torch.randn(d, d, device=DEV, dtype=torch.bfloat16), "e4m3")
    b, _, sb = fp8.quantize_tensorwise(torch.randn(d, d, device=DEV, dtype=torch.bfloat16), "e4m3")
    mg = torch.zeros(d, d, device=DEV)
    flag = torch.zeros(1, dtype=torch.bool)
    calls = {"torch.empty": lambda: torch.empty(d, device=DEV),
             "torch.zeros(()) (allocation and fill)": lambda: torch.zeros((), device=DEV),
             "bf16 torch.mm": lambda: torch.mm(x, x),
             "fp8 torch._scaled_mm": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
             "fp8 1x16 quantize (Triton, eager)": lambda: fp8.quantize_1x16(x, "e4m3")}
    if ops is not None:
        calls["fp8 megacoat_lt::fp8_mm"] = lambda: ops.fp8_mm(a, sa, b, sb, torch.bfloat16, True, 1)
        calls["fp8 megacoat_lt::fp8_wgrad (accumulate)"] = lambda: ops.fp8_wgrad(mg, a, sa, b, sb, flag, 1,
                                                                                  torch.bfloat16)
        calls["fp8 extension fp8_gemm (pybind, out given)"] = lambda: ext.fp8_gemm(mg, a, sa, b, sb, True, False, 1)
    out = {}
    for name, fn in calls.items():
        us = 1000.0 * _host_ms(fn, n)
        out[name] = round(us, 2)
        print(f"  {name:45s} {us:7.2f} us of host per call", flush=True)
    return out


def _host_ms(fn, n=20) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    _sync()
    return 1000.0 * (t1 - t0) / n


def _profile_table(fn) -> str:
    """The kernels (and CPU ops) of one call, by device time: the launch count and any stray copies."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            _sync()
        avg = prof.key_averages()
        for key in ("device_time_total", "cuda_time_total"):
            try:
                table = avg.table(sort_by=key, row_limit=30)
                break
            except Exception:  # noqa: BLE001 - the sort key's name changed across torch versions
                table = None
        table = table or avg.table(row_limit=30)
        print(table, flush=True)
        return table
    except Exception as e:  # noqa: BLE001
        return f"profile failed: {type(e).__name__}: {e}"


def part_layer(args, deadline):
    hidden, ffn, heads, seq, mbs = (2048, 5632, 16, 2048, 4) if not SMOKE else (128, 352, 4, 64, 2)
    out = {"shape": dict(hidden=hidden, ffn=ffn, heads=heads, seq=seq, micro_batch=mbs)}
    modes = [False, True] if args.compile else [False]
    for compiled in modes:
        for name, recipe in RECIPES.items():
            key = f"{name}{'_compiled' if compiled else '_eager'}"
            if time.time() > deadline:
                out[key] = dict(skipped="time budget")
                continue
            try:
                layer, m = _llama_layer(recipe, hidden, ffn, heads, seq, compile_layer=compiled)
                rope = _rope(m, seq, torch.device(DEV))
                x = torch.randn(seq, mbs, hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                gy = torch.randn_like(x)

                def step():
                    refresh_fp8_weights(layer)
                    layer(x, rope).backward(gy)

                step()
                _sync()
                # activation memory held between forward and backward (the allocator's view: works for
                # compiled layers too, where saved-tensor hooks do not see inside the graph)
                refresh_fp8_weights(layer)
                before = _mem()
                y = layer(x, rope)
                _sync()
                held = _mem() - before - y.numel() * y.element_size()
                y.backward(gy)
                del y
                if DEV == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                base = _mem()
                us = bench_us(step, graph=False)
                peak = (torch.cuda.max_memory_allocated() if DEV == "cuda" else 0) - base
                unit = seq * mbs * hidden * 2
                out[key] = dict(time_ms=round(us / 1000, 3), peak_extra_gib=round(peak / 2**30, 3),
                                activations_held_U=round(held / unit, 2))
                print(f"  {key:22s} {us / 1000:8.3f} ms  peak +{peak / 2**30:.2f} GiB  activations held "
                      f"{held / unit:.2f} U", flush=True)
                del layer, x
                if DEV == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                out[key] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
                print(f"  {key}: FAILED {e}", flush=True)
    for mode in ("eager", "compiled"):
        b = out.get(f"bf16_{mode}", {})
        for name in ("tensorwise", "coat"):
            r = out.get(f"{name}_{mode}", {})
            if b.get("time_ms") and r.get("time_ms"):
                r["speedup_vs_bf16"] = round(b["time_ms"] / r["time_ms"], 3)
            if b.get("activations_held_U") and r.get("activations_held_U") is not None:
                r["activations_vs_bf16"] = round(r["activations_held_U"] / b["activations_held_U"], 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="kernels,saved,linear,layer")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--budget-s", type=float, default=160.0, help="skip remaining layer runs after this")
    ap.add_argument("--sweep-budget-s", type=float, default=300.0, help="stop the 1x16 tile sweep after this")
    ap.add_argument("--gemm-candidates", type=int, default=16, help="--parts gemms: algorithms timed per problem")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, measures nothing)")
    args = ap.parse_args()
    global DEV, SMOKE
    if args.smoke:
        DEV, SMOKE = "cpu", True
        args.compile = False
    start = time.time()
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), torch=torch.__version__,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none", parts={})
    try:
        result["commit"] = source_commit()
        import triton
        result["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    for part in args.parts.split(","):
        print(f"== {part}", flush=True)
        t0 = time.time()
        try:
            if part == "kernels":
                r = part_kernels(args)
            elif part == "tiles":
                r = part_tiles(args)
            elif part == "saved":
                r = part_saved(args)
            elif part == "linear":
                r = part_linear(args)
            elif part == "wgrad":
                r = part_wgrad(args)
            elif part == "gemms":
                r = part_gemms(args)
            elif part == "host":
                r = part_host(args)
            elif part == "swiglubwd":
                r = part_swiglubwd(args)
            elif part == "reductions":
                r = part_reductions(args)
            elif part == "layer":
                r = part_layer(args, start + args.budget_s)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as e:  # noqa: BLE001 - record and go on with the other parts
            r = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
            print(f"  FAILED: {e}", flush=True)
        r["seconds"] = round(time.time() - t0, 1)
        result["parts"][part] = r
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # after every part: a later crash keeps what was measured
            json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
