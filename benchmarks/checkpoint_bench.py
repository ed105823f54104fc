#!/usr/bin/env python
"""Checkpoint save/load time and throughput, and the training stall of --async-save.

Builds the model and optimizer through the Trainer (so the state is what training saves:
weights, fp32 masters, both Adam moments), runs `--steps` optimizer steps so the state is
non-trivial, then measures on this rank:
  sync save     time from save() call to committed checkpoint (tracker written), GB/s of files
  load          time to load into the same model/optimizer (resharding path not taken), GB/s
  async save    training stall (save() returning: host snapshot) and time until committed
Default model: Llama-style, ~1B parameters (18 layers, hidden 2048, vocab 32000).

    python benchmarks/checkpoint_bench.py --save-dir /tmp/ckbench                    # 1 GPU or CPU
    torchrun --nproc-per-node 8 benchmarks/checkpoint_bench.py --save-dir /tmp/ckbench -- --tensor-model-parallel-size 2
Anything after `--` is passed to the model/trainer flags (Megatron names).
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODEL_1B = ["--num-layers", "18", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "32000", "--micro-batch-size", "1"]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def sync_all(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, default=1, help="optimizer steps before measuring")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--small", action="store_true", help="a ~100M model instead of ~1B (CPU runs)")
    p.add_argument("--out", default=None, help="append one JSON record here")
    a, rest = p.parse_known_args()
    rest = [x for x in rest if x != "--"]
    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer
    model_flags = MODEL_1B if not a.small else ["--num-layers", "8", "--hidden-size", "768", "--num-attention-heads",
                                                "12", "--seq-length", "256", "--vocab-size", "32000",
                                                "--micro-batch-size", "1"]
    flags = model_flags + ["--mock-data", "--train-iters", str(a.steps + 1000), "--eval-interval", "0",
                           "--eval-iters", "0", "--log-interval", "1000", "--save", a.save_dir] + rest
    cfg = parse_args(flags)
    trainer = Trainer(cfg, log_stream=open(os.devnull, "w"))
    rank0 = trainer.ctx.rank == 0
    it = trainer.data_iterators().train
    for _ in range(a.steps):
        trainer.train_step(trainer._next_micro_batches(it))
    sync_all(trainer.device)
    ck = trainer.checkpointer
    if rank0:
        shutil.rmtree(a.save_dir, ignore_errors=True)
    sync_all(trainer.device)
    results = {"device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "cpu",
               "world_size": trainer.ctx.world_size, "tp": trainer.ctx.tp_size, "dp": trainer.ctx.dp_size,
               "params": trainer.model.num_parameters(), "flags": " ".join(flags), "save_s": [], "load_s": [],
               "async_stall_s": [], "async_total_s": []}
    for r in range(a.repeats):
        trainer.state.iteration += 1
        ck.cfg.async_save = False
        sync_all(trainer.device)
        t0 = time.time()
        ck.save(trainer)
        sync_all(trainer.device)
        results["save_s"].append(time.time() - t0)
        path = os.path.join(a.save_dir, f"iter_{trainer.state.iteration:07d}")
        results["bytes"] = dir_bytes(path) if rank0 else None
        ck.cfg.load = a.save_dir
        sync_all(trainer.device)
        t0 = time.time()
        ck.load(trainer)
        sync_all(trainer.device)
        results["load_s"].append(time.time() - t0)
        trainer.state.iteration += 1
        ck.cfg.async_save = True
        sync_all(trainer.device)
        t0 = time.time()
        ck.save(trainer)
        stall = time.time() - t0
        trainer.train_step(trainer._next_micro_batches(it))  # training goes on while the write runs
        ck.wait()
        sync_all(trainer.device)
        results["async_stall_s"].append(stall)
        results["async_total_s"].append(time.time() - t0)
        if rank0:  # keep the disk from filling: only the last checkpoint stays
            for d in os.listdir(a.save_dir):
                if d.startswith("iter_") and d != f"iter_{trainer.state.iteration:07d}":
                    shutil.rmtree(os.path.join(a.save_dir, d), ignore_errors=True)
    if rank0:
        gb = results["bytes"] / 1e9
        best = {k: min(results[k]) for k in ("save_s", "load_s", "async_stall_s", "async_total_s")}
        results.update(gb=gb, save_gbps=gb / best["save_s"], load_gbps=gb / best["load_s"], best=best)
        print(f"params {results['params'] / 1e9:.3f} B | checkpoint {gb:.2f} GB on {results['world_size']} rank(s) | "
              f"save {best['save_s']:.2f} s ({results['save_gbps']:.2f} GB/s) | load {best['load_s']:.2f} s "
              f"({results['load_gbps']:.2f} GB/s) | async stall {best['async_stall_s']:.3f} s, committed after "
              f"{best['async_total_s']:.2f} s | device {results['device']}")
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(results) + "\n")
    trainer.close()


if __name__ == "__main__":
    main()
