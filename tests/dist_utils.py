"""Run a function on N CPU processes over gloo (the test harness for parallel code)."""
from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, errq, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend == "fake":  # rank 0 alone, posing in a world of `world`: collectives do nothing
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:  # report any failure to the parent with its traceback
        errq.put((rank, traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    # Passed. Wait for the peers' last collectives, then leave without the interpreter's teardown:
    # gloo's worker threads and the tensors their finished work holds are destroyed there in an
    # unspecified order, which now and then aborts a process that has passed ("terminate called
    # without an active exception") and fails a test whose every assertion held.
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world: int, *args, backend: str = "gloo") -> None:
    """Call fn(rank, world, *args) in `world` processes; re-raise the first failure with its traceback.
    backend="fake": one process, rank 0 of a `world`-rank group whose collectives do nothing (torch's fake
    process group: the graphs compiled code builds for that world, without its peers)."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = free_port()
    ranks = range(1 if backend == "fake" else world)
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errq, backend)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            errors.append((-1, "timeout"))
    if errors or any(p.exitcode for p in procs):
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in zip(ranks, procs))
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors) or f"no traceback; exit codes {codes}"
        raise AssertionError(f"distributed test failed:\n{msg}")
