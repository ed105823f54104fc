"""Install requirements: triton is not a hard dependency (a CPU install would pay ~1 GB for it),
only the test extra (Triton kernels run interpreted on CPU) and the triton extra pull it; megacoat
imports and trains without it."""
import os
import subprocess
import sys

import pytest
import setuptools

from test_cli import ROOT, _env


@pytest.fixture(scope="module")
def setup_kwargs():
    captured = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: captured.update(kw)
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        code = compile(open(os.path.join(ROOT, "setup.py")).read(), "setup.py", "exec")
        exec(code, {"__name__": "__main__", "__file__": os.path.join(ROOT, "setup.py")})
    finally:
        setuptools.setup = real
        os.chdir(cwd)
    return captured


def _names(requirements):
    return [r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requirements]


def test_triton_only_in_extras(setup_kwargs):
    assert "triton" not in _names(setup_kwargs["install_requires"])
    assert "torch" in _names(setup_kwargs["install_requires"])
    test_extra = setup_kwargs["extras_require"]["test"]
    assert "triton" in _names(test_extra) and "pytest" in _names(test_extra)
    assert any(r.startswith("triton") and "Linux" in r for r in test_extra)  # no triton wheels elsewhere


BLOCK_TRITON = r"""
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed (blocked by the test)")
sys.meta_path.insert(0, NoTriton())
for m in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
    del sys.modules[m]
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
import runpy
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_trains_without_triton(tmp_path):
    from test_cli import TINY
    r = subprocess.run([sys.executable, "-c", BLOCK_TRITON] + TINY + ["--train-iters", "2", "--fp32",
                                                                       "--num-workers", "0"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration        2/       2" in r.stdout


def test_ci_installs_the_test_extra():
    """.ci/run runs the README's second command: it must install the test extra (and run pytest)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert '".[test]"' in block[1] and "pytest" in block[1]
    assert "sed -n 2p" in open(os.path.join(ROOT, ".ci", "run")).read()
