#!/usr/bin/env python
"""Regenerate the generated tables of docs/benchmarks.md from the newest result folder of each table.

    python benchmarks/report.py            # rewrite the page's generated blocks
    python benchmarks/report.py --check    # exit 1 (with a diff) where the page is not what this generates

Each table of benchmarks/tables.py owns one block of the page, between `<!-- table:NAME -->` and
`<!-- /table:NAME -->` (NAME: table-a, table-c1, table-c2, table-d). The block is written from
benchmarks/results/<date>_<NAME>_<hardware>/<NAME>.json of the newest such folder of each hardware, the table's
own hardware (h200; cpu for a CPU table) first: their tables, targets, plots (the PNGs each folder holds) and a
link to each. A section, target or part that one folder lacks and another shows is not repeated as "not measured".
Where no folder exists yet, a line says how to make one. Everything outside these blocks is left as it is.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import ROOT  # noqa: E402
from tables_render import docs_block, placeholder_block  # noqa: E402
from tables_spec import TABLES  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
FOLDER = re.compile(r"^(\d{4}-\d\d-\d\d)_(table-[a-z0-9]+)_([a-z0-9]+)$")


class ReportError(Exception):
    """The page or the results are not as the report needs them: one line, with the fix."""


def result_folders(results: str, table: str) -> List[str]:
    """The newest folder of `table` under `results` for each hardware that holds its merged JSON: the table's
    own hardware first, then the others, newest first."""
    if not os.path.isdir(results):
        return []
    newest: Dict[str, str] = {}
    for d in sorted(os.listdir(results)):  # by date, then name: the last one of each hardware wins
        m = FOLDER.match(d)
        if m and m.group(2) == table and os.path.isfile(os.path.join(results, d, f"{table}.json")):
            newest[m.group(3)] = d
    own = "cpu" if TABLES[table].device == "cpu" else "h200"
    order = sorted(sorted(newest, key=newest.get, reverse=True), key=lambda hw: hw != own)  # sorted() is stable
    return [os.path.join(results, newest[hw]) for hw in order]


def block(table: str, results: str, page_dir: str) -> str:
    merged = []
    for folder in result_folders(results, table):
        with open(os.path.join(folder, f"{table}.json")) as f:
            merged.append((folder, json.load(f)))
    if not merged:
        return placeholder_block(table)
    out = []
    for i, (folder, m) in enumerate(merged):
        others = [o for j, (_, o) in enumerate(merged) if j != i]
        link = os.path.relpath(folder, page_dir).replace(os.sep, "/")
        images = [p["file"] for p in m.get("plots", []) if os.path.isfile(os.path.join(folder, p["file"]))]
        out.append(docs_block(m, link, images,
                              measured_elsewhere={part for o in others for part in o["parts"]},
                              sections_elsewhere={s["key"] for o in others for s in o["sections"] if s["rows"]},
                              reproduce=i == len(merged) - 1))
    return "\n\n".join(out)


def marker_span(text: str, name: str):
    """(start, end) of the text between the markers of `name`; ReportError unless each marker is there once."""
    opening, closing = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    if text.count(opening) != 1 or text.count(closing) != 1:
        raise ReportError(f"the page needs exactly one `{opening}` and one `{closing}` "
                          f"(found {text.count(opening)} and {text.count(closing)}): add the pair where the table goes")
    start, end = text.index(opening) + len(opening), text.index(closing)
    if end < start:
        raise ReportError(f"`{closing}` comes before `{opening}`")
    return start, end


def regenerate(text: str, blocks: Dict[str, str]) -> str:
    """The page with each named block replaced (one blank line around it)."""
    for name, content in blocks.items():
        start, end = marker_span(text, name)
        text = text[:start] + "\n" + content.strip("\n") + "\n" + text[end:]
    return text


def generate(page: str = PAGE, results: str = RESULTS) -> str:
    """What the page should be."""
    with open(page) as f:
        text = f.read()
    page_dir = os.path.dirname(os.path.abspath(page))
    return regenerate(text, {name: block(name, results, page_dir) for name in TABLES})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page differs")
    ap.add_argument("--page", default=PAGE)
    ap.add_argument("--results", default=RESULTS)
    args = ap.parse_args(argv)
    try:
        want = generate(args.page, args.results)
    except ReportError as e:
        print(f"report.py: error: {args.page}: {e}", file=sys.stderr)
        return 2
    with open(args.page) as f:
        have = f.read()
    if have == want:
        print(f"{os.path.relpath(args.page)}: up to date")
        return 0
    if args.check:
        diff = difflib.unified_diff(have.splitlines(), want.splitlines(), "page", "generated", lineterm="", n=1)
        print("\n".join(list(diff)[:200]))
        print(f"{os.path.relpath(args.page)} is not what benchmarks/report.py generates: run "
              "`python benchmarks/report.py`", file=sys.stderr)
        return 1
    with open(args.page, "w") as f:
        f.write(want)
    print(f"{os.path.relpath(args.page)}: regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
