"""The Triton FP8 kernels against their references under the interpreter (cases: tests/fp8_interp_cases.py),
in a fresh process with TRITON_INTERPRET=1: Triton fixes interpretation when a kernel module is first
imported, and other test modules in this process import the same kernels compiled."""
import pytest
import torch

from interp_runner import assert_interpreted_cases_pass

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU hosts test the real kernels (test_fp8_gpu.py)")
def test_fp8_kernels_interpreted_match_references():
    assert_interpreted_cases_pass("fp8_interp_cases.py")
