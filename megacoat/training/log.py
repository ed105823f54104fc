"""Console (Megatron's iteration line), JSON-lines and Weights & Biases logging.

Printed by the last rank, as Megatron does (it holds the loss under pipeline parallelism).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Optional

import torch

from ..config import MegacoatConfig
from ..parallel.context import ParallelContext
from .throughput import peak_memory_gib


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IterationLogger:
    def __init__(self, cfg: MegacoatConfig, ctx: ParallelContext, device, precision: str,
                 peak_tflops: Optional[float], stream):
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.precision, self.peak = precision, peak_tflops
        self.stream = stream
        self.enabled = ctx.is_last_rank
        self._losses, self._norms, self._bytes = [], [], {}
        self._pending = []
        self._t0 = None
        self._iters_in_interval = 0
        self._skipped_in_interval = 0
        self._nan_in_interval = 0
        self.wandb = None
        if self.enabled and cfg.logging.wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--wandb-project needs the wandb package: pip install 'megacoat[wandb]'") from e
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_exp_name,
                                    config=cfg.to_dict())
        self.json_file = open(cfg.logging.log_json, "a") if (self.enabled and cfg.logging.log_json) else None

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=self.stream, flush=True)

    def start(self) -> None:
        _sync(self.device)
        self._t0 = time.perf_counter()

    def record_step(self, rec, comm_bytes: dict) -> None:
        self._pending.append(rec)  # resolved at the next log: no host-device sync per step
        for k, v in comm_bytes.items():
            self._bytes[k] = self._bytes.get(k, 0) + v
        self._last = rec

    def _resolve_pending(self, state) -> None:
        for rec in self._pending:
            self._iters_in_interval += 1
            if rec.skipped:
                self._skipped_in_interval += 1
                nan = math.isnan(rec.grad_norm)
                self._nan_in_interval += int(nan)
                state.skipped_iters += 1
                state.nan_iters += int(nan)
            else:
                self._losses.append(rec.loss)
                self._norms.append(rec.grad_norm)
        self._pending = []

    def maybe_log(self, state, flops_per_iter: float, force: bool = False) -> None:
        it = state.iteration
        if not force and it % self.cfg.logging.log_interval and it != self.cfg.train.train_iters:
            return
        if not self._pending:
            return
        _sync(self.device)
        now = time.perf_counter()
        self._resolve_pending(state)
        n = max(self._iters_in_interval, 1)
        dt = (now - self._t0) / n
        t = self.cfg.train
        tokens_per_s = t.global_batch_size * self.cfg.model.seq_length / dt
        tflops = flops_per_iter / dt / self.ctx.world_size / 1e12
        loss = sum(self._losses) / len(self._losses) if self._losses else float("nan")
        norm = sum(self._norms) / len(self._norms) if self._norms else float("nan")
        mem = peak_memory_gib(self.device)
        comm = {k: v / n for k, v in self._bytes.items()}
        if self.enabled:
            parts = [
                f" iteration {it:8d}/{t.train_iters:8d}",
                f"consumed samples: {state.consumed_samples:12d}",
                f"elapsed time per iteration (ms): {dt * 1000:.1f}",
                f"learning rate: {self._last.lr:.6E}",
                f"global batch size: {t.global_batch_size:5d}",
                f"lm loss: {loss:.6E}",
                "loss scale: 1.0",
                f"grad norm: {norm:.3f}",
                f"number of skipped iterations: {self._skipped_in_interval:3d}",
                f"number of nan iterations: {self._nan_in_interval:3d}",
                f"throughput (tokens/s): {tokens_per_s:.0f}",
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}",
            ]
            if self.peak:
                parts.append(f"MFU: {100 * tflops / self.peak:.1f}% (of {self.peak:.0f} TFLOP/s {self.precision} peak)")
            mem_name = "peak allocated (GiB)" if self.device.type == "cuda" else "max RSS (GiB)"
            parts.append(f"{mem_name}: {mem:.2f}")
            if comm.get("grad") or comm.get("param"):
                parts.append(f"comm bytes/iter: grad {comm.get('grad', 0) / 2**20:.1f} MiB, "
                             f"param {comm.get('param', 0) / 2**20:.1f} MiB")
            print(" | ".join(parts) + " |", file=self.stream, flush=True)
            record = dict(iteration=it, consumed_samples=state.consumed_samples, time_per_iter_s=dt,
                          lr=self._last.lr, lm_loss=loss, grad_norm=norm, skipped=self._skipped_in_interval,
                          nan=self._nan_in_interval, tokens_per_s=tokens_per_s, tflops_per_gpu=tflops,
                          mfu=(tflops / self.peak if self.peak else None), peak_mem_gib=mem,
                          comm_bytes_per_iter=comm)
            if self.json_file:
                self.json_file.write(json.dumps(record) + "\n")
                self.json_file.flush()
            if self.wandb:
                self.wandb.log(record, step=it)
        self._losses, self._norms, self._bytes = [], [], {}
        self._iters_in_interval = self._skipped_in_interval = self._nan_in_interval = 0
        self._t0 = time.perf_counter()

    def log_eval(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        line = f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * (len(line) + 1)
        print(f"{bar}\n{line}\n{bar}", file=self.stream, flush=True)
        if self.json_file:
            self.json_file.write(json.dumps({"iteration": iteration, "valid_loss": loss}) + "\n")
            self.json_file.flush()
        if self.wandb:
            self.wandb.log({"valid_loss": loss}, step=iteration)
        self._t0 = time.perf_counter()  # evaluation time is not training time

    def finish(self) -> None:
        if self.json_file:
            self.json_file.close()
        if self.wandb:
            self.wandb.finish()


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
