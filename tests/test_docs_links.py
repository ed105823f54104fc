"""Every relative link of README.md and docs/*.md points to a file or folder of the repository, and every
repository path written in backticks there exists: a renamed module or result folder fails here, not in a
reader's browser."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A backticked path under one of the repository's top folders, e.g. `megacoat/precision/layer_ops.py`.
TOP = ("megacoat", "benchmarks", "tools", "tests", "scripts", "csrc", "docs")
PATH = re.compile(r"`((?:%s)/[A-Za-z0-9_./-]+)`" % "|".join(TOP))
PLACEHOLDER = re.compile(r"(^|/)(NAME|DIR|FILE|PATH|TABLE|DATE|N)(\.|/|$)")  # e.g. hardware/NAME.json


def _targets(page):
    text = open(page, encoding="utf-8").read()
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z]+:", target):  # http(s):, mailto: ... are not checked here
            yield "link", os.path.normpath(os.path.join(os.path.dirname(page), target))
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if not any(c in path for c in "*<>") and not PLACEHOLDER.search(path):  # a pattern or a placeholder
            yield "path", os.path.join(ROOT, path)


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_links_and_paths_resolve(page):
    missing = sorted({f"{kind} {os.path.relpath(t, ROOT)}" for kind, t in _targets(page) if not os.path.exists(t)})
    assert not missing, f"{os.path.relpath(page, ROOT)} names what the repository does not hold: {missing}"


def test_the_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[gone](nowhere.md) and `megacoat/no_such_module.py`")
    kinds = {kind for kind, t in _targets(str(page)) if not os.path.exists(t)}
    assert kinds == {"link", "path"}
