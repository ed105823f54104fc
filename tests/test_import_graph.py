"""tools/import_graph.py: docs/architecture.md shows the package import graph the code has, and the packages depend
on each other in one direction only.

Layers, top to bottom (a package imports only from layers below its own, plus the pairs in SAME_LAYER):
    api
    training, convert
    model, optim, data, checkpoint
    precision, comm
    parallel
    kernels
`config` (the flag dataclasses) is importable from everywhere and imports nothing of megacoat.
"""
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import import_graph  # noqa: E402

LAYERS = [
    {"api"},
    {"training", "convert"},
    {"model", "optim", "data", "checkpoint"},
    {"precision", "comm"},
    {"parallel"},
    {"kernels"},
]
# Within one layer: checkpoints hold the model's weights and the data iterators' position.
SAME_LAYER = {("checkpoint", "model"), ("checkpoint", "data")}
ANYWHERE = "config"


def _level(package):
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    return None


def allowed(src, dst):
    if dst == ANYWHERE:
        return True
    return (src, dst) in SAME_LAYER or _level(src) < _level(dst)


def test_architecture_doc_embeds_the_graph_of_the_code():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = import_graph.embedded_block(import_graph.package_graph())
    assert block in doc, ("docs/architecture.md's import graph differs from the code; "
                          "run python tools/import_graph.py --write docs/architecture.md")


def test_every_package_has_a_layer():
    graph = import_graph.package_graph()
    unplaced = sorted(p for p in graph if p != ANYWHERE and _level(p) is None)
    assert not unplaced, f"packages without a layer in {__file__}: {unplaced} (place them in LAYERS)"


def test_dependencies_point_down_the_layers():
    graph = import_graph.package_graph()
    upward = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts if not allowed(src, dst))
    assert not upward, "imports against the layer order (see this file's docstring): " + ", ".join(upward)
    assert graph[ANYWHERE] == set(), f"config imports {sorted(graph[ANYWHERE])}: it must stay importable from everywhere"


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / "megacoat" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_graph_reads_absolute_relative_and_function_level_imports(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "from .training import run\n",
        "config.py": "import dataclasses\n",
        "training/__init__.py": "from .loop import run\n",
        "training/loop.py": ("from ..model.gpt import GPT\nimport megacoat.optim.adam\nfrom megacoat import data\n"
                             "def run():\n    from ..checkpoint import save\n"),
        "model/__init__.py": "",
        "model/gpt.py": "from megacoat.config import Cfg\nfrom . import layers\n",
        "model/layers.py": "from ..kernels import fused\n",
        "optim/__init__.py": "", "optim/adam.py": "",
        "data/__init__.py": "from .. import _helpers\n",  # a compiled module without a .py: no package
        "checkpoint/__init__.py": "def save(): pass\n",
        "kernels/__init__.py": "", "kernels/fused.py": "import torch\n",
    })
    graph = import_graph.package_graph(src)
    assert graph == {"training": {"model", "optim", "data", "checkpoint"}, "config": set(), "model": {"config", "kernels"},
                     "optim": set(), "data": set(), "checkpoint": set(), "kernels": set()}
    assert import_graph.as_text(graph).splitlines()[-1] == "training   -> checkpoint, data, model, optim"


def test_upward_import_is_reported(tmp_path):
    src = _tree(tmp_path, {"kernels/__init__.py": "from megacoat.training import loop\n",
                           "training/__init__.py": "", "training/loop.py": "from ..kernels import x\n"})
    graph = import_graph.package_graph(src)
    assert [(s, d) for s, ds in graph.items() for d in ds if not allowed(s, d)] == [("kernels", "training")]


def test_write_and_check_keep_the_rest_of_the_doc(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\n{import_graph.BEGIN}\nold\n{import_graph.END}\n\nafter\n")
    assert import_graph.main(["--check", str(doc)]) == 1
    assert "stale" in capsys.readouterr().out
    assert import_graph.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\n") and text.endswith("\n\nafter\n") and "training   -> " in text
    assert import_graph.main(["--check", str(doc)]) == 0
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        import_graph.main(["--check", str(doc)])
