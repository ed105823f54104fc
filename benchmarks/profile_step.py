"""Profile a few training steps of pretrain_gpt.py's configuration: where does the time go?

    python benchmarks/profile_step.py <pretrain_gpt.py flags> [--profile-steps 3]

Runs warm-up steps, then profiles steps with torch.profiler and prints the top CUDA kernels
(or CPU ops) by total time, grouped into matmul / attention / optimizer / other.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from megacoat.config import parse_args
from megacoat.training.trainer import Trainer


def main():
    argv = sys.argv[1:]
    steps = 3
    if "--profile-steps" in argv:
        i = argv.index("--profile-steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
    cfg = parse_args(argv)
    tr = Trainer(cfg)
    it = tr.data_iterators().train
    for _ in range(5):
        tr.train_step(tr._next_micro_batches(it))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            tr.train_step(tr._next_micro_batches(it))
        if tr.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if tr.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))
    tr.close()


if __name__ == "__main__":
    main()
