"""Run a file of Triton kernel cases under the interpreter (TRITON_INTERPRET=1) in a fresh pytest process:
Triton decides at import whether kernels are interpreted, so such cases cannot share a process with tests
that compile the same kernels."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_interpreted_cases_pass(cases_file: str, timeout: int = 900) -> None:
    """Every case of `cases_file` (a path under tests/) passes, none skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                        os.path.join(ROOT, "pyproject.toml"), os.path.join(ROOT, "tests", cases_file)],
                       env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def skip_unless_interpreted(runner: str) -> None:
    """At the top of an interpreter case file: skip the module on GPU hosts (the interpreter flag is process-wide;
    they test the real kernels), without Triton, and unless run through `runner` (a fresh process with
    TRITON_INTERPRET=1: Triton decides at import whether kernels are interpreted)."""
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only hosts", allow_module_level=True)
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"run through {runner} (a fresh process with TRITON_INTERPRET=1)", allow_module_level=True)
