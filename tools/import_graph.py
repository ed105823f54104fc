#!/usr/bin/env python
"""The package-level import graph of megacoat, read from the code.

    python tools/import_graph.py                        # text: one line per package and what it imports
    python tools/import_graph.py --mermaid              # the same as a mermaid flowchart
    python tools/import_graph.py --write docs/architecture.md   # refresh the block the doc embeds
    python tools/import_graph.py --check docs/architecture.md   # exit 1 if that block is stale

Every `megacoat/**/*.py` file is parsed with `ast`; each `import` / `from ... import` of a megacoat module
(absolute or relative, at module level or inside a function) becomes an edge from the importing file's
package (the first directory under megacoat/, or the module name for a top-level file such as config.py)
to the imported one. Edges inside one package are left out. The doc embeds the text form between the
markers `<!-- import-graph -->` and `<!-- /import-graph -->`.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megacoat"
BEGIN, END = "<!-- import-graph -->", "<!-- /import-graph -->"


def _module_name(path: Path, src: Path) -> Tuple[str, ...]:
    """('megacoat', 'training', 'trainer') for megacoat/training/trainer.py; __init__ names its package."""
    parts = path.relative_to(src).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _group(module: Tuple[str, ...]) -> Optional[str]:
    """The package an edge is drawn from or to: megacoat.<group>...; None for the root `megacoat` itself."""
    return module[1] if len(module) > 1 and module[0] == PACKAGE else None


def _imported(node: ast.AST, module: Tuple[str, ...], is_package: bool) -> Iterable[Tuple[str, ...]]:
    """The megacoat modules one import statement names (for `from x import y`: x.y where y may be a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield tuple(alias.name.split("."))
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the importing module's package, `level - 1` packages up
            base = module if is_package else module[:-1]
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = base + tuple(node.module.split(".")) if node.module else base
        else:
            target = tuple((node.module or "").split("."))
        if target == (PACKAGE,):  # `from megacoat import training` / `from .. import x`: the names are the packages
            for alias in node.names:
                yield target + (alias.name,)
        else:
            yield target


def package_graph(src: Path = ROOT) -> Dict[str, Set[str]]:
    """{package: set of packages it imports} over every .py file under src/megacoat. A compiled module without a
    .py source (megacoat/_data_helpers, built from csrc/ for data/) is not a package of its own and draws no edge."""
    graph: Dict[str, Set[str]] = {}
    files = sorted((src / PACKAGE).rglob("*.py"))
    packages = {_group(_module_name(p, src)) for p in files} - {None}
    for path in files:
        module = _module_name(path, src)
        own = _group(module)
        if own is None:  # megacoat/__init__.py: the public surface, not a layer
            continue
        graph.setdefault(own, set())
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, path.name == "__init__.py"):
                dst = _group(target)
                if dst in packages and dst != own:
                    graph[own].add(dst)
    return graph


def as_text(graph: Dict[str, Set[str]]) -> str:
    width = max(len(p) for p in graph)
    return "\n".join(f"{p:<{width}} -> {', '.join(sorted(graph[p])) or '(nothing in megacoat)'}"
                     for p in sorted(graph))


def as_mermaid(graph: Dict[str, Set[str]]) -> str:
    lines = ["flowchart TD"] + [f"  {p} --> {d}" for p in sorted(graph) for d in sorted(graph[p])]
    return "\n".join(lines)


def embedded_block(graph: Dict[str, Set[str]]) -> str:
    """What the doc holds between the markers: the text form in a fenced block."""
    return f"{BEGIN}\n```text\n{as_text(graph)}\n```\n{END}"


def replace_block(doc: str, block: str) -> str:
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"no {BEGIN} ... {END} block in the document: add the two markers where the graph goes")
    return doc[:start] + block + doc[end + len(END):]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mermaid", action="store_true", help="print a mermaid flowchart instead of text")
    ap.add_argument("--write", metavar="DOC", help="replace the graph block of DOC with the current graph")
    ap.add_argument("--check", metavar="DOC", help="exit 1 if the graph block of DOC differs from the code")
    args = ap.parse_args(argv)
    graph = package_graph()
    if args.write or args.check:
        path = Path(args.write or args.check)
        doc = path.read_text(encoding="utf-8")
        new = replace_block(doc, embedded_block(graph))
        if args.check:
            if new != doc:
                print(f"{path}: the import graph is stale; run python tools/import_graph.py --write {path}")
                return 1
            return 0
        path.write_text(new, encoding="utf-8")
        return 0
    print(as_mermaid(graph) if args.mermaid else as_text(graph))
    return 0


if __name__ == "__main__":
    sys.exit(main())
