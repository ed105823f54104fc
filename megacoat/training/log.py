"""Console (Megatron's iteration line), JSON-lines and Weights & Biases logging.

Printed by the last rank, as Megatron does (it holds the loss under pipeline parallelism).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Optional

import torch

from ..checkpoint.format import write_file_atomic
from ..config import ConfigError, MegacoatConfig
from ..parallel.context import ParallelContext
from .throughput import peak_memory_gib
from .tracking import make_output_dir, tracker_for


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def configure_library_logging(stream=None, rank: int = 0) -> None:
    """Show megacoat's library messages (e.g. `megacoat.data` preparing the default corpus or
    dataset indices) on stderr. Called by entry points, not by the library: applications that
    embed megacoat keep their own logging setup. Every rank reads the same data and flags, so their
    progress and warnings repeat rank 0's: ranks other than 0 show errors only. Idempotent."""
    logger = logging.getLogger("megacoat")
    if not any(getattr(h, "megacoat_handler", False) for h in logger.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.megacoat_handler = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)


def skip_flags(success: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """[skipped, nan] of one step as a 0/1 int64 device tensor: a step is skipped when its
    gradient norm is not finite, and counts as a NaN iteration when that norm is NaN."""
    skipped = ~success.to(torch.bool)
    return torch.stack([skipped, skipped & torch.isnan(grad_norm.to(skipped.device))]).long()


def drop_json_records_after(path: str, iteration: int) -> None:
    """Remove the JSON-lines records of iterations > `iteration` (atomically: a crash leaves the
    old file or the new one). Lines that are not records of an iteration are kept."""
    if not os.path.exists(path):
        return
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                later = json.loads(line).get("iteration", 0) > iteration
            except (ValueError, AttributeError, TypeError):
                later = False
            if later:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return
    write_file_atomic(path, "".join(kept).encode())


def _check_json_log_path(path: str) -> None:
    """--log-json names a file: its directory is created if missing; a directory, or a path under a file, is
    refused naming the flag (open() failed after the model was built, with a traceback)."""
    if os.path.isdir(path):
        raise ConfigError(f"--log-json {path} is a directory: name a file in it, e.g. "
                          f"{os.path.join(path, 'log.jsonl')}")
    make_output_dir(os.path.dirname(os.path.abspath(path)), f"--log-json {path}")


class IterationLogger:
    def __init__(self, cfg: MegacoatConfig, ctx: ParallelContext, device, precision: str,
                 peak_tflops: Optional[float], stream):
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.precision, self.peak = precision, peak_tflops
        self.stream = stream
        self.enabled = ctx.is_last_rank
        self._bytes = {}
        self._sums = None  # device: steps' [loss, grad norm, successes, skipped, nan] since the last line
        self._steps = 0
        self._samples = 0  # samples of those steps (--rampup-batch-size: not steps x --global-batch-size)
        self._last_lr = 0.0
        self._t0 = None
        self.trackers = tracker_for(cfg, self.enabled)  # W&B / TensorBoard (logging rank only)
        self.json_file = None  # opened by start(), once the iteration to start from is known
        if self.enabled and cfg.logging.log_json:  # a bad path fails here, before training starts
            _check_json_log_path(cfg.logging.log_json)

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=self.stream, flush=True)

    def start(self, iteration: int = 0, resuming: bool = False) -> None:
        """Training starts (or resumes) after `iteration`. A resumed run (--load) first drops the
        --log-json records of iterations after it: they came from steps that are being redone."""
        if self.enabled and self.cfg.logging.log_json and self.json_file is None:
            path = self.cfg.logging.log_json
            try:
                if resuming:
                    drop_json_records_after(path, iteration)
                self.json_file = open(path, "a")
            except OSError as e:
                raise ConfigError(f"--log-json {path}: cannot write it ({e.strerror}); give a writable file") from None
        _sync(self.device)
        self._t0 = time.perf_counter()

    def record_step(self, rec, comm_bytes: dict, samples: Optional[int] = None) -> None:
        # Summed on the device and read at the next log line: no host-device sync per step, and
        # nothing kept per step.
        ok = rec.success_t.to(self.device, torch.bool)
        loss = rec.loss_t.to(self.device, torch.float64)
        norm = rec.grad_norm_t.to(self.device, torch.float64)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        step = torch.cat([torch.stack([torch.where(ok, loss, zero), torch.where(ok, norm, zero), ok.double()]),
                          skip_flags(ok, norm).double()])
        self._sums = step if self._sums is None else self._sums + step
        self._steps += 1
        self._samples += self.cfg.train.global_batch_size if samples is None else samples
        for k, v in comm_bytes.items():
            self._bytes[k] = self._bytes.get(k, 0) + v
        self._last_lr = rec.lr

    def maybe_log(self, state, flops_per_iter: float, force: bool = False) -> None:
        it = state.iteration
        if not force and it % self.cfg.logging.log_interval and it != self.cfg.train.train_iters:
            return
        if not self._steps:
            return
        _sync(self.device)
        now = time.perf_counter()
        loss_sum, norm_sum, good, skipped, nan = self._sums.tolist()
        skipped, nan = int(skipped), int(nan)
        n = self._steps
        dt = (now - self._t0) / n
        t = self.cfg.train
        gbs = self._samples / n  # mean global batch of the interval
        tokens_per_s = gbs * self.cfg.model.seq_length / dt
        tflops = flops_per_iter * (gbs / t.global_batch_size) / dt / self.ctx.world_size / 1e12
        loss = loss_sum / good if good else float("nan")
        norm = norm_sum / good if good else float("nan")
        mem = peak_memory_gib(self.device)
        comm = {k: v / n for k, v in self._bytes.items()}
        if self.enabled:
            parts = [
                f" iteration {it:8d}/{t.train_iters:8d}",
                f"consumed samples: {state.consumed_samples:12d}",
                f"elapsed time per iteration (ms): {dt * 1000:.1f}",
                f"learning rate: {self._last_lr:.6E}",
                f"global batch size: {round(gbs):5d}",
                f"lm loss: {loss:.6E}",
                "loss scale: 1.0",
                f"grad norm: {norm:.3f}",
                f"number of skipped iterations: {skipped:3d}",
                f"number of nan iterations: {nan:3d}",
                f"throughput (tokens/s): {tokens_per_s:.0f}",
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}",
            ]
            if self.peak:
                parts.append(f"MFU: {100 * tflops / self.peak:.1f}% (of {self.peak:.0f} TFLOP/s {self.precision} peak)")
            elif self.precision.startswith("fp8"):  # no peak known (CPU): still say which FP8 recipe runs
                parts.append(f"precision: {self.precision}")
            mem_name = "peak allocated (GiB)" if self.device.type == "cuda" else "max RSS (GiB)"
            parts.append(f"{mem_name}: {mem:.2f}")
            if any(comm.values()):  # kinds: grad, param; SDP4Bit splits grad into grad_intra / grad_inter
                parts.append("comm bytes/iter: " + ", ".join(f"{k} {v / 2**20:.1f} MiB"
                                                            for k, v in comm.items() if v))
            print(" | ".join(parts) + " |", file=self.stream, flush=True)
            record = dict(iteration=it, consumed_samples=state.consumed_samples,
                          consumed_tokens=state.consumed_samples * self.cfg.model.seq_length, time_per_iter_s=dt,
                          lr=self._last_lr, lm_loss=loss, grad_norm=norm, skipped=skipped,
                          nan=nan, tokens_per_s=tokens_per_s, tflops_per_gpu=tflops,
                          mfu=(tflops / self.peak if self.peak else None), peak_mem_gib=mem,
                          comm_bytes_per_iter=comm)
            if self.json_file:
                self.json_file.write(json.dumps(record) + "\n")
                self.json_file.flush()
            if self.trackers:
                self.trackers.log(record, step=it)
        self._sums, self._steps, self._samples, self._bytes = None, 0, 0, {}
        self._t0 = time.perf_counter()

    def log_eval(self, iteration: int, loss: float, split: str = "valid") -> None:
        """An evaluation's loss; `split` "test": the test set's, evaluated once at the end (Megatron's line)."""
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        where = f"iteration {iteration}" + (" on test set" if split == "test" else "")
        line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * (len(line) + 1)
        print(f"{bar}\n{line}\n{bar}", file=self.stream, flush=True)
        if self.json_file:
            self.json_file.write(json.dumps({"iteration": iteration, f"{split}_loss": loss}) + "\n")
            self.json_file.flush()
        if self.trackers:
            self.trackers.log({f"{split}_loss": loss, f"{split}_ppl": ppl}, step=iteration)
        self._t0 = time.perf_counter()  # evaluation time is not training time

    def finish(self) -> None:
        if self.json_file:
            self.json_file.close()
        if self.trackers:
            self.trackers.finish()


def print_config(cfg: MegacoatConfig, ctx: ParallelContext, precision: str, device, model, padded_vocab: int,
                 vocab: int, memory: dict, logger: IterationLogger) -> None:
    """Megatron-style argument dump plus the layout, model size and model-state memory per parameter."""
    if not logger.enabled:
        return
    lines = ["------------------------ arguments ------------------------"]
    for section in dataclasses.fields(cfg):
        sec = getattr(cfg, section.name)
        for f in dataclasses.fields(sec):
            lines.append(f"  {f.name} {'.' * max(2, 44 - len(f.name))} {getattr(sec, f.name)}")
    lines.append("-------------------- end of arguments ---------------------")
    lines.append(f"> world size {ctx.world_size}: TP {ctx.tp_size} x PP {ctx.pp_size} x DP {ctx.dp_size} "
                 f"(ranks per node {ctx.ranks_per_node}); device {device}; precision {precision}")
    lines.append(f"> vocabulary {vocab} padded to {padded_vocab}; model parameters {model.num_parameters():,}")
    lines.append("> model-state memory per parameter on this rank (bytes): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in memory.items() if k != "params"))
    logger.info("\n".join(lines))
