#!/usr/bin/env python
"""Choose a layout before launching: every TP / PP / virtual-stage / DP / micro-batch / recomputation / FP8 recipe /
optimizer-state / gradient-dtype / SDP4Bit configuration that fits in memory, ranked by predicted tokens/s per GPU.

    python tools/plan.py --world-size 64 --ranks-per-node 8 --hardware h200 --inter-node-gbps 400 \\
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --seq-length 4096 \\
        --global-batch-size 1024 --bf16 --mock-data --vocab-size 32000 [--top 5]
    python tools/plan.py --scaling-table [--out docs/planner.md --plot docs/planner_scaling.png]

The other flags are pretrain_gpt.py's. A layout or method flag given here stays fixed (e.g.
`--tensor-model-parallel-size 8`, `--fp8-recipe coat`, `--exp-avg-dtype fp32`); `--recipes`, `--states` and
`--comm` narrow the methods searched. Each printed line is the exact pretrain_gpt.py command (launch it with one
process per GPU; `--dry-run --world-size N` plans it again). The model behind the numbers, its parts and its
accuracy: docs/planner.md (training/step_time.py, training/layout_search.py).

--scaling-table writes the Llama-2-7B / 70B scaling study of docs/planner.md between its markers (and the plot).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megacoat.checkpoint.format import write_file_atomic  # noqa: E402
from megacoat.config import ConfigError, int_at_least, parse_args  # noqa: E402
from megacoat.training.hardware import GBPS_PER_GBYTE, load_hardware  # noqa: E402
from megacoat.training.layout_search import (COMMS, RECIPES, STATES, command_line, distinct,  # noqa: E402
                                             no_fit_message, preferred, search)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- scaling-table -->", "<!-- /scaling-table -->"

# The scaling study: Llama-2 shapes, 4M-token global batches (1,024 sequences of 4,096), 8 GPUs per node.
LLAMA = {
    "Llama-2-7B": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32",
    "Llama-2-70B": "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
                   "--group-query-attention --num-query-groups 8",
}
COMMON = ("--seq-length 4096 --max-position-embeddings 4096 --global-batch-size 1024 --vocab-size 32000 --mock-data "
          "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --bf16 --ranks-per-node 8")
GPUS = (8, 64, 512, 4096)
LINKS_GBPS = (25, 100, 400)
# bf16 = bf16 compute with fp32 Adam states; COAT = FP8 compute and activations (coat) with FP8 Adam states.
METHODS = {"bf16": (["bf16"], ["fp32"]), "COAT": (["coat"], ["fp8"])}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    ap.add_argument("--top", type=int_at_least(1), default=5, help="how many configurations to print (default 5)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"recipes searched (default {','.join(RECIPES)})")
    ap.add_argument("--states", default=",".join(STATES), help=f"optimizer-state formats (default {','.join(STATES)})")
    ap.add_argument("--comm", default=",".join(COMMS), help=f"data-parallel options (default {','.join(COMMS)})")
    ap.add_argument("--max-micro-batch", type=int_at_least(1), default=16, help="largest micro-batch tried (default 16)")
    ap.add_argument("--no-recompute", action="store_true", help="do not try full recomputation")
    ap.add_argument("--scaling-table", action="store_true", help="write docs/planner.md's scaling study")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "planner.md"), help="--scaling-table: the page")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "planner_scaling.png"),
                    help="--scaling-table: the PNG (needs matplotlib; skipped without it)")
    return ap


def _choices(text: str, allowed: Sequence[str], flag: str) -> List[str]:
    vals = [v for v in text.split(",") if v]
    bad = [v for v in vals if v not in allowed]
    if bad or not vals:
        raise ConfigError(f"{flag} {text}: choose from {', '.join(allowed)} (comma-separated).")
    return vals


def plan(argv: Sequence[str], out=sys.stdout) -> int:
    args, rest = _parser().parse_known_args(argv)
    cfg = parse_args(rest)  # pretrain_gpt.py's own parser: unknown flags fail with its suggestions
    world = cfg.parallel.world_size
    if world is None:
        raise ConfigError("tools/plan.py needs --world-size N (the GPUs to plan for) and --ranks-per-node R.")
    hw = load_hardware(cfg.train.hardware, cfg.train.inter_node_gbps)
    vocab = _vocab_size(cfg)
    res = search(rest, world, hw, vocab, _choices(args.recipes, RECIPES, "--recipes"),
                 _choices(args.states, STATES, "--states"), _choices(args.comm, COMMS, "--comm"),
                 args.max_micro_batch, not args.no_recompute)
    if not res.candidates:
        raise ConfigError(no_fit_message(res, world, hw))
    inter = hw.links["inter_node"].bus_GBps * GBPS_PER_GBYTE
    rpn = cfg.parallel.ranks_per_node or world
    print(f"{len(res.candidates)} configurations fit on {world} GPUs of {hw.name} ({rpn} per node, inter-node "
          f"{inter:.0f} Gb/s per GPU), of {res.configurations} tried over {res.layouts_tried} layouts in "
          f"{res.seconds:.1f} s (memory planner {res.plan_seconds:.1f} s); fastest first "
          "(predicted, docs/planner.md; layouts that differ only in their state, gradient or communication formats "
          "are shown once, with the exact formats wherever the lossy ones buy less than 0.5%):", file=out)
    for i, c in enumerate(distinct(res.candidates, args.top), 1):
        st = c.step
        print(f"{i}. {st.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {st.seconds * 1e3:,.0f} ms per step, MFU "
              f"{st.mfu:.1%} ({st.peak_format}), peak {c.peak_bytes / 2**30:.1f} GiB: {c.summary}", file=out)
        top = sorted(st.parts.items(), key=lambda kv: -kv[1])[:4]
        print("   time: " + ", ".join(f"{k} {v / st.seconds:.0%}" for k, v in top), file=out)
        print("   python pretrain_gpt.py " + shlex.join(command_line(rest, c)), file=out)
    return 0


def _vocab_size(cfg) -> int:
    """The vocabulary pretrain_gpt.py (and its dry run) would train with."""
    from megacoat.data import build_tokenizer
    return build_tokenizer(cfg.data).vocab_size


# ------------------------------------------------------------------------------------------------ scaling study
def scaling_rows(gpus: Sequence[int] = GPUS, links: Sequence[int] = LINKS_GBPS, models: Optional[Dict] = None,
                 hardware: str = "h200") -> List[dict]:
    """Per model, GPU count and inter-node link: the best predicted tokens/s per GPU of bf16 and COAT, each with
    plain ZeRO and with the best SDP4Bit option."""
    rows = []
    for model, flags in (models or LLAMA).items():
        argv = shlex.split(flags + " " + COMMON)
        plans: dict = {}  # the memory plans of this model's layouts, the same for every link
        for n in gpus:
            for gbps in links:
                hw = load_hardware(hardware, gbps)
                row = {"model": model, "gpus": n, "gbps": gbps}
                for name, (recipes, states) in METHODS.items():
                    res = search(argv, n, hw, 32000, recipes, states, COMMS, plans_cache=plans)
                    plain = preferred([c for c in res.candidates if "ZeRO plain" in c.summary or "non-sharded" in
                                       c.summary])
                    # with SDP4Bit's options allowed: plain unless a quantized option is more than 0.5% faster
                    row[name] = {"plain": plain, "sdp4bit": preferred(res.candidates)}
                rows.append(row)
                print(f"  {model} {n} GPUs {gbps} Gb/s: " + ", ".join(
                    f"{k} {_tps(v['plain'])} / {_tps(v['sdp4bit'])}" for k, v in row.items()
                    if isinstance(v, dict)), file=sys.stderr, flush=True)
    return rows


def _tps(c) -> str:
    return "-" if c is None else f"{c.tokens_per_s_per_gpu:,.0f}"


def _gain(row, name) -> Optional[float]:
    p, s = row[name]["plain"], row[name]["sdp4bit"]
    return None if p is None or s is None else s.tokens_per_s_per_gpu / p.tokens_per_s_per_gpu


def scaling_markdown(rows: List[dict]) -> str:
    lines = ["Predicted tokens/s per GPU (h200 machine file, 8 GPUs per node, global batch 1,024 x 4,096 tokens). "
             "Each cell: the fastest configuration `tools/plan.py` finds with plain data-parallel communication / "
             "with SDP4Bit's options allowed too (qWD, TLq-HS, both), and the gain in brackets (1.00x: no quantized "
             "option is more than 0.5% faster, e.g. where one node holds the whole run; bf16 gradients likewise "
             "only where they buy more). bf16: bf16 compute, fp32 Adam states; COAT: "
             "`--fp8-recipe coat` with FP8 Adam states.", "",
             "| model | GPUs | inter-node Gb/s per GPU | bf16: plain / with SDP4Bit | COAT: plain / with SDP4Bit | "
             "fastest COAT configuration |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for name in METHODS:
            g = _gain(r, name)
            cells.append(f"{_tps(r[name]['plain'])} / {_tps(r[name]['sdp4bit'])}"
                         + (f" ({g:.2f}x)" if g else ""))
        best = r["COAT"]["sdp4bit"]
        lines.append(f"| {r['model']} | {r['gpus']:,} | {r['gbps']} | {cells[0]} | {cells[1]} | "
                     f"{best.summary if best else 'nothing fits'} |")
    lines += ["", _where_sdp4bit_pays(rows)]
    return "\n".join(lines)


def _where_sdp4bit_pays(rows: List[dict]) -> str:
    out = ["Where SDP4Bit pays (the fastest configuration with its options over the fastest plain one, same "
           "recipe, more than 2%):"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for name in METHODS:
            pays = [(r["gpus"], r["gbps"], _gain(r, name)) for r in rows if r["model"] == model
                    and (_gain(r, name) or 0) > 1.02]
            if pays:
                cells = ", ".join(f"{n} GPUs at {g} Gb/s {x:.2f}x" for n, g, x in pays)
                out.append(f"- {model}, {name}: {cells}.")
            else:
                out.append(f"- {model}, {name}: nowhere in this grid.")
    return "\n".join(out)


def scaling_plot(rows: List[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    styles = {("bf16", "plain"): ("tab:blue", "-"), ("bf16", "sdp4bit"): ("tab:blue", "--"),
              ("COAT", "plain"): ("tab:red", "-"), ("COAT", "sdp4bit"): ("tab:red", "--")}
    marks = {25: "v", 100: "o", 400: "^"}
    for ax, model in zip(axes[0], models):
        for (name, comm), (color, ls) in styles.items():
            for gbps, mk in marks.items():
                pts = [(r["gpus"], r[name][comm].tokens_per_s_per_gpu) for r in rows
                       if r["model"] == model and r["gbps"] == gbps and r[name][comm] is not None]
                if pts:
                    ax.plot(*zip(*pts), color=color, linestyle=ls, marker=mk, alpha=0.85,
                            label=f"{name} {'with SDP4Bit' if comm == 'sdp4bit' else 'plain'}, {gbps} Gb/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (8 per node)")
        ax.set_ylabel("predicted tokens/s per GPU")
        ax.set_title(f"{model}: predicted (tools/plan.py --scaling-table)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _page_with_markers(page: str) -> str:
    if not os.path.isfile(page):
        raise ConfigError(f"--out {page}: no such page; give a markdown file holding a {BEGIN} ... {END} block.")
    text = open(page).read()
    if BEGIN not in text or END not in text:
        raise ConfigError(f"{page} has no {BEGIN} ... {END} block to write the scaling study into.")
    return text


def write_scaling(page: str, plot: str) -> None:
    _page_with_markers(page)  # checked before the study's searches (minutes), not after them
    if not os.path.isdir(os.path.dirname(os.path.abspath(plot))):
        raise ConfigError(f"--plot {plot}: its directory does not exist.")
    rows = scaling_rows()
    block = scaling_markdown(rows)
    if scaling_plot(rows, plot):
        block += f"\n\n![predicted tokens/s per GPU]({os.path.relpath(plot, os.path.dirname(page))})"
    text = _page_with_markers(page)  # read again: the page may have been edited during the study
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{block}\n{END}", text,
                  flags=re.S)
    write_file_atomic(page, text.encode())  # a page is never left half written
    print(f"wrote the scaling study into {page}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, _ = _parser().parse_known_args(argv)
        if args.scaling_table:
            write_scaling(args.out, args.plot)
            return 0
        return plan(argv)
    except ConfigError as e:
        print(f"tools/plan.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
