"""Timing shared by the kernel benchmarks: median CUDA-event time of a callable, and the HBM bandwidth
the fractions are computed against."""
import torch

HBM_GBPS = 4300.0  # H200: ~4.3 TB/s of a device copy (the ceiling every "% of HBM" is against)


def timed(fn, iters: int, warmup: int = 3, reps: int = 1) -> float:
    """Median milliseconds of fn() over iters calls (CUDA events). reps > 1: each timed sample is reps calls back to
    back, divided by reps: for kernels shorter than their host launch, whose single launch onto an idle GPU would
    time the launch, not the kernel (in training the queue is full)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    times.sort()
    return times[len(times) // 2]


def sweep_tiles(tiles: dict, kernels: dict, grid, iters: int, reps: int = 1) -> dict:
    """Each kernels[name] (a callable) timed under every tile of `grid` and the current tiles[name] (a launcher's
    TILES table, set in place; restored after). -> {name: {"us": {"AxBxC": us}, "fastest": tile, "current": tile}}."""
    out, saved = {}, dict(tiles)
    try:
        for name, fn in kernels.items():
            us = {}
            for tile in sorted(set(grid) | {tuple(saved[name])}):
                tiles[name] = tile
                us["x".join(map(str, tile))] = round(timed(fn, iters, reps=reps) * 1e3, 1)
            tiles[name] = saved[name]
            best = min(us, key=us.get)
            current = "x".join(map(str, saved[name]))
            out[name] = dict(us=us, fastest=best, current=current)
            print(f"  {name}: fastest {best} {us[best]} us; current {current} {us[current]} us", flush=True)
    finally:
        tiles.update(saved)
    return out
