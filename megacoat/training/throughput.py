"""Throughput, FLOP rate, MFU and memory figures for the iteration log."""
from __future__ import annotations

import resource
from typing import Optional

import torch

# Dense (no sparsity) peak of the format, per device, from NVIDIA's H100/H200 SXM datasheet.
HOPPER_PEAK_TFLOPS = {"bf16": 989.0, "fp32": 67.0, "fp8": 1979.0}


def default_peak_tflops(device: torch.device, precision: str) -> Optional[float]:
    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9:
        return HOPPER_PEAK_TFLOPS.get(precision)
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (GPU) or peak resident set size (CPU), GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
