import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with dynamo's caches empty. Tests compile the same layer code (TransformerLayer.forward, ...)
    with their own guards, and dynamo counts recompiles per code object over the whole process: without a reset,
    the test order decided when its limit (8) was hit, and a fullgraph=True compile then failed (in the full suite,
    `test_compiled_fp8_layer_fullgraph_equals_eager` after the fused-RoPE compiled cases)."""
    torch._dynamo.reset()
    yield
