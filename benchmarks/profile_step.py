"""Profile a few training steps of pretrain_gpt.py's configuration: where does the time go?

    python benchmarks/profile_step.py <pretrain_gpt.py flags> [--profile-steps 3] [--host-profile] [--phase-times] [--guard-ab] [--lead-trace] [--no-profiler] [--by-shape] [--kernels]

Runs warm-up steps, then profiles steps with torch.profiler and prints the top CUDA kernels
(or CPU ops) by total time, and the GPU's busy time against the wall time per step: a step whose
kernels add up to much less than its wall time is waiting on the host (launch overhead, syncs).
`--host-profile` also runs the steps under cProfile and prints the Python functions (and the C++ calls
they make) that take the host's time: where a host-bound step spends it. `--phase-times` (GPU) times the
forward, backward and optimizer phases on the host and on the GPU, without the profiler's overhead.
`--guard-ab` times steps with dynamo's guard evaluation skipped between two plain runs (a host-time probe).
`--lead-trace` (GPU) follows steady-state steps without the profiler and without syncs: at every layer's forward
and backward and around the optimizer, how far the GPU trails the host; where that falls to ~0 the GPU waits
for launches (where a step that looks GPU-bound in the profiler loses its time).
`--kernels` (GPU) lists every kernel of the profiled steps grouped by name (count, time per step) and by duration:
how many kernels a step runs and how much of its time the short ones take (each also costs a launch gap).
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


def _take_flag(argv, name: str) -> bool:
    """Whether `name` (one of this script's own flags) is in argv; removed from it (the rest are pretrain_gpt.py's)."""
    if name in argv:
        argv.remove(name)
        return True
    return False


def print_phase_times(tr, it, steps: int) -> None:
    """Host and GPU time of each phase of a step (forward, backward, optimizer and the rest), without the
    profiler: CUDA events and the host clock at the same points, each step started on an idle GPU. At each
    boundary, "GPU behind" is how long after the host reached it the GPU did: near zero means the GPU had
    caught up with the host there (that phase waited on the host); large means the host ran ahead."""
    marks = []  # (name, host time, event) of the current step

    def mark(name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, time.perf_counter(), ev))

    hook = tr.model.register_forward_hook(lambda *_: mark("forward"))
    step = tr.optimizer.step

    def timed_step(*a, **k):
        mark("backward")
        return step(*a, **k)

    tr.optimizer.step = timed_step
    sums = {}
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            marks.clear()
            mark("start")
            tr.train_step(tr._next_micro_batches(it))
            mark("optimizer and rest")
            torch.cuda.synchronize()
            _, h0, e0 = marks[0]
            prev_h, prev_g = 0.0, 0.0
            for name, h, ev in marks[1:]:
                host, gpu = (h - h0) * 1e3, e0.elapsed_time(ev)
                acc = sums.setdefault(name, [0, 0.0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += host - prev_h
                acc[2] += gpu - prev_g
                acc[3] += gpu - host
                prev_h, prev_g = host, gpu
    finally:
        hook.remove()
        tr.optimizer.step = step
    print(f"phase times over {steps} steps (ms per occurrence; host = enqueueing, GPU = until its work was done):")
    for name, (n, host, gpu, behind) in sums.items():
        print(f"  {name:20s} x{n / steps:.0f}/step  host {host / n:7.2f}  GPU {gpu / n:7.2f}  GPU behind the host at its end "
              f"{behind / n:7.2f}")


def lead_trace(tr, it, steps: int) -> list:
    """Steady-state steps without the profiler and without a sync between them: at each layer's forward, each
    backward hook (a layer's or another module's backward starting) and around the optimizer step, how far
    the GPU trails the host: the time the GPU reached a CUDA event recorded there minus the time the host
    recorded it. Near zero means the GPU had run out of queued work there and waited for the host's launches.
    One synchronized step first (its marks are dropped): the GPU then starts level with the host, so the first
    traced step shows the ramp after a sync (what the step after each logging sync sees) and the later ones the
    steady state. Returns [(mark, mean lead ms, min lead ms, first step's lead ms)] in the order of a step's marks,
    the mean and min over the traced steps after the first (over the one traced step when `steps` is 1; pipeline
    parallelism: not traced)."""
    import megacoat.model.gpt as gpt
    model = tr.model
    if tr.ctx.pp_size > 1 or not hasattr(model, "layers"):
        raise SystemExit("--lead-trace traces one model chunk (no pipeline parallelism)")
    index = {id(layer): i for i, layer in enumerate(model.layers)}
    marks = []  # (step, name, host seconds, event)
    step_no = [0]

    def mark(name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((step_no[0], name, time.perf_counter(), ev))

    def label(modules):
        i = index.get(id(modules[0])) if modules else None
        return f"layer {i}" if i is not None else type(modules[0]).__name__ if modules else "?"

    real_group, real_hook, real_step = gpt.run_layer_group, model.pre_backward_hook, tr.optimizer.step

    def traced_group(group, *args, **kwargs):
        mark(f"forward {label(list(group))}")
        return real_group(group, *args, **kwargs)

    def traced_hook(modules):
        mark(f"backward {label(list(modules))}")
        return real_hook(modules) if real_hook is not None else None

    def traced_step(*args, **kwargs):
        mark("optimizer start")
        out = real_step(*args, **kwargs)
        mark("optimizer end")
        return out

    gpt.run_layer_group, tr.optimizer.step = traced_group, traced_step
    model.pre_backward_hook = traced_hook
    try:
        torch.cuda.synchronize()
        for s in range(steps + 1):
            step_no[0] = s
            mark("step start")
            tr.train_step(tr._next_micro_batches(it))
            if s == 0:
                torch.cuda.synchronize()  # level start for the traced steps
                marks.clear()
        torch.cuda.synchronize()
    finally:
        gpt.run_layer_group, tr.optimizer.step = real_group, real_step
        model.pre_backward_hook = real_hook
    _, _, h0, e0 = marks[0]
    leads, first = {}, {}
    for s, name, h, ev in marks:
        lead = e0.elapsed_time(ev) - (h - h0) * 1e3
        if s == 1:
            first.setdefault(name, lead)
        if s > 1 or steps == 1:
            leads.setdefault(name, []).append(lead)
    order = list(dict.fromkeys(name for s, name, _, _ in marks if s == steps))  # a hook may fire per output
    return [(name, sum(leads[name]) / len(leads[name]), min(leads[name]), first.get(name, float("nan")))
            for name in order]


def print_lead_trace(tr, it, steps: int) -> None:
    rows = lead_trace(tr, it, steps)
    steady = max(steps - 1, 1)
    print(f"lead trace (ms the GPU trails the host at each mark; near 0: the GPU waited for the host's launches there); "
          f"mean and min over {steady} steady step(s), and the first step after a sync:")
    for name, mean, low, first in rows:
        print(f"  {name:28s} mean {mean:8.2f}  min {low:8.2f}  after a sync {first:8.2f}"
              + ("  <- GPU waiting" if low < 0.2 else ""))
    starved = [name for name, _, low, _ in rows if low < 0.2]
    print(f"marks where the GPU waited for the host in steady steps: {len(starved)} of {len(rows)}"
          + (f" (first: {', '.join(starved[:6])})" if starved else ""))


def kernel_table(spans, steps: int):
    """spans: (start us, end us, name) of every kernel of `steps` steps. -> (rows, buckets): rows
    (name, kernels per step, ms per step, mean us) by total time; buckets (label, kernels per step, ms per step)
    by duration."""
    by_name = {}
    for s, e, name in spans:
        n, t = by_name.get(name, (0, 0.0))
        by_name[name] = (n + 1, t + (e - s))
    rows = sorted(((name, n / steps, t / 1e3 / steps, t / n) for name, (n, t) in by_name.items()),
                  key=lambda r: -r[2])
    edges = [(0, 5), (5, 20), (20, 100), (100, float("inf"))]
    buckets = []
    for lo, hi in edges:
        ds = [e - s for s, e, _ in spans if lo <= e - s < hi]
        label = f"{lo}-{hi} us" if hi != float("inf") else f">= {lo} us"
        buckets.append((label, len(ds) / steps, sum(ds) / 1e3 / steps))
    return rows, buckets


def print_kernels(prof, steps: int) -> None:
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    rows, buckets = kernel_table(spans, steps)
    print(f"kernels per step: {len(spans) / steps:.0f}; by duration: " + "; ".join(
        f"{label}: {n:.0f} kernels, {ms:.2f} ms" for label, n, ms in buckets))
    print(f"{'ms/step':>8} {'n/step':>7} {'mean us':>8}  kernel")
    for name, n, ms, mean in rows:
        print(f"{ms:8.3f} {n:7.1f} {mean:8.1f}  {name[:150]}")


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


def print_idle_by_thread(prof, steps: int, min_us: float = 5.0) -> None:
    """GPU idle time split by the host thread that launched the kernel ending each gap: the main thread
    (forward, optimizer) or autograd's device thread (backward). A thread whose kernels start right after
    their launch (small lag) and follow idle gaps is the one the GPU waits for. Matches each kernel to its
    launch through the CUDA runtime's correlation id."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        print("idle by thread: this torch's profiler does not expose kineto events")
        return
    launches, kernels, backward_threads = {}, [], set()
    for e in events:
        if e.device_type() == DeviceType.CUDA:
            kernels.append(e)
        else:
            name = e.name()
            if name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemsetAsync", "cudaMemcpyAsync")):
                launches[e.correlation_id()] = e
            elif name.startswith("autograd::engine::evaluate_function"):
                backward_threads.add(e.start_thread_id())
    kernels.sort(key=lambda e: e.start_ns())
    stats, end, unmatched = {}, None, 0
    for k in kernels:
        launch = launches.get(k.correlation_id()) or launches.get(k.linked_correlation_id())
        if launch is None:
            unmatched += 1
            end = max(end or 0, k.end_ns())
            continue
        tid = launch.start_thread_id()
        st = stats.setdefault(tid, {"kernels": 0, "idle_ns": 0, "gaps": 0, "lags": []})
        st["kernels"] += 1
        st["lags"].append(k.start_ns() - launch.start_ns())
        if end is not None and k.start_ns() - end >= min_us * 1e3:
            st["idle_ns"] += k.start_ns() - end
            st["gaps"] += 1
        end = k.end_ns() if end is None else max(end, k.end_ns())
    try:
        _explain_gaps(kernels, launches, events, steps)
    except Exception as exc:  # a diagnostic: never lose the rest of the report to it
        print(f"gap explanation failed: {exc!r}")
    print(f"GPU idle (gaps >= {min_us:.0f} us) by the host thread that launched the next kernel"
          f"{f' ({unmatched} kernels without a matched launch)' if unmatched else ''}:")
    for tid, st in sorted(stats.items(), key=lambda kv: -kv[1]["kernels"]):
        lags = sorted(st["lags"])
        role = "backward (autograd)" if tid in backward_threads else "main (forward, optimizer)"
        print(f"  thread {tid} {role}: {st['kernels'] / steps:.0f} kernels per step, idle {st['idle_ns'] / 1e6 / steps:.1f} ms "
              f"per step in {st['gaps'] / steps:.0f} gaps; launch-to-start lag median {lags[len(lags) // 2] / 1e3:.0f} us, "
              f"10th percentile {lags[len(lags) // 10] / 1e3:.0f} us")


def _explain_gaps(kernels, launches, events, steps: int, top: int = 15, min_us: float = 50.0) -> None:
    """For the largest GPU idle gaps: when the next kernel was launched (lag: launch to start; small = the GPU
    waited for this launch) and what the launching thread did between the previous kernel's launch and this
    one (its longest host events there: a sync, an allocation, Python work)."""
    by_thread = {}
    for e in events:
        if e.device_type() != DeviceType.CUDA and e.duration_ns() > 0:
            by_thread.setdefault(e.start_thread_id(), []).append(e)
    gaps, prev, end = [], None, None
    for k in kernels:
        if end is not None and k.start_ns() - end >= min_us * 1e3:
            gaps.append((k.start_ns() - end, prev, k))
        if end is None or k.end_ns() > end:
            end, prev = k.end_ns(), k
    # Host runtime calls that wait for the device or the allocator, per step: what drains the GPU's queue.
    waits = {}
    for e in events:
        n = e.name()
        if e.device_type() != DeviceType.CUDA and (("Synchronize" in n) or n.startswith(("cudaMalloc", "cudaFree", "cudaMemcpy ", "cudaHostAlloc"))
                                                   or n in ("cudaMemcpy", "aten::_local_scalar_dense", "aten::item")):
            c, t = waits.get(n, (0, 0))
            waits[n] = (c + 1, t + e.duration_ns())
    print("host calls that can drain the GPU queue (per step): " + (", ".join(
        f"{n} x{c / steps:.1f} {t / 1e6 / steps:.2f} ms" for n, (c, t) in sorted(waits.items(), key=lambda kv: -kv[1][1])) or "none"))
    print(f"largest GPU idle gaps with what the launching thread did before the next launch:")
    for g, before, k in sorted(gaps, key=lambda t: -t[0])[:top]:
        lk = launches.get(k.correlation_id()) or launches.get(k.linked_correlation_id())
        lb = before is not None and (launches.get(before.correlation_id()) or launches.get(before.linked_correlation_id()))
        if lk is None:
            print(f"  {g / 1e3:7.0f} us before {k.name()[:50]} (launch not found)")
            continue
        lo = lb.start_ns() if lb and lb.start_thread_id() == lk.start_thread_id() else lk.start_ns() - int(g)
        inside = [e for e in by_thread.get(lk.start_thread_id(), ())
                  if e.start_ns() >= lo and e.end_ns() <= lk.start_ns() and e is not lk]
        inside.sort(key=lambda e: -e.duration_ns())
        what = "; ".join(f"{e.name()[:40]} {e.duration_ns() / 1e3:.0f} us" for e in inside[:4])
        print(f"  {g / 1e3:7.0f} us before {k.name()[:40]} (lag {(k.start_ns() - lk.start_ns()) / 1e3:.0f} us, "
              f"{(lk.start_ns() - lo) / 1e3:.0f} us since the previous launch): {what}")


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
    host_profile = _take_flag(argv, "--host-profile")
    phase_times = _take_flag(argv, "--phase-times")
    guard_ab = _take_flag(argv, "--guard-ab")
    by_shape = _take_flag(argv, "--by-shape")  # also the ops grouped by input shapes (which copy, which sum is which)
    lead = _take_flag(argv, "--lead-trace")
    kernels = _take_flag(argv, "--kernels")
    use_profiler = not _take_flag(argv, "--no-profiler")  # --no-profiler: only the timings, no torch.profiler
    cfg = parse_args(argv)
    needed = 5 + steps * (1 + use_profiler + phase_times + host_profile + 3 * guard_ab + lead) + lead  # warm-up, plain, ...
    if cfg.train.train_iters is not None and cfg.train.train_iters < needed:
        raise SystemExit(f"profile_step.py runs {needed} steps here: pass --train-iters {needed} or more "
                         f"(the data iterator is sized by it)")
    tr = Trainer(cfg)
    it = tr.data_iterators().train
    for _ in range(5):
        tr.train_step(tr._next_micro_batches(it))
    if guard_ab:  # is host time a limit? the same steps with dynamo's guard evaluation skipped, in between
        a = _timed_steps(tr, it, steps)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            b = _timed_steps(tr, it, steps)
        c = _timed_steps(tr, it, steps)
        print(f"guard A/B/A over {steps} steps each: {a * 1e3:.1f} / {b * 1e3:.1f} (skip_guard_eval_unsafe) / "
              f"{c * 1e3:.1f} ms per step")
    plain = _timed_steps(tr, it, steps)  # the same steps without the profiler's overhead
    if phase_times and tr.device.type == "cuda":
        print_phase_times(tr, it, steps)
    if lead and tr.device.type == "cuda":
        print_lead_trace(tr, it, steps)
    if host_profile:
        print_host_profile(tr, it, steps)
    if not use_profiler:
        print(f"per step without the profiler: {plain * 1e3:.1f} ms")
        tr.close()
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts, record_shapes=by_shape) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            tr.train_step(tr._next_micro_batches(it))
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    key = "self_cuda_time_total" if tr.device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    print(averages.table(sort_by=key, row_limit=30, max_name_column_width=70))
    if by_shape:
        print("by input shapes:")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=40, max_name_column_width=40,
                                                                 max_shapes_column_width=90))
    if tr.device.type == "cuda":
        # Kernels only (device-type events, as the table's footer counts them): ops carry their kernels' time too.
        busy = sum(e.self_device_time_total for e in averages
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3 / steps  # us -> ms
        print(f"per step: wall {wall * 1e3:.1f} ms, GPU kernels {busy:.1f} ms ({100 * busy / (wall * 1e3):.0f}% busy; "
              f"profiler overhead included in the wall time); without the profiler {plain * 1e3:.1f} ms per step "
              f"({100 * busy / (plain * 1e3):.0f}% busy)")
        print_gaps(prof, steps)
        if kernels:
            print_kernels(prof, steps)
        print_idle_by_thread(prof, steps)
    tr.close()


if __name__ == "__main__":
    main()
