"""Where does peak GPU memory go? Record the allocator's history over training steps and list what is
alive at the peak, grouped by the code that allocated it.

    python benchmarks/memory_peak.py <pretrain_gpt.py flags> [--record-steps 2] [--out FILE]

The first step runs unrecorded (compilation, lazily created state). Memory allocated before the
recorded steps (weights, gradient buffer, masters, optimizer states: the model state) is reported as
one line; the rest of the peak is broken down by the innermost megacoat frame and the innermost frame.
"""
import json
import os
import sys
from collections import defaultdict

import torch

from megacoat.config import parse_args
from megacoat.training.trainer import Trainer


def _frame(f):
    return f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"


def _key(frames):
    inner = _frame(frames[0]) if frames else "?"
    ours = next((_frame(f) for f in frames if "/megacoat/" in f["filename"] and "benchmarks" not in f["filename"]), "")
    return f"{ours} <- {inner}" if ours and ours != inner else inner


def peak_breakdown(trace):
    """Replay alloc/free events: (peak delta, {group: bytes alive at the peak})."""
    cur = peak = 0
    peak_index = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            cur += e["size"]
            if cur > peak:
                peak, peak_index = cur, i
        elif e["action"] == "free_completed":
            cur -= e["size"]
    live = {}
    for e in trace[: peak_index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups = defaultdict(int)
    for e in live.values():
        groups[_key(e.get("frames", []))] += e["size"]
    return peak, groups


def main():
    argv = sys.argv[1:]
    steps, out = 2, None
    for flag in ("--record-steps", "--out"):
        if flag in argv:
            i = argv.index(flag)
            if flag == "--out":
                out = argv[i + 1]
            else:
                steps = int(argv[i + 1])
            del argv[i:i + 2]
    cfg = parse_args(argv)
    tr = Trainer(cfg)
    it = tr.data_iterators().train
    tr.train_step(tr._next_micro_batches(it))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    for _ in range(steps):
        tr.train_step(tr._next_micro_batches(it))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_total = torch.cuda.max_memory_allocated()
    trace = [e for dev in snap["device_traces"] for e in dev]
    peak, groups = peak_breakdown(trace)
    report = tr.optimizer.memory_report()
    gib = 2 ** 30
    lines = [f"max_memory_allocated {peak_total / gib:.2f} GiB; allocated before the recorded steps "
             f"(model state + persistent) {base / gib:.2f} GiB = {base / report['params']:.2f} bytes/param; "
             f"replayed peak above that {peak / gib:.2f} GiB",
             "optimizer memory_report (bytes/param): " + json.dumps({k: round(v, 3) for k, v in report.items()
                                                                      if k != 'params'})]
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"{v / gib:8.3f} GiB  {k}")
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(" ".join(sys.argv[1:]) + "\n" + text + "\n")
    tr.close()


if __name__ == "__main__":
    main()
