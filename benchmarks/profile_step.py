"""Profile a few training steps of pretrain_gpt.py's configuration: where does the time go?

    python benchmarks/profile_step.py <pretrain_gpt.py flags> [--profile-steps 3] [--host-profile]

Runs warm-up steps, then profiles steps with torch.profiler and prints the top CUDA kernels
(or CPU ops) by total time, and the GPU's busy time against the wall time per step: a step whose
kernels add up to much less than its wall time is waiting on the host (launch overhead, syncs).
`--host-profile` also runs the steps under cProfile and prints the Python functions (and the C++ calls
they make) that take the host's time: where a host-bound step spends it.
"""
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from megacoat.config import parse_args
from megacoat.training.trainer import Trainer


def _timed_steps(tr, it, steps: int) -> float:
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        tr.train_step(tr._next_micro_batches(it))
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def print_gaps(prof, steps: int, top: int = 12, min_us: float = 20.0) -> None:
    """Where the GPU idles: gaps between consecutive kernels (any stream), largest first, with the
    kernels on either side (a gap after a kernel is host work or a sync that the GPU waited for)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    gaps, end, last = [], None, None
    for s, e, name in spans:
        if end is not None and s - end >= min_us:
            gaps.append((s - end, last, name))
        if end is None or e > end:
            end, last = e, name
    total = sum(g for g, _, _ in gaps)
    print(f"GPU idle gaps >= {min_us:.0f} us: {len(gaps) / steps:.0f} per step, {total / 1e3 / steps:.1f} ms per step")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:8.2f} ms  after {before[:60]}  before {after[:60]}")
    # The same gaps summed per (kernel before, kernel after): many small gaps at one place in every layer
    # add up to more than the largest single ones.
    pairs = {}
    for g, before, after in gaps:
        n, t = pairs.get((before, after), (0, 0.0))
        pairs[(before, after)] = (n + 1, t + g)
    print("GPU idle per place (kernel before -> kernel after), largest total first:")
    for (before, after), (n, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / 1e3 / steps:8.2f} ms per step in {n / steps:5.1f} gaps  {before[:50]} -> {after[:50]}")


def print_host_profile(tr, it, steps: int, top: int = 40) -> None:
    """cProfile over `steps` steps: the functions with the most own host time (cProfile's overhead
    inflates pure-Python functions more than C++ calls; compare rows, not the total with the wall time)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    _timed_steps(tr, it, steps)
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats("megacoat", top)  # our functions, with what they call
    print(f"host profile over {steps} steps (cProfile, by own time):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:20000])


def main():
    argv = sys.argv[1:]
    steps = 3
    if "--profile-steps" in argv:
        i = argv.index("--profile-steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
    host_profile = "--host-profile" in argv
    if host_profile:
        argv.remove("--host-profile")
    cfg = parse_args(argv)
    tr = Trainer(cfg)
    it = tr.data_iterators().train
    for _ in range(5):
        tr.train_step(tr._next_micro_batches(it))
    plain = _timed_steps(tr, it, steps)  # the same steps without the profiler's overhead
    if host_profile:
        print_host_profile(tr, it, steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            tr.train_step(tr._next_micro_batches(it))
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    key = "self_cuda_time_total" if tr.device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    print(averages.table(sort_by=key, row_limit=30, max_name_column_width=70))
    if tr.device.type == "cuda":
        # Kernels only (device-type events, as the table's footer counts them): ops carry their kernels' time too.
        busy = sum(e.self_device_time_total for e in averages
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3 / steps  # us -> ms
        print(f"per step: wall {wall * 1e3:.1f} ms, GPU kernels {busy:.1f} ms ({100 * busy / (wall * 1e3):.0f}% busy; "
              f"profiler overhead included in the wall time); without the profiler {plain * 1e3:.1f} ms per step "
              f"({100 * busy / (plain * 1e3):.0f}% busy)")
        print_gaps(prof, steps)
    tr.close()


if __name__ == "__main__":
    main()
