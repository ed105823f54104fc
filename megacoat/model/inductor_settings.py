"""Inductor settings the compiled transformer layers run with."""
from __future__ import annotations

import os

STATIC_USER_KERNELS = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def launch_user_kernels_statically() -> bool:
    """Have Inductor launch user-defined Triton kernels (megacoat's FP8 kernels, registered as `triton_op`s) through
    its static CUDA launcher, as it does its own kernels. By default it sends them through Triton's Python launcher,
    which costs more host time per launch (an eagerly launched FP8 quantize: 39 us of host on the H200). A 1.36B coat
    step launches ~390 of them; while that step was host-bound, an A/B on the H200 ran 73.2k -> 75.0k tokens/s
    with the same losses (`benchmarks/results/2026-12-02_coat-host-time_h200`). Inductor keeps Triton's launcher
    for a kernel its static launcher cannot take. Left alone where the user set the variable. Sets the variable
    (compile workers read it when they start) and the config of this process. Returns whether it set them."""
    if STATIC_USER_KERNELS in os.environ:
        return False
    import torch._inductor.config as inductor_config
    if not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"):  # an older torch
        return False
    os.environ[STATIC_USER_KERNELS] = "1"
    inductor_config.static_launch_user_defined_triton_kernels = True
    return True
