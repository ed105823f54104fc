"""A table's merged JSON as markdown (the result folder's README.md, and the block benchmarks/report.py writes
into docs/benchmarks.md) and as PNG plots (matplotlib; skipped with a warning where it is not installed).

Everything here reads the merged JSON only, so that the page and the result folder say the same thing."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Set

from tables_spec import all_runs

FORMATS: Dict[str, Callable[[float], str]] = {
    "int": lambda v: f"{v:,.0f}",
    "float1": lambda v: f"{v:.1f}",
    "ratio": lambda v: f"{v:.3f}x",
    "gib": lambda v: f"{v:.2f}",
    "pct1": lambda v: f"{100 * v:.1f}%",
    "gap": lambda v: f"{100 * v:+.2f}%",
    "loss": lambda v: f"{v:.4f}",
}


def cell(value, fmt: str) -> str:
    if value is None or value == "":
        return "-"
    if fmt == "text" or isinstance(value, str):
        return str(value).replace("|", "\\|")
    return FORMATS[fmt](value)


def markdown_table(columns: List[dict], rows: List[dict]) -> str:
    lines = ["| " + " | ".join(c["title"] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c["key"]), c["fmt"]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def target_value(t: dict) -> str:
    if t["value"] is None:
        return "not measured"
    return cell(t["value"], "ratio" if t["unit"] == "x" else "gap")


def target_required(t: dict) -> str:
    return f"{t['op']} " + cell(t["threshold"], "ratio" if t["unit"] == "x" else "gap")


def targets_table(targets: List[dict]) -> str:
    rows = [{"what": t["what"], "value": target_value(t), "required": target_required(t),
             "met": {True: "yes", False: "**no**", None: "not measured"}[t["met"]], "part": t["part"]}
            for t in targets]
    cols = [{"key": "what", "title": "target", "fmt": "text"}, {"key": "value", "title": "measured", "fmt": "text"},
            {"key": "required", "title": "required", "fmt": "text"}, {"key": "met", "title": "met", "fmt": "text"},
            {"key": "part", "title": "part", "fmt": "text"}]
    return markdown_table(cols, rows)


def sections_markdown(merged: dict, level: str = "###") -> str:
    out = []
    for s in merged["sections"]:
        out.append(f"{level} {s['title']}\n\n" + (markdown_table(s["columns"], s["rows"]) if s["rows"]
                                                   else "Not measured yet."))
    return "\n\n".join(out)


def _short(commit: Optional[str]) -> str:
    return f"`{commit[:7]}`" if commit else "an unknown commit"


def provenance_line(merged: dict) -> str:
    """Dates, commits and software of the parts, collapsed where they agree."""
    parts = merged["parts"].values()
    dates = sorted({p["date"][:10] for p in parts})
    commits = sorted({p["commit"] or "" for p in parts})
    env = sorted({f"{p['device_name']}, torch {p['torch']}" + (f", Triton {p['triton']}" if p.get("triton") else "")
                  + (f", CUDA {p['cuda']}" if p.get("cuda") else "") for p in parts})
    return (f"{' to '.join([dates[0], dates[-1]] if len(dates) > 1 else dates)}, commit "
            f"{', '.join(_short(c) for c in commits)}; {'; '.join(env)}")


def missing_line(merged: dict) -> str:
    if not merged["missing_parts"]:
        return ""
    return ("Parts not measured yet: " + ", ".join(f"`{p}`" for p in merged["missing_parts"])
            + f" (`python benchmarks/tables.py {merged['table']} --part NAME`).")


def readme(merged: dict, parts: Dict[str, dict]) -> str:
    """The result folder's README.md: the tables, the targets, where each part ran and the exact commands."""
    lines = [f"# {merged['date']}: {merged['title']} ({merged['hardware']})", "",
             f"Made by `python benchmarks/tables.py {merged['table']}` ({len(merged['parts'])} of "
             f"{len(merged['parts']) + len(merged['missing_parts'])} parts): {provenance_line(merged)}."]
    if merged.get("steps"):
        lines += ["", f"**Smoke run: every run cut to {merged['steps']} steps; these numbers are not the table's.**"]
    if merged["missing_parts"]:
        lines += ["", missing_line(merged)]
    lines += ["", sections_markdown(merged, "##")]
    if merged["targets"]:
        lines += ["", "## Targets", "", merged.get("targets_note", ""), "", targets_table(merged["targets"])]
    if merged.get("checks"):
        lines += ["", "## Checks", ""] + [f"- {c}." for c in merged["checks"]]
    images = [p["file"] for p in merged["plots"] if p.get("written")]
    if images:
        lines += ["", "## Plots", ""] + [f"![{f[:-4].replace('_', ' ')}]({f})" for f in images]
    lines += ["", "## Parts", ""]
    for name, p in merged["parts"].items():
        part = parts[name]
        env = part["environment"]
        software = ", ".join(f"{k} {env[key]}" for k, key in (("torch", "torch"), ("Triton", "triton"),
                                                               ("CUDA", "cuda"), ("Python", "python")) if env.get(key))
        lines += [f"### {name}", "", part["about"] + ".", "",
                  f"- {env['date']}, commit {_short(env['commit'])}"
                  + (f" ({env['changed_files']} tracked files changed)" if env.get("changed_files") else "")
                  + f", {p['device_name']}, {software}; {part['seconds']:.0f} s"
                  + ("" if part["status"] == "complete" else f" ({part['status']})") + ".",
                  f"- Command: `{env['command']}`"]
        for note in part.get("notes", []):
            lines.append(f"- {note}")
        for r in all_runs(part):
            lines.append(f"- `{r['name']}` ({r['outcome']}, {r['seconds']:.0f} s): `{r['command']}`")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def docs_block(merged: dict, link: str, images: List[str], measured_elsewhere: Set[str] = frozenset(),
               sections_elsewhere: Set[str] = frozenset(), reproduce: bool = True) -> str:
    """What benchmarks/report.py writes between a table's markers in docs/benchmarks.md for one result folder.
    `link` is the folder relative to the page; `images` the PNGs it holds. Parts in `measured_elsewhere` and
    sections in `sections_elsewhere` are shown from another folder (other hardware): what this folder lacks of
    them is left out rather than called not measured. `reproduce`: end with the table's command."""
    shown = dict(merged, missing_parts=[p for p in merged["missing_parts"] if p not in measured_elsewhere],
                 sections=[s for s in merged["sections"] if s["rows"] or s["key"] not in sections_elsewhere],
                 targets=[t for t in merged["targets"] if t["met"] is not None or t["part"] not in measured_elsewhere])
    lines = [f"{provenance_line(shown)}; result: [{shown['folder']}]({link}/README.md)."]
    if shown.get("steps"):
        lines += ["", f"**Smoke run ({shown['steps']} steps per run): not the table's numbers.**"]
    if shown["missing_parts"]:
        lines += ["", missing_line(shown)]
    lines += ["", sections_markdown(shown, "####")]
    if shown["targets"]:
        lines += ["", f"Targets. {shown.get('targets_note', '')}", "", targets_table(shown["targets"])]
    if shown.get("checks"):
        lines += [""] + [f"Check: {c}." for c in shown["checks"]]
    if images:
        lines += [""] + [f"![{f[:-4].replace('_', ' ')}]({link}/{f})" for f in images]
    if reproduce:
        lines += ["", f"Reproduce: `python benchmarks/tables.py {shown['table']}` (parts: "
                  + ", ".join(f"`{p}`" for p in list(merged["parts"]) + merged["missing_parts"]) + ")."]
    return "\n".join(lines)


def placeholder_block(table: str) -> str:
    return (f"Not measured with `benchmarks/tables.py` yet: `python benchmarks/tables.py {table}`, then "
            "`python benchmarks/report.py`.")


# --------------------------------------------------------------------------------------------------------- plots


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def _bars(plot: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = plot["groups"]
    colours = {}   # one colour per method, the same in every group
    for bars in groups.values():
        for _, key, _ in bars:
            colours.setdefault(key, f"C{len(colours) % 10}")
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 1.2 + 0.45 * sum(len(v) for v in groups.values())
                                                      + 0.6 * len(groups)), squeeze=False)
    for ax, (title, bars) in zip(axes[:, 0], groups.items()):
        values = [v for _, _, v in bars]
        ax.barh(range(len(bars)), values, color=[colours[k] for _, k, _ in bars])
        ax.set_yticks(range(len(bars)), [label.replace("`", "") for label, _, _ in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:,.0f}" if v >= 100 else f" {v:.2f}", va="center", fontsize=7)
        ax.set_xlim(0, max(values) * 1.15)
    axes[-1, 0].set_xlabel(plot["ylabel"])
    fig.suptitle(plot["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(merged: dict, out: str, root: str, python: str = sys.executable) -> List[str]:
    """Draw every plot of `merged` into `out`; marks each plot written or not; returns warnings."""
    warnings = []
    if not have_matplotlib():
        for p in merged["plots"]:
            p["written"] = os.path.exists(os.path.join(out, p["file"]))
        return ["matplotlib is not installed: no plots drawn (pip install matplotlib, then "
                f"`python benchmarks/tables.py {merged['table']} --merge-only --out {out}`)"]
    for p in merged["plots"]:
        path = os.path.join(out, p["file"])
        p["written"] = False
        if p["kind"] == "bars" and p["groups"]:
            _bars(p, path)
            p["written"] = True
        elif p["kind"] == "curves" and p["runs"]:
            specs = [f"{name}={os.path.join(out, log)}" for name, log in p["runs"].items()]
            done = subprocess.run([python, os.path.join(root, "tools", "plot_runs.py"), *specs, "--out", path,
                                   "--smooth", str(p.get("smooth", 1))], capture_output=True, text=True, cwd=root)
            if done.returncode == 0:
                p["written"] = True
            else:
                warnings.append(f"tools/plot_runs.py failed for {p['file']}: {done.stderr.strip()[-300:]}")
    return warnings
