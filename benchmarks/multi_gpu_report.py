"""Summarise the per-run JSON logs of scripts/gpu_multi.sh as one markdown table.

Each run's `--log-json` file holds one record per log interval (and validation records). Step time
is the mean over every interval after the first (the first holds compilation and warm-up).
Exposed communication: a run's step time minus the step time of `b_ref_1gpu`, one GPU doing the
same per-GPU work (the same micro-batches, no data-parallel communication).

Usage: python benchmarks/multi_gpu_report.py DIR [--reference b_ref_1gpu]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Dict, List, Optional


def summarise(records: List[dict]) -> Optional[dict]:
    steps = [r for r in records if "time_per_iter_s" in r]
    if not steps:
        return None
    steady = steps[1:] or steps
    valid = [r for r in records if "valid_loss" in r]
    return {
        "iterations": steps[-1]["iteration"],
        "step_ms": 1e3 * sum(r["time_per_iter_s"] for r in steady) / len(steady),
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "peak_gib": max((r.get("peak_mem_gib") or 0.0) for r in steps),
        "loss": steps[-1]["lm_loss"],
        "valid_loss": valid[-1]["valid_loss"] if valid else None,
        "comm_mib": {k: v / 2**20 for k, v in (steps[-1].get("comm_bytes_per_iter") or {}).items() if v},
    }


def load_runs(directory: str) -> Dict[str, dict]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path) as f:
            s = summarise([json.loads(line) for line in f if line.strip()])
        if s is not None:
            runs[os.path.basename(path)[: -len(".jsonl")]] = s
    return runs


def table(runs: Dict[str, dict], reference: str) -> str:
    ref = runs.get(reference, {}).get("step_ms")
    lines = ["| run | iters | ms/step | exposed comm ms | tokens/s | peak GiB | lm loss (last) | valid loss | MiB sent per step and rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in runs.items():
        same_work = name.startswith(("b_", "t_")) and name != reference  # 2 micro-batches of 4 per GPU
        exposed = f"{s['step_ms'] - ref:.0f}" if ref is not None and same_work else ""
        comm = ", ".join(f"{k} {v:.1f}" for k, v in s["comm_mib"].items())
        vl = f"{s['valid_loss']:.4f}" if s["valid_loss"] is not None else ""
        lines.append(f"| {name} | {s['iterations']} | {s['step_ms']:.1f} | {exposed} | {s['tokens_per_s']:.0f} | "
                     f"{s['peak_gib']:.2f} | {s['loss']:.4f} | {vl} | {comm} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="Folder of <run>.jsonl files written by --log-json.")
    p.add_argument("--reference", default="b_ref_1gpu", help="Run whose step time is the compute-only reference.")
    a = p.parse_args(argv)
    if not os.path.isdir(a.directory):
        raise SystemExit(f"{a.directory} is not a folder: pass the runs/ folder that scripts/gpu_multi.sh writes.")
    print(table(load_runs(a.directory), a.reference))


if __name__ == "__main__":
    main()
