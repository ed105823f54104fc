#!/usr/bin/env python
"""Loss and throughput curves of several runs in one PNG, aligned by consumed tokens, plus a table.

    python tools/plot_runs.py bf16=runs/bf16/log.jsonl coat=runs/coat/log.jsonl --out compare.png
    python tools/plot_runs.py runs/*/log.jsonl --out compare.png --smooth 20

Each input is a `--log-json` file of pretrain_gpt.py (optionally NAME=PATH; default name: the
file's directory). Training loss is drawn solid, validation loss as markers on the same axes;
throughput (tokens/s) below. Logs written before `consumed_tokens` was recorded need
`--seq-length` (tokens = consumed samples x sequence length). The table (printed, and drawn
under the curves) gives per run: last iteration, tokens, final training loss (mean of the last
--final-window logged values), last validation loss, median tokens/s and TFLOP/s/GPU, peak memory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megacoat.config import int_at_least  # noqa: E402


@dataclass
class Run:
    name: str
    tokens: List[int] = field(default_factory=list)           # per logged training record
    loss: List[float] = field(default_factory=list)
    tokens_per_s: List[float] = field(default_factory=list)
    tflops: List[float] = field(default_factory=list)
    peak_mem: List[float] = field(default_factory=list)
    iterations: List[int] = field(default_factory=list)
    valid: List[Tuple[int, float]] = field(default_factory=list)  # (tokens, validation loss)


def _number(rec: dict, key: str, where: str, required: bool = True) -> float:
    """rec[key] as a number; an optional one missing or null is NaN; anything else stops with file and line."""
    value = rec.get(key)
    if value is None and not required:
        return float("nan")
    if value is None:
        raise SystemExit(f"plot_runs.py: {where} has no {key!r}: a --log-json training record holds iteration, "
                         "lm_loss, tokens_per_s and consumed_tokens")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SystemExit(f"plot_runs.py: {where}: {key} is {value!r}, not a number")
    return value


def _iteration(rec: dict, where: str) -> int:
    it = _number(rec, "iteration", where)
    if not math.isfinite(it) or it != int(it) or it < 0:
        raise SystemExit(f"plot_runs.py: {where}: iteration {it!r} is not a non-negative integer")
    return int(it)


def read_run(name: str, path: str, seq_length: Optional[int] = None) -> Run:
    if not os.path.isfile(path):
        raise SystemExit(f"plot_runs.py: {path} " + ("is a directory" if os.path.isdir(path) else "does not exist")
                         + ": pass the --log-json files of the runs")
    train: List[Tuple[int, int, float, float, float, float]] = []  # iteration, tokens, loss, tokens/s, TFLOP/s, GiB
    valid_iters: List[Tuple[int, float]] = []
    restarted: Optional[Tuple[int, int]] = None  # (line, iteration) of the first record logged again
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"plot_runs.py: {where} is not a JSON line ({e}); pass --log-json files") from e
            if not isinstance(rec, dict):
                raise SystemExit(f"plot_runs.py: {where} is not a JSON object; pass --log-json files")
            if "valid_loss" in rec:
                valid_iters.append((_iteration(rec, where), _number(rec, "valid_loss", where, required=False)))
            if "lm_loss" not in rec:
                continue
            it = _iteration(rec, where)
            if train and it <= train[-1][0]:
                # Logged again from an earlier iteration: a run restarted into the same file (a resume that did
                # not trim the log, or a fresh run). The later records replace the earlier ones from there on.
                restarted = restarted or (n, it)
                train = [r for r in train if r[0] < it]
                valid_iters = [v for v in valid_iters if v[0] < it]
            if "consumed_tokens" in rec:
                tokens = _number(rec, "consumed_tokens", where)
            elif seq_length:
                tokens = _number(rec, "consumed_samples", where) * seq_length
            else:
                raise SystemExit(f"plot_runs.py: {path} has no consumed_tokens (an older log): pass --seq-length")
            train.append((it, tokens, _number(rec, "lm_loss", where, required=False),
                          _number(rec, "tokens_per_s", where), _number(rec, "tflops_per_gpu", where, required=False),
                          _number(rec, "peak_mem_gib", where, required=False)))
    if not train:
        raise SystemExit(f"plot_runs.py: {path} holds no training records (lm_loss)")
    if restarted:
        print(f"plot_runs.py: note: {path}:{restarted[0]} logs iteration {restarted[1]} again (a run restarted into "
              "the same file): its records replace the earlier ones from that iteration on", file=sys.stderr)
    run = Run(name)
    for it, tokens, loss, tps, tflops, mem in train:
        run.iterations.append(it)
        run.tokens.append(tokens)
        run.loss.append(loss)
        run.tokens_per_s.append(tps)
        run.tflops.append(tflops)
        run.peak_mem.append(mem)
    # Validation records carry the iteration only: place them at that iteration's tokens.
    tokens_at = dict(zip(run.iterations, run.tokens))
    per_iter = (run.tokens[-1] / run.iterations[-1]) if run.iterations[-1] else 0
    run.valid = [(tokens_at.get(it, int(it * per_iter)), loss) for it, loss in valid_iters]
    return run


def smooth(values: List[float], window: int) -> List[float]:
    """Trailing moving average over finite values (window 1: unchanged)."""
    out, buf = [], []
    for v in values:
        if math.isfinite(v):
            buf.append(v)
            buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def _finite(values: List[float]) -> List[float]:
    return [v for v in values if math.isfinite(v)]


def summary(run: Run, final_window: int) -> Dict[str, object]:
    """The table's row of one run; NaN (a record without the figure) is left out of medians and maxima."""
    finite = _finite(run.loss)
    nan = float("nan")
    return {
        "run": run.name,
        "iterations": run.iterations[-1],
        "tokens": run.tokens[-1],
        "final train loss": sum(finite[-final_window:]) / len(finite[-final_window:]) if finite else nan,
        "last valid loss": run.valid[-1][1] if run.valid else nan,
        "median tokens/s": statistics.median(_finite(run.tokens_per_s) or [nan]),
        "median TFLOP/s/GPU": statistics.median(_finite(run.tflops) or [nan]),
        "peak mem GiB": max(_finite(run.peak_mem) or [nan]),
    }


def format_table(rows: List[Dict[str, object]]) -> str:
    heads = list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 100 else f"{v:,.1f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(cell(r[h]) for h in heads) + " |" for r in rows]
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("plot_runs.py needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def output_path(out: str) -> str:
    """The file --out names, checked before the logs are read: without a suffix it is a PNG (matplotlib would add
    .png to the name); a directory, a path under a file or a format matplotlib cannot write is refused; a missing
    directory is made."""
    if not os.path.basename(out) or os.path.isdir(out):
        raise SystemExit(f"plot_runs.py: --out {out} is a directory: name the file, e.g. "
                         f"{os.path.join(out, 'compare.png')}")
    suffix = os.path.splitext(out)[1][1:].lower()
    if not suffix:
        out, suffix = out + ".png", "png"
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise SystemExit(f"plot_runs.py: --out {out}: matplotlib cannot write .{suffix} files; use .png (or one of "
                         f"{', '.join(sorted(formats))})")
    directory = existing = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise SystemExit(f"plot_runs.py: --out {out}: {existing} is a file, not a directory")
    os.makedirs(directory, exist_ok=True)
    return out


def plot(runs: List[Run], out: str, smooth_window: int, rows: List[Dict[str, object]]) -> None:
    """Draw into `out` (see output_path), written whole or not at all."""
    plt = _pyplot()

    fig = plt.figure(figsize=(11, 9.5))
    grid = fig.add_gridspec(3, 1, height_ratios=[3, 2, 1.1])
    ax_loss, ax_tput, ax_tab = (fig.add_subplot(grid[i]) for i in range(3))
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax_loss.plot(run.tokens, smooth(run.loss, smooth_window), color=color, label=f"{run.name} train")
        if run.valid:
            ax_loss.plot([t for t, _ in run.valid], [v for _, v in run.valid], "o--", color=color, markersize=4,
                         label=f"{run.name} valid")
        ax_tput.plot(run.tokens, run.tokens_per_s, color=color, label=run.name)
    ax_loss.set_ylabel("lm loss" + (f" (moving average of {smooth_window})" if smooth_window > 1 else ""))
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_xlabel("consumed tokens")
    ax_tput.grid(alpha=0.3)
    ax_tab.axis("off")
    heads = list(rows[0])
    cells = [[format_table([r]).splitlines()[2].strip("| ").split(" | ")[j] for j in range(len(heads))] for r in rows]
    table = ax_tab.table(cellText=cells, colLabels=heads, loc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    fig.tight_layout()
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        fig.savefig(tmp, dpi=110, format=os.path.splitext(out)[1][1:].lower())
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def run_names(specs: List[str]) -> List[Tuple[str, str]]:
    """(name, path) per NAME=PATH or PATH. A path's name is its directory's; where two of those are the same
    (runs/a/log.jsonl and runs/a/old.jsonl) the paths name them, so that the legend and table tell them apart."""
    runs = []
    for spec in specs:
        if "=" in spec and not os.path.exists(spec):
            name, path = spec.split("=", 1)
            runs.append((name, path, True))
        else:
            runs.append((os.path.basename(os.path.dirname(os.path.abspath(spec))) or spec, spec, False))
    taken = Counter(name for name, _, _ in runs)
    runs = [(path if taken[name] > 1 and not given else name, path, given) for name, path, given in runs]
    twice = [name for name, n in Counter(name for name, _, _ in runs).items() if n > 1]
    if twice:
        raise SystemExit(f"plot_runs.py: two runs are named {twice[0]!r}: give each its own NAME=PATH")
    return [(name, path) for name, path, _ in runs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="--log-json files, optionally NAME=PATH")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--smooth", type=int_at_least(1), default=1, help="moving-average window for the training loss")
    ap.add_argument("--final-window", type=int_at_least(1), default=10,
                    help="logged values averaged for the final train loss")
    ap.add_argument("--seq-length", type=int_at_least(1), default=None, help="for logs without consumed_tokens")
    args = ap.parse_args(argv)
    out = output_path(args.out)
    runs = [read_run(name, path, args.seq_length) for name, path in run_names(args.logs)]
    rows = [summary(r, args.final_window) for r in runs]
    plot(runs, out, args.smooth, rows)
    print(format_table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
