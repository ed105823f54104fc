"""Timing shared by the kernel benchmarks: median CUDA-event time of a callable, and the HBM bandwidth
the fractions are computed against."""
import torch

HBM_GBPS = 4300.0  # H200: ~4.3 TB/s of a device copy (the ceiling every "% of HBM" is against)


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over iters calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
