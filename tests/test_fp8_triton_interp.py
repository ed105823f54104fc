"""The Triton FP8 kernels against their references under the interpreter (cases: tests/fp8_interp_cases.py),
in a fresh process with TRITON_INTERPRET=1: Triton fixes interpretation when a kernel module is first
imported, and other test modules in this process import the same kernels compiled."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU hosts test the real kernels (test_fp8_gpu.py)")
def test_fp8_kernels_interpreted_match_references():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                        os.path.join(os.path.dirname(HERE), "pyproject.toml"), os.path.join(HERE, "fp8_interp_cases.py")],
                       env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(HERE))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
