#!/usr/bin/env python
"""The one-GPU grid that checks the step-time model: 1.36B and 7B, bf16 / tensorwise / coat / coat + FP8 states,
micro-batch 1 up to the largest that fits (powers of two and the largest), with and without full recomputation;
each run's measured step time against the prediction, and the planner's fastest pick against the fastest
measured.

    python benchmarks/planner_grid.py --list                    # the parts, their runs and estimated minutes
    python benchmarks/planner_grid.py --part 1p36b-bf16-0       # one part (at most ~9 minutes on one H200)
    python benchmarks/planner_grid.py --all                     # every part not yet written, one after another
    python benchmarks/planner_grid.py --compare                 # the page: predicted vs measured, errors, picks

Parts write `<out>/parts/<part>.json` with their date, commit and exact commands (default out: the newest
benchmarks/results/<date>_planner-grid_h200 that still lacks parts, else a new one dated today) and are skipped
when present, so the grid can be measured over several days. `--compare` predicts every measured run again
with the model as it is, so that all rows come from one model. The largest micro-batch of each recipe is the
largest the memory planner says fits on the GPU (`tools/plan.py`'s rule); a run that runs out of memory anyway is
recorded as such. Each run: compiled
layers, mock data, sequence 2048, `--train-iters` ITERS, the mean of the logged intervals after the warm-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import source_commit  # noqa: E402
from result_json import write_json  # noqa: E402

from megacoat.config import parse_args  # noqa: E402
from megacoat.training.hardware import load_hardware  # noqa: E402
from megacoat.training.layout_search import _fit  # noqa: E402
from megacoat.training.planner import plan_stages, replan_activations  # noqa: E402
from megacoat.training.step_time import predict  # noqa: E402

MODELS = {
    "1p36b": "--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16",
    "7b": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32",
}
SPEED = ("--seq-length 2048 --max-position-embeddings 2048 --mock-data --vocab-size 32000 --attention-dropout 0 "
         "--hidden-dropout 0 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 5 --eval-interval 0 --eval-iters 0 "
         "--untie-embeddings-and-output-weights --bf16")
RECIPES = {
    "bf16": "",
    "tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
    "coat": "--fp8-format hybrid --fp8-recipe coat",
    "coat-fp8states": "--fp8-format hybrid --fp8-recipe coat --use-precision-aware-optimizer --exp-avg-dtype fp8 "
                      "--exp-avg-sq-dtype fp8",
}
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
ITERS, LOG_INTERVAL, WARMUP = 12, 2, 6       # mean of the intervals logged after iteration 6
COMPILE_S = {"1p36b": 45, "7b": 70}           # compilation and start-up per run, warm inductor cache (estimate)
PART_BUDGET_S = 540
MAX_MICRO_BATCH = 64


def flags(model: str, recipe: str, mbs: int, recompute: bool) -> List[str]:
    return shlex.split(f"{MODELS[model]} {SPEED} {RECIPES[recipe]} {RECOMPUTE if recompute else ''} "
                       f"--micro-batch-size {mbs} --global-batch-size {mbs}")


def largest_fit(model: str, recipe: str, recompute: bool, hw) -> int:
    """The largest micro-batch the memory planner fits on the GPU (searched over 1 .. MAX_MICRO_BATCH)."""
    base = parse_args(flags(model, recipe, 1, recompute))
    plans = plan_stages(base, 1, 32000, torch.device("cuda"))
    best = 0
    for mbs in range(1, MAX_MICRO_BATCH + 1):
        cfg = parse_args(flags(model, recipe, mbs, recompute))
        if not _fit(replan_activations(plans, cfg, 1, 32000, torch.device("cuda")), cfg, hw)[0]:
            break
        best = mbs
    return best


def grid(hw, only: Optional[str] = None) -> Dict[str, List[dict]]:
    """Part name -> runs, each with its flags and predicted step time; parts fit PART_BUDGET_S. `only`: a part's
    name; just its model and recipe are planned (planning the whole grid takes minutes of CPU)."""
    parts: Dict[str, List[dict]] = {}
    for model in MODELS:
        for recipe in RECIPES:
            if only is not None and not only.startswith(f"{model}-{recipe}-"):
                continue
            runs = []
            for rc in (False, True):
                top = largest_fit(model, recipe, rc, hw)
                sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= top} | ({top} if top else set()))
                for mbs in sizes:
                    argv = flags(model, recipe, mbs, rc)
                    cfg = parse_args(argv)
                    st = predict(cfg, 1, plan_stages(cfg, 1, 32000, torch.device("cuda")), hw, 32000)
                    runs.append(dict(name=f"{model}-{recipe}-mbs{mbs}{'-recompute' if rc else ''}", model=model,
                                     recipe=recipe, micro_batch=mbs, recompute=rc, flags=argv,
                                     predicted_ms=st.seconds * 1e3,
                                     predicted_tokens_per_s=st.tokens_per_s_per_gpu,
                                     est_s=COMPILE_S[model] + ITERS * st.seconds * 1.1))
            chunk, n = [], 0
            for r in runs:
                if chunk and sum(x["est_s"] for x in chunk) + r["est_s"] > PART_BUDGET_S:
                    parts[f"{model}-{recipe}-{n}"] = chunk
                    chunk, n = [], n + 1
                chunk.append(r)
            parts[f"{model}-{recipe}-{n}"] = chunk
    return parts


def run_one(run: dict, log_dir: str) -> dict:
    log = os.path.join(log_dir, run["name"] + ".jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + run["flags"] + [
        "--train-iters", str(ITERS), "--log-interval", str(LOG_INTERVAL), "--log-json", log]
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(tempfile.gettempdir(), "inductor_cache"))
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=PART_BUDGET_S)
    out = dict(run, command="python pretrain_gpt.py " + shlex.join(cmd[2:]), wall_s=round(time.time() - t0, 1))
    recs = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
    warm = [r for r in recs if r.get("iteration", 0) > WARMUP and "time_per_iter_s" in r]
    if p.returncode != 0 or not warm:
        tail = (p.stderr or p.stdout)[-600:]
        out["error"] = "out of memory" if "out of GPU memory" in tail or "OutOfMemory" in tail else tail
        return out
    out["measured_ms"] = 1e3 * sum(r["time_per_iter_s"] for r in warm) / len(warm)
    out["measured_tokens_per_s"] = sum(r["tokens_per_s"] for r in warm) / len(warm)
    out["peak_gib"] = recs[-1].get("peak_mem_gib")
    out["error_vs_prediction"] = out["predicted_ms"] / out["measured_ms"] - 1
    return out


def default_out(results: str, parts: Optional[Dict[str, List[dict]]]) -> str:
    """The newest planner-grid folder that still lacks one of `parts` (a grid takes about two hours of one GPU,
    often spread over days; None: any newest folder, where one part skips itself if written), else a new one dated
    today."""
    found = sorted(d for d in (os.listdir(results) if os.path.isdir(results) else [])
                   if d.endswith("_planner-grid_h200") and os.path.isdir(os.path.join(results, d)))
    if found:
        newest = os.path.join(results, found[-1])
        written = os.listdir(os.path.join(newest, "parts")) if os.path.isdir(os.path.join(newest, "parts")) else []
        if parts is None or {f"{name}.json" for name in parts} - set(written):
            return newest
    return os.path.join(results, f"{datetime.date.today().isoformat()}_planner-grid_h200")


def measured_runs(out_dir: str) -> Dict[str, dict]:
    """Run name -> its record, over the parts written in `out_dir` (a run measured twice: the newer part's)."""
    runs: Dict[str, dict] = {}
    parts_dir = os.path.join(out_dir, "parts")
    for f in sorted(os.listdir(parts_dir)) if os.path.isdir(parts_dir) else []:
        if not f.endswith(".json"):
            continue
        try:
            with open(os.path.join(parts_dir, f)) as fh:
                part = json.load(fh)
        except ValueError as e:
            raise SystemExit(f"benchmarks/planner_grid.py: error: {os.path.join(parts_dir, f)} is not valid JSON "
                             f"({e}): delete it and run its part again")
        for r in part["runs"]:
            if r["name"] not in runs or part.get("date", "") >= runs[r["name"]].get("part_date", ""):
                runs[r["name"]] = dict(r, part=f[:-5], part_date=part.get("date", ""), commit=part.get("commit"))
    return runs


def compare(out_dir: str, hw, grid_runs: List[dict]) -> str:
    """The page: every measured run against the step-time model as it is now (predicted again here, so that every
    row comes from one model), the error statistics and the planner's pick per model; the grid's runs not measured
    yet are listed."""
    by_name = measured_runs(out_dir)
    if not by_name:
        raise SystemExit(f"benchmarks/planner_grid.py: error: no part written under {out_dir}: run "
                         "`python benchmarks/planner_grid.py --all` on one H200 first (or pass --out)")
    runs = []
    for r in by_name.values():
        cfg = parse_args(r["flags"])
        st = predict(cfg, 1, plan_stages(cfg, 1, 32000, torch.device("cuda")), hw, 32000)
        r = dict(r, predicted_ms=st.seconds * 1e3, predicted_tokens_per_s=st.tokens_per_s_per_gpu)
        if "measured_ms" in r:
            r["error_vs_prediction"] = r["predicted_ms"] / r["measured_ms"] - 1
        runs.append(r)
    ok = [r for r in runs if "measured_ms" in r]
    commits = sorted({(r.get("commit") or "?")[:7] for r in runs})
    missing = [r["name"] for r in grid_runs if r["name"] not in by_name]
    lines = ["# The one-GPU grid: predicted vs measured step time (H200)", "",
             f"`python benchmarks/planner_grid.py --compare` over {len(runs)} runs ({len(ok)} measured) of "
             f"{len(grid_runs)} in the grid, measured at commit {', '.join(commits)}; predictions by the model at "
             f"commit {source_commit()[:7] or '?'}.", ""]
    if ok:
        errs = [abs(r["error_vs_prediction"]) for r in ok]
        lines.append(f"- {sum(e <= 0.10 for e in errs)} of {len(ok)} within +-10%, mean absolute error "
                     f"{sum(errs) / len(errs):.1%} (targets: each within +-10%, mean <= 5%).")
        for model in MODELS:
            mine = [r for r in ok if r["model"] == model]
            if mine:
                pick = max(mine, key=lambda r: r["predicted_tokens_per_s"])
                best = max(mine, key=lambda r: r["measured_tokens_per_s"])
                lines.append(f"- {model}: the planner's pick {pick['name']} ran {pick['measured_tokens_per_s']:,.0f} "
                             f"tokens/s, the fastest measured {best['name']} {best['measured_tokens_per_s']:,.0f} "
                             f"({pick['measured_tokens_per_s'] / best['measured_tokens_per_s'] - 1:+.1%}; target "
                             "within 3%).")
    if missing:
        lines.append(f"- Not measured yet ({len(missing)}): {', '.join(missing)}.")
    lines += ["", "| run | measured ms | predicted ms | error | measured tokens/s | peak GiB |",
              "|---|---|---|---|---|---|"]
    for r in runs:
        if "measured_ms" in r:
            lines.append(f"| {r['name']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                         f"{r['error_vs_prediction']:+.1%} | {r['measured_tokens_per_s']:,.0f} | {r['peak_gib']:.2f} |")
        else:
            lines.append(f"| {r['name']} | {r.get('error', 'not run')[:60]} | {r['predicted_ms']:.1f} | | | |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the grid's folder (default: the newest benchmarks/results/<date>_planner-grid_h200 "
                                  "that still lacks parts, else a new one dated today)")
    ap.add_argument("--hardware", default="h200")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true")
    mode.add_argument("--part")
    mode.add_argument("--all", action="store_true")
    mode.add_argument("--compare", action="store_true")
    args = ap.parse_args(argv)
    hw = load_hardware(args.hardware)
    parts = grid(hw, only=args.part)
    results = os.path.join(ROOT, "benchmarks", "results")
    if args.compare:
        out = args.out or max((os.path.join(results, d) for d in os.listdir(results)
                               if d.endswith("_planner-grid_h200")), default=default_out(results, parts))
        text = compare(out, hw, [r for runs in parts.values() for r in runs])
        with open(os.path.join(out, "README.md"), "w") as f:
            f.write(text)
        print(text)
        return 0
    args.out = args.out or default_out(results, None if args.part else parts)
    if args.list:
        total = 0.0
        for name, runs in parts.items():
            est = sum(r["est_s"] for r in runs)
            total += est
            print(f"{name}: {len(runs)} runs, ~{est / 60:.1f} min: " + ", ".join(
                f"mbs {r['micro_batch']}{' rc' if r['recompute'] else ''}" for r in runs))
        print(f"{sum(len(r) for r in parts.values())} runs in {len(parts)} parts, ~{total / 60:.0f} min of one H200")
        return 0
    names = [args.part] if args.part else list(parts)
    if args.part and args.part not in parts:
        print(f"benchmarks/planner_grid.py: error: no part {args.part}; --list shows them.", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    for name in names:
        path = os.path.join(args.out, "parts", f"{name}.json")
        if os.path.exists(path):
            print(f"{name}: written already, skipped")
            continue
        done = [run_one(r, tempfile.gettempdir()) for r in parts[name]]
        write_json(path, {"part": name, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                          "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": source_commit(),
                          "torch": torch.__version__, "runs": done})
        print(f"{name}: " + ", ".join(f"{r['name']} {r.get('error_vs_prediction', float('nan')):+.1%}" for r in done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
