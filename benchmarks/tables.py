#!/usr/bin/env python
"""The headline tables, one command each, from the current commit:

    python benchmarks/tables.py table-a                 # COAT speed and memory, 1.36B and 7B (one H200)
    python benchmarks/tables.py table-c1                # COAT convergence on a code corpus, ~125M (one H200)
    python benchmarks/tables.py table-c2                # SDP4Bit convergence, 4 gloo ranks as 2 nodes x 2 (CPU)
    python benchmarks/tables.py table-d                 # megacoat against plain PyTorch and torchao (one H200)
    python benchmarks/tables.py table-a --dry-run       # the parts and the exact command of every run
    python benchmarks/tables.py table-a --part 7b-mbs2  # one part (repeat --part, or name several: a,b)

A table is split into parts that each fit in 10 minutes on one H200 (table-c2: on CPU). Each part writes
parts/<part>.json into the table's result folder, benchmarks/results/<date>_<table>_<hardware>/ (--out), and
a later call skips the parts already there (--redo runs them again): a table can be run part by part, on
machines that come and go. After every call the folder's merged outputs are rewritten from the parts it holds:
<table>.json, README.md (tables, targets, where and how each part ran) and PNG plots (with matplotlib;
`--merge-only` redraws them elsewhere). `benchmarks/report.py` copies the newest folder of each table into
docs/benchmarks.md. Each part records the date, commit, GPU, torch/Triton/CUDA versions and the exact commands.

On a fresh machine, `--prepare-only` first compiles the CUDA extensions (and builds table-c1's corpus, unpacks
torchao) so that the parts' 10 minutes go to the runs. `--steps N` cuts every run to N steps: a quick check of
the plumbing whose output goes to a scratch folder unless --out says otherwise (never a table's numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import ROOT  # noqa: E402
from result_json import write_json  # noqa: E402
from tables_env import describe, gpus, hardware_name, utc_date  # noqa: E402
from tables_render import readme, sections_markdown, targets_table, write_plots  # noqa: E402
from tables_run import (Context, build_code_corpus, build_extensions, command_line, corpus_command,  # noqa: E402
                        execute, gpu_capacity_gib, run_process, run_search, setup_torchao, shell, unsteady_runs)
from tables_spec import TABLES, Part, Table, with_steps, with_steps_search  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
# A part's wall-time budget: no run starts past it. On a GPU machine a command may run 10 minutes; a CPU part
# (table-c2) is sized for 10 minutes of a 2-core machine but not cut there, where other work may slow it.
DEFAULT_BUDGET_S = {"cuda": 570, "cpu": 1800}
DEFAULT_CORPUS_DIR = os.path.join(tempfile.gettempdir(), "megacoat-code-corpus")
# Checkpoints of resumable runs (table-c1): a run cut by its part's budget continues there on the same machine.
DEFAULT_SCRATCH = os.path.join(tempfile.gettempdir(), "megacoat-table-checkpoints")
FOLDER = re.compile(r"^(\d{4}-\d\d-\d\d)_(table-[a-z0-9]+)_([a-z0-9]+)$")


class UsageError(Exception):
    """Bad arguments or a table that cannot run here: one line, with the fix."""


# ------------------------------------------------------------------------------------------------ part files


def part_file(out: str, name: str, partial: bool = False) -> str:
    return os.path.join(out, "parts", f"{name}{'.partial' if partial else ''}.json")


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:  # edited or damaged by hand: written files are whole (write_json)
        raise UsageError(f"{path} is not valid JSON ({e}): restore it from git or delete it and run its part "
                         "again") from None


def done_parts(out: str, table: Table) -> Dict[str, dict]:
    """The parts of `table` written complete in `out`, in the table's order."""
    found = {}
    for p in table.parts:
        path = part_file(out, p.name)
        if os.path.exists(path):
            found[p.name] = read_json(path)
    return found


def select_parts(table: Table, names: Optional[List[str]]) -> List[Part]:
    if not names:
        return list(table.parts)
    wanted = [n for arg in names for n in arg.split(",") if n]
    known = [p.name for p in table.parts]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise UsageError(f"{table.name} has no part {', '.join(unknown)}: its parts are {', '.join(known)}")
    return [table.part(n) for n in known if n in wanted]


def resolve_out(out: Optional[str], table: Table, hardware: Optional[str], steps: Optional[int], merge_only: bool,
                results: str = RESULTS) -> str:
    """--out, else a scratch folder for --steps, else the newest result folder of this table and hardware that
    still lacks parts (or any newest one with --merge-only), else a new one dated today."""
    if out:
        out = os.path.abspath(out)
        if os.path.exists(out) and not os.path.isdir(out):
            raise UsageError(f"--out {out} is a file: give a folder (it is created if missing)")
        if merge_only and not (os.path.isdir(out) and done_parts(out, table)):
            raise UsageError(f"--merge-only: {out} holds no part of {table.name} to merge (its parts are written "
                             f"as parts/NAME.json): give the folder the parts were written to")
        return out
    if steps:
        return tempfile.mkdtemp(prefix=f"{table.name}-steps{steps}-")
    folders = sorted(d for d in (os.listdir(results) if os.path.isdir(results) else [])
                     if (m := FOLDER.match(d)) and m.group(2) == table.name
                     and (merge_only or m.group(3) == hardware) and os.path.isdir(os.path.join(results, d)))
    if folders:
        newest = os.path.join(results, folders[-1])
        if merge_only or len(done_parts(newest, table)) < len(table.parts):
            return newest
    if merge_only:
        raise UsageError(f"no result folder of {table.name} under {os.path.relpath(results, ROOT)}: pass --out DIR")
    return os.path.join(results, f"{utc_date()}_{table.name}_{hardware}")


# ------------------------------------------------------------------------------------------------- dry run

SENTINEL = 9999  # a micro-batch no search reaches: shown as MB


def _shown(argv: List[str]) -> str:
    return shell([a.replace(str(SENTINEL), "MB") for a in argv])


def plan_text(table: Table, parts: List[Part], out: str, steps: Optional[int], corpus_dir: str = DEFAULT_CORPUS_DIR,
              scratch: str = DEFAULT_SCRATCH) -> str:
    total = sum(p.minutes for p in parts)
    where = "a CPU" if table.device == "cpu" else "one H200"
    lines = [f"{table.name}: {table.title}. {len(parts)} part(s), about {total:.0f} minutes on {where} with warm "
             "caches" + (f"; every run cut to {steps} steps" if steps else "") + ".",
             f"Output folder: {os.path.relpath(out, ROOT) if not os.path.relpath(out, ROOT).startswith('..') else out}"
             " (parts already written there are skipped).", ""]
    for p in parts:
        lines.append(f"part {p.name} (about {p.minutes:g} min): {p.about}")
        lines.append(f"  python benchmarks/tables.py {table.name} --part {p.name}"
                     + (f" --steps {steps}" if steps else ""))
        if "extensions" in p.prepare:
            lines.append("  first: compile the CUDA extensions, all three at once (quick once cached; "
                         "--prepare-only does it ahead)")
        if "corpus" in p.prepare:
            lines.append("  first: the code corpus, once per machine: the built-in corpus's tokenizer "
                         "(<tokenizer.model>), then "
                         + shell(corpus_command("python", ["<site-packages>"], "<tokenizer.model>",
                                                os.path.join(corpus_dir, "sitepackages"), 16)))
        if "torchao" in p.prepare:
            lines.append("  first: torchao's float8 from the environment or a wheel under .whl/ (else its rows "
                         "are skipped)")
        for run in p.runs:
            run = with_steps(run, steps) if steps else run
            fill = {"corpus": os.path.join(corpus_dir, "sitepackages_text_document"), "tokenizer": "<tokenizer.model>"}
            log = f"{'--log-json' if run.kind == 'megacoat' else '--json'} <out>/raw/{p.name}/{run.name}.jsonl"
            if run.save_interval:
                saved = os.path.join(scratch, f"{table.name}-<commit>-{steps or 'full'}-{p.name}-{run.name}")
                log = (f"--log-json {saved}.jsonl --save {saved} --load {saved} --save-interval {run.save_interval} "
                       "--save-retain 1 (the log is copied to <out>/raw/ after)")
            lines.append(f"  {run.name}: {shell(command_line(run, fill=fill))} {log}")
        for s in p.searches:
            s = with_steps_search(s, steps) if steps else s
            argv = command_line(s.make(SENTINEL))
            lines.append(f"  {s.name}, largest micro-batch MB: the planner's estimate for MB = {s.start}, "
                         f"{2 * s.start}, {4 * s.start}, ... (then bisection), the largest that fits the GPU:")
            lines.append(f"    {_shown(argv)} --dry-run")
            lines.append("    then runs from that MB up while they run (down until one runs if it does not):")
            lines.append(f"    {_shown(argv)} --log-json <out>/raw/{p.name}/{s.name}-mbsMB.jsonl")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- running


def prepare(part: Part, ctx: Context, corpus_dir: str, record: dict) -> bool:
    """What `part` needs before its runs; False where it cannot run (said in the record's notes)."""
    if "extensions" in part.prepare:
        record["prepare"]["extensions"] = build_extensions(ctx)
        print(f"[{part.name}] CUDA extensions: {record['prepare']['extensions']}", flush=True)
    if "corpus" in part.prepare:
        try:
            ctx.corpus = build_code_corpus(ctx, corpus_dir)
        except RuntimeError as e:
            record["notes"].append(f"no code corpus: {e}")
            return False
        record["prepare"]["corpus"] = ctx.corpus
        print(f"[{part.name}] code corpus: {ctx.corpus['tokens']:,} tokens, fingerprint {ctx.corpus['fingerprint']}",
              flush=True)
    if "torchao" in part.prepare:
        ctx.torchao_path, note = setup_torchao(ctx)
        record["prepare"]["torchao"] = note
        record["notes"].append(note)
        print(f"[{part.name}] {note}", flush=True)
    return True


def _say(part: str, run: dict) -> None:
    m = run.get("metrics") or {}
    what = f"{m['tokens_per_s']:,.0f} tokens/s, peak {m.get('peak_gib') or 0:.2f} GiB" if m else ""
    if m.get("final_valid_loss") is not None:
        what += f", validation {m['final_valid_loss']:.4f}"
    print(f"[{part}] {run['name']}: {run['outcome']}{'; ' + what if what else ''} ({run['seconds']:.0f} s)",
          flush=True)


def part_status(record: dict) -> str:
    """complete: every run ended (out-of-memory attempts of a search and torchao rows skipped where it does not
    import count as ended); partial: the time budget cut it; failed: a run failed (both are run again later)."""
    runs = list(record["runs"]) + [a["run"] for s in record["searches"] for a in s["attempts"]]
    if any(r["outcome"].startswith(("timed out", "skipped: the part's time budget")) for r in runs):
        return "partial"
    if any(s.get("stopped") for s in record["searches"]) or not record.get("prepared", True):
        return "failed"
    if any(r["outcome"].startswith("failed") or r["outcome"] == "skipped: no code corpus" for r in runs):
        return "failed"
    return "complete"


def run_part(table: Table, part: Part, out: str, argv: List[str], budget_s: float, steps: Optional[int],
             corpus_dir: str, runner=run_process, scratch: str = DEFAULT_SCRATCH, fresh: bool = False) -> dict:
    t0 = time.monotonic()
    env = describe(argv, part.device)
    ctx = Context(root=ROOT, out=out, part=part.name, device=part.device, deadline=t0 + budget_s, scratch=scratch,
                  key=f"{table.name}-{(env.get('commit') or 'nocommit')[:12]}-{steps or 'full'}", fresh=fresh)
    record = {"table": table.name, "part": part.name, "about": part.about, "status": "running", "steps": steps,
              "environment": env, "prepare": {}, "runs": [], "searches": [], "notes": []}
    record["prepared"] = prepare(part, ctx, corpus_dir, record)
    if record["prepared"]:
        for run in part.runs:
            record["runs"].append(execute(with_steps(run, steps) if steps else run, ctx, runner))
            _say(part.name, record["runs"][-1])
        gpu = env.get("gpu") or {}
        capacity = gpu_capacity_gib(gpu["memory_gib"]) if gpu.get("memory_gib") else None
        for s in part.searches:
            result = run_search(with_steps_search(s, steps) if steps else s, ctx, capacity, runner)
            for a in result["attempts"]:
                _say(part.name, a["run"])
            print(f"[{part.name}] {s.name}: largest micro-batch {result['largest']} (planner: "
                  f"{result['planner_candidate']})", flush=True)
            record["searches"].append(result)
    record["seconds"] = round(time.monotonic() - t0, 1)
    record["status"] = part_status(record)
    complete = record["status"] == "complete"
    write_json(part_file(out, part.name, partial=not complete), record)
    if complete and os.path.exists(part_file(out, part.name, partial=True)):
        os.remove(part_file(out, part.name, partial=True))
    return record


# -------------------------------------------------------------------------------------------------- merging


def _device_name(env: dict) -> str:
    if env.get("gpu"):
        return env["gpu"]["name"]
    return f"CPU ({env.get('cpu_count')} cores)"


def merge(table: Table, out: str) -> Tuple[dict, Dict[str, dict]]:
    """The table from the complete parts in `out`: sections, targets and plots (tables_spec's analysis) and
    where each part ran."""
    parts = done_parts(out, table)
    steps = {p.get("steps") for p in parts.values()}
    if len(steps) > 1:
        raise UsageError(f"{out} mixes parts cut to fewer steps with full ones ({sorted(map(str, steps))}): "
                         "remove the cut ones or use another --out")
    analysis = table.analyse(parts)
    folder = os.path.basename(os.path.normpath(out))
    m = FOLDER.match(folder)
    dates = sorted(p["environment"]["date"][:10] for p in parts.values())
    hardware = sorted({p["environment"]["hardware"] for p in parts.values()})
    merged = {
        "table": table.name, "title": table.title, "folder": folder,
        "date": m.group(1) if m else (dates[0] if dates else utc_date()),
        "hardware": m.group(3) if m else ("/".join(hardware) or "none"),
        "steps": next(iter(steps)) if steps else None,
        "parts": {name: {"date": p["environment"]["date"], "commit": p["environment"]["commit"],
                         "device_name": _device_name(p["environment"]), "torch": p["environment"].get("torch"),
                         "triton": p["environment"].get("triton"), "cuda": p["environment"].get("cuda"),
                         "seconds": p["seconds"], "status": p["status"], "command": p["environment"]["command"]}
                  for name, p in parts.items()},
        "missing_parts": [p.name for p in table.parts if p.name not in parts],
        "checks": unsteady_runs(parts, out) if table.speed else [],
        **analysis,
    }
    corpora = {p["prepare"]["corpus"]["fingerprint"] for p in parts.values() if p.get("prepare", {}).get("corpus")}
    if len(corpora) > 1:
        merged["warnings"] = [f"the parts read different code corpora (fingerprints {', '.join(sorted(corpora))}): "
                              "their losses do not compare"]
    return merged, parts


def write_outputs(table: Table, out: str) -> dict:
    merged, parts = merge(table, out)
    merged.setdefault("warnings", [])
    if parts:
        merged["warnings"] += write_plots(merged, out, ROOT)
    else:
        for p in merged["plots"]:
            p["written"] = False
    write_json(os.path.join(out, f"{table.name}.json"), merged)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(readme(merged, parts))
    return merged


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=sorted(TABLES))
    ap.add_argument("--part", action="append", help="run only these parts (repeat, or comma-separated)")
    ap.add_argument("--out", help="the table's result folder (default: benchmarks/results/<date>_<table>_<hardware>,"
                                  " the newest one of this table that still lacks parts)")
    ap.add_argument("--dry-run", action="store_true", help="print the parts and the exact commands; run nothing")
    ap.add_argument("--merge-only", action="store_true",
                    help="run nothing: rewrite the merged JSON, README.md and plots from the parts in the folder")
    ap.add_argument("--prepare-only", action="store_true",
                    help="compile the CUDA extensions, build the corpus, unpack torchao (what the parts need first)")
    ap.add_argument("--redo", action="store_true", help="run the selected parts even where already written")
    ap.add_argument("--steps", type=int, help="cut every run to this many steps (a plumbing check: not the table)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds of one part: no run starts past it, the part is then left partial "
                         f"(default: {DEFAULT_BUDGET_S['cuda']} on a GPU, {DEFAULT_BUDGET_S['cpu']} for a CPU table)")
    ap.add_argument("--corpus-dir", default=DEFAULT_CORPUS_DIR, help="where table-c1's code corpus is built")
    ap.add_argument("--scratch", default=DEFAULT_SCRATCH,
                    help="checkpoints of table-c1's runs, so that a part cut by its budget resumes on this machine")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        ap.error("--steps must be at least 2")
    return args


def _hardware(table: Table) -> Optional[str]:
    if table.device == "cpu":
        return "cpu"
    found = gpus()
    return hardware_name(found) if found else None


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    table = TABLES[args.table]
    try:
        parts = select_parts(table, args.part)
        hardware = _hardware(table)
        if args.dry_run:
            out = args.out or ("<a scratch folder>" if args.steps else
                               os.path.join(RESULTS, f"{utc_date()}_{table.name}_{hardware or '<gpu>'}"))
            print(plan_text(table, parts, out, args.steps, args.corpus_dir, args.scratch))
            return 0
        if hardware is None and not args.merge_only:
            raise UsageError(f"{table.name} runs on a CUDA GPU and nvidia-smi finds none here: run it on a GPU "
                             "machine (--dry-run prints the commands; --merge-only --out DIR combines parts "
                             "already written)")
        out = resolve_out(args.out, table, hardware, args.steps, args.merge_only)
        print(f"{table.name}: {os.path.relpath(out, ROOT) if out.startswith(ROOT) else out}", flush=True)
        failed = []
        if args.prepare_only:
            ctx = Context(root=ROOT, out=out, part="prepare", device=table.device)
            record = {"prepare": {}, "notes": []}
            for p in parts:
                prepare(Part(p.name, p.about, p.minutes, prepare=tuple(x for x in p.prepare
                                                                      if x not in record["prepare"])),
                        ctx, args.corpus_dir, record)
            print(json.dumps(record, indent=1))
            return 0
        if not args.merge_only:
            os.makedirs(out, exist_ok=True)
            done = done_parts(out, table)
            call = ["python", "benchmarks/tables.py"] + (sys.argv[1:] if argv is None else list(argv))
            for p in parts:
                if p.name in done and not args.redo:
                    print(f"[{p.name}] already written ({done[p.name]['environment']['date']}, commit "
                          f"{(done[p.name]['environment']['commit'] or '?')[:7]}): skipped (--redo runs it again)",
                          flush=True)
                    continue
                budget = args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S[p.device]
                record = run_part(table, p, out, call, budget, args.steps, args.corpus_dir,
                                  scratch=args.scratch, fresh=args.redo)
                print(f"[{p.name}] {record['status']} in {record['seconds']:.0f} s", flush=True)
                if record["status"] != "complete":
                    failed.append(f"{p.name} ({record['status']}: {part_file(out, p.name, partial=True)})")
        merged = write_outputs(table, out)
    except UsageError as e:
        print(f"tables.py: error: {e}", file=sys.stderr)
        return 2
    print()
    print(sections_markdown(merged))
    if merged["targets"]:
        print("\n" + targets_table(merged["targets"]))
    for w in merged.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    for c in merged.get("checks", []):
        print(f"check: {c}", file=sys.stderr)
    if merged["missing_parts"]:
        print(f"\nparts not written yet: {', '.join(merged['missing_parts'])}")
    if failed:
        print("not complete (run again): " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
