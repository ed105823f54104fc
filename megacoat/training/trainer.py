"""The training loop: config -> context -> model -> optimizer -> data -> steps, logs, evaluation.

One loop for every method: precision, communication and optimizer variants are chosen by
flags and plug in behind `GPTModel` and the optimizer interface (`megacoat.optim.optimizer`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer, apply_checkpoint_args
from ..config import (ConfigError, MegacoatConfig, global_batch_size_at, num_microbatches,
                      steps_within_train_samples, validate_config)
from ..data import build_data_iterators, build_datasets, build_tokenizer, check_vocab_size
from ..kernels import triton_available
from ..model.flops import flops_per_token
from ..model.gpt import padded_vocab_size
from ..model.stages import build_model_chunks
from ..model.masks import block_causal_mask
from ..model.recompute import RecomputePlan
from ..model.transformer import LayerContext
from ..optim.factory import build_optimizer
from ..parallel.context import ParallelContext, init_distributed
from ..parallel.launch_env import LaunchEnv, read_launch_env
from ..parallel.mappings import all_reduce, group_size
from ..parallel.pipeline import PipelineSchedule
from ..parallel.random import seed_everything
from ..precision.linear import (Fp8WeightRefresher, allocate_fp8_weight_copies, fp8_weight_copy_bytes,
                               invalidate_fp8_weights)
from ..precision.recipe import resolve_precision
from .faults import ExitSignalHandler, SkipGuard, TrainingStopped
from .log import IterationLogger, print_config, skip_flags
from .allocator import default_cuda_allocator_settings
from .memory_advice import out_of_memory_message
from .planner import AUTO_FP8_COPIES_SHARE, LIVE, fp8_copies_fit, live_plan, peak_estimate
from .lr_schedule import build_lr_scheduler, step_lr
from .schedule import bubble_theory, install_embedding_grad_sync, run_micro_batches
from .throughput import default_peak_tflops


@dataclass
class StepRecord:
    """One optimizer step. The tensors may still be in flight on the device; the properties
    wait for them (the logger reads them once per log interval, not once per step)."""

    iteration: int
    lr: float
    loss_t: torch.Tensor
    grad_norm_t: torch.Tensor
    success_t: torch.Tensor

    @property
    def loss(self) -> float:
        return self.loss_t.item()

    @property
    def grad_norm(self) -> float:
        return self.grad_norm_t.item()

    @property
    def skipped(self) -> bool:
        return not bool(self.success_t.item())


@dataclass
class TrainState:
    """Where training stands. Holds no per-step records: a run of any length keeps O(1) state."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    # [skipped, nan] of the steps not yet counted above, on the device: counting them on the host
    # would wait for the GPU every step. resolve_counters() folds them in (checkpoints call it).
    _unresolved: Optional[torch.Tensor] = field(default=None, repr=False)

    def count_step(self, rec: "StepRecord") -> None:
        flags = skip_flags(rec.success_t, rec.grad_norm_t)
        self._unresolved = flags if self._unresolved is None else self._unresolved + flags

    def resolve_counters(self) -> None:
        """Add the device-side counts to skipped_iters / nan_iters (one host sync)."""
        if self._unresolved is None:
            return
        skipped, nan = (int(v) for v in self._unresolved.tolist())
        self.skipped_iters += skipped
        self.nan_iters += nan
        self._unresolved = None


_IMPORT_TIME = time.time()


def process_start_time() -> float:
    """When this process started (time.time() units), so that --exit-duration-in-mins counts the
    start-up work (imports, model build, data preparation, checkpoint load) as Megatron does.
    Linux: from /proc; elsewhere, or if /proc looks wrong: when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        start = boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME
    # btime has 1 s resolution; anything else (e.g. a container's time namespace) falls back.
    return start if _IMPORT_TIME - 86400 < start <= _IMPORT_TIME + 1 else _IMPORT_TIME


def consumed_valid_samples(cfg: MegacoatConfig, iteration: int) -> int:
    """Validation samples read by the evaluations of iterations 1..`iteration` (Megatron's rule):
    a resumed run continues the validation stream where an uninterrupted run would be."""
    t = cfg.train
    if not t.eval_interval:
        return 0
    return iteration // t.eval_interval * t.eval_iters * t.global_batch_size


def _to_device(batch: dict, device: torch.device) -> dict:
    # From pageable memory a "non-blocking" copy may make the host wait for the stream (the queued
    # step): staged through pinned memory (torch's caching host allocator) it is truly asynchronous.
    pin = device.type == "cuda"
    out = {k: ((v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)
               if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    if out.get("document_ids") is not None:  # --reset-attention-mask: build the mask where it is used
        out["attention_mask"] = block_causal_mask(out["document_ids"])
    return out


class Trainer:
    """Builds everything from a config and runs training. Tests use its pieces directly."""

    def __init__(self, cfg: MegacoatConfig, *, log_stream=None, launch: Optional[LaunchEnv] = None):
        """`launch`: this process's place in the job (pretrain_gpt.py reads it once); default: read here."""
        default_cuda_allocator_settings()  # library callers too (pretrain_gpt.py did it before its imports)
        launch = read_launch_env() if launch is None else launch
        # --use-checkpoint-args: architecture flags from the checkpoint in --load (said by rank 0)
        apply_checkpoint_args(cfg, log=_print_flushed if launch.rank == 0 else _say_nothing)
        validate_config(cfg, launch.world_size)  # before any allocation
        _check_backend(cfg)
        self.cfg = cfg
        self.device = init_distributed(launch, cfg.parallel.distributed_backend,
                                       cfg.parallel.distributed_timeout_minutes, cfg.train.use_cpu)
        self.ctx = ParallelContext.build(cfg.parallel.tensor_model_parallel_size,
                                         cfg.parallel.pipeline_model_parallel_size, self.device,
                                         cfg.parallel.ranks_per_node or launch.local_world_size,
                                         cfg.parallel.distributed_timeout_minutes,
                                         cfg.parallel.high_priority_stream_groups, two_level_dp=cfg.comm.sdp4bit)
        self._fp8_refresher = None  # remakes kept FP8 weight copies after each step (built on first use)
        self.recipe = resolve_precision(cfg.train, self.device, cfg.parallel.grad_reduce_in_bf16, cfg.precision,
                                        num_microbatches(cfg, self.ctx.dp_size), cfg.parallel.overlap_param_gather)
        # Dropout streams differ per pipeline stage (Megatron's seed + 100 x pp rank); weights are
        # drawn from (seed, parameter name) generators, so they do not depend on it.
        self.rng = seed_everything(cfg.train.seed + 100 * self.ctx.pp_rank, self.ctx.tp_rank, self.device)
        self.tokenizer = build_tokenizer(cfg.data)
        m = cfg.model
        self.padded_vocab = padded_vocab_size(self.tokenizer.vocab_size, m.make_vocab_size_divisible_by,
                                              self.ctx.tp_size)
        check_vocab_size(self.tokenizer.vocab_size, self.padded_vocab)
        # Before the model: empty training data (or data of another tokenizer) fails here, not at the first step.
        self.datasets = build_datasets(cfg, self.tokenizer)
        compile_layers = cfg.train.torch_compile
        if compile_layers is None:
            compile_layers = self.device.type == "cuda"
        rope_fusion = cfg.precision.rope_fusion  # default: where its kernels run
        if rope_fusion is None:
            rope_fusion = self.device.type == "cuda" and triton_available()
        lc = LayerContext(self.ctx.tp_group, cfg.parallel.sequence_parallel, self.rng, self.recipe.params_dtype,
                          self.device, cfg.train.seed,
                          gradient_accumulation_fusion=cfg.precision.gradient_accumulation_fusion,
                          cross_entropy_fusion=cfg.precision.cross_entropy_loss_fusion is not False,
                          rope_fusion=rope_fusion, fp8=self.recipe.fp8)
        # PP = 1: the GPTModel; PP > 1: this stage's model chunks (self.chunks) in one module.
        self.model, self.chunks = build_model_chunks(m, cfg.parallel, lc, self.ctx, self.tokenizer.vocab_size,
                                                     self.padded_vocab, compile_layers=compile_layers)
        apply_recompute(self.chunks, cfg)
        self.optimizer = build_optimizer(self.model, cfg, self.ctx, self.recipe.grad_dtype)
        install_embedding_grad_sync(self.chunks, self.optimizer, self.ctx)
        seq = m.seq_length // (self.ctx.tp_size if cfg.parallel.sequence_parallel else 1)
        self.schedule = PipelineSchedule.from_context(
            self.ctx, len(self.chunks), (seq, cfg.train.micro_batch_size, m.hidden_size), self.recipe.params_dtype,
            timing=cfg.logging.log_pipeline_bubble)
        self._bubble = [0.0, 0.0, 0]  # compute s, schedule s, steps (since the last log line)
        self.scheduler = build_lr_scheduler(cfg)
        self.num_micro = num_microbatches(cfg, self.ctx.dp_size)
        self.state = TrainState()
        self.flops_per_iter = flops_per_token(m, self.padded_vocab, m.seq_length) * \
            cfg.train.global_batch_size * m.seq_length
        peak = cfg.logging.peak_tflops or default_peak_tflops(self.device, self.recipe.name)
        self.logger = IterationLogger(cfg, self.ctx, self.device, self.recipe.log_name, peak,
                                      stream=log_stream or sys.stdout)
        self._fit_fp8_weight_copies()
        # Measured model-state memory (weights, kept FP8 weight copies, grads, masters, states) before any activation.
        allocate_fp8_weight_copies(self.model)
        self.setup_memory = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        self._iters = None
        # Checkpoints: resume now, before the data iterators are built from state.consumed_samples.
        self.checkpointer = Checkpointer(cfg, self.ctx, log=self.logger.info, start_time=process_start_time())
        self.checkpointer.load(self)
        self._count_steps_in_samples()
        self._cover_resumed_run()
        self.skip_guard = SkipGuard(cfg.train.max_skipped_iterations, self.device)
        self.exit_signal = ExitSignalHandler(self.device, timeout_minutes=cfg.parallel.distributed_timeout_minutes) \
            if cfg.train.exit_signal_handler else None

    def _fit_fp8_weight_copies(self) -> Optional[str]:
        """--fp8-weight-cache auto on a GPU: keep the FP8 weight copies only while the step's estimated peak with
        them (planner.peak_estimate of this rank's model and optimizer) fits the memory this process can have;
        else every linear casts per use, as under `none` (2 bytes less per linear weight element, ~1-2% slower).
        Before the first forward, so compiled layers trace the path taken. Decided per rank, reported for all
        (report_fp8_copies_dropped). Returns this rank's log line when it drops them."""
        fp8, cfg = self.recipe.fp8, self.cfg
        # The same answer on every rank (flags and device type), so either all ranks reach the report's collective or none.
        if not (fp8 is not None and fp8.cache_weights and cfg.precision.fp8_weight_cache == "auto"
                and self.device.type == "cuda"):
            return None
        plan = live_plan(cfg, self.ctx, self.model, self.chunks, self.optimizer, self.padded_vocab,
                         self.recipe.params_dtype, self.device)
        peak = peak_estimate(plan, LIVE, cfg.precision.fp8_recipe)
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = free + torch.cuda.memory_reserved(self.device)
        note = None
        if not fp8_copies_fit(peak, budget):
            freed = sum(c.cast_fp8_weights_per_use() for c in self.chunks)
            self.recipe = replace(self.recipe, fp8=replace(fp8, cache_weights=False))
            gib = 2 ** 30
            note = (f"> --fp8-weight-cache auto: FP8 weight copies not kept ({freed / gib:.2f} GiB): the step's "
                    f"estimated peak with them, {peak / gib:.2f} GiB, passes {AUTO_FP8_COPIES_SHARE:.0%} of the "
                    f"{budget / gib:.2f} GiB this process can use; each linear casts its weight per use "
                    f"(--fp8-weight-cache step keeps them anyway)")
        report_fp8_copies_dropped(note, self.device, self.logger.info)
        return note

    # ----------------------------------------------------------------------------------- data
    def _count_steps_in_samples(self) -> None:
        """--train-samples counts samples: a run resumed from a checkpoint of another --global-batch-size (or ramp)
        trains the whole steps left between the consumed samples and --train-samples. The steps validate_config
        counted from sample 0 would stop it too early (a larger batch) or train past the budget (a smaller one)."""
        t, st = self.cfg.train, self.state
        if t.train_samples is not None and st.consumed_samples:
            t.train_iters = st.iteration + steps_within_train_samples(self.cfg, st.consumed_samples)

    def _cover_resumed_run(self) -> None:
        """The train split is sized --train-iters x --global-batch-size; a run resumed from a checkpoint of a
        larger global batch has consumed more than its iterations account for, and needs the samples up to
        its last step: the train dataset is then built again, that long."""
        t, st = self.cfg.train, self.state
        needed = st.consumed_samples + max(t.train_iters - st.iteration, 0) * t.global_batch_size
        if len(self.datasets.train) < needed:
            self.datasets = build_datasets(self.cfg, self.tokenizer, train_samples=needed)

    def data_iterators(self):
        if self._iters is None:
            self._iters = build_data_iterators(self.cfg, self.tokenizer, self.ctx.dp_rank, self.ctx.dp_size,
                                               consumed_samples=self.state.consumed_samples,
                                               consumed_valid_samples=consumed_valid_samples(
                                                   self.cfg, self.state.iteration), datasets=self.datasets)
        return self._iters

    # ---------------------------------------------------------------------------------- steps
    def global_batch_size(self) -> int:
        """Samples of the next step (--rampup-batch-size grows it with the consumed samples)."""
        return global_batch_size_at(self.cfg, self.state.consumed_samples)

    def step_micro_batches(self) -> int:
        return self.global_batch_size() // (self.cfg.train.micro_batch_size * self.ctx.dp_size)

    def forward_backward(self, micro_batches) -> torch.Tensor:
        """Forward and backward over the step's micro-batches through the pipeline schedule (PP = 1:
        forward/backward per micro-batch); returns this rank's mean loss (device; 0 off the last stage)."""
        self.model.train()
        n = len(micro_batches)
        total = run_micro_batches(self.schedule, self.chunks, micro_batches, n,
                                  lambda b: _to_device(b, self.device), optimizer=self.optimizer)
        if self.schedule.timing and self.state.iteration > 0:  # the first step warms up (compilation)
            st = self.schedule.stats
            self._bubble = [self._bubble[0] + st.compute_s, self._bubble[1] + st.total_s, self._bubble[2] + 1]
        return total / n

    def train_step(self, micro_batches) -> StepRecord:
        self.optimizer.zero_grad()
        samples = len(micro_batches) * self.cfg.train.micro_batch_size * self.ctx.dp_size
        loss = self.forward_backward(micro_batches)
        lr = step_lr(self.scheduler, samples)
        result = self.optimizer.step(lr)
        if self.recipe.fp8 is not None:
            self._remake_fp8_weights()
        loss = self._dp_mean(loss)
        st = self.state
        st.iteration += 1
        st.consumed_samples += samples
        rec = StepRecord(st.iteration, lr, loss, result.grad_norm, result.success)
        st.count_step(rec)
        self.logger.record_step(rec, result.comm_bytes, samples)
        return rec

    def _remake_fp8_weights(self) -> None:
        """The weights changed: their FP8 copies are stale. With kept copies (--fp8-weight-cache)
        and the weights complete now (no parameter all-gather still overlapping the next forward), remake
        them all at once (two launches on the GPU: Fp8WeightRefresher), overlapping the optimizer kernels.
        Otherwise each layer remakes its own before its next use (GPTModel.forward)."""
        invalidate_fp8_weights(self.model)
        if self.recipe.fp8.cache_weights and getattr(self.model, "pre_module_hook", None) is None:
            if self._fp8_refresher is None:
                self._fp8_refresher = Fp8WeightRefresher(self.model)
            self._fp8_refresher()

    def _log_bubble(self) -> None:
        """--log-pipeline-bubble: per stage, the share of the schedule's wall time spent outside
        forward/backward compute, next to the ideal pipeline's (pp - 1) / (vp m + pp - 1).
        Collective over the PP group (every rank calls it at the same iterations)."""
        compute, total, n = self._bubble
        self._bubble = [0.0, 0.0, 0]
        mine = torch.tensor([compute / max(n, 1), total / max(n, 1)], dtype=torch.float64, device=self.device)
        stages = [mine]
        if self.ctx.pp_size > 1:
            stages = [torch.zeros_like(mine) for _ in range(self.ctx.pp_size)]
            dist.all_gather(stages, mine, group=self.ctx.pp_group)
        if n == 0 or not self.logger.enabled:
            return
        compute_ms = [1e3 * float(s[0]) for s in stages]
        total_ms = [1e3 * float(s[1]) for s in stages]
        bubble = [1.0 - c / t if t > 0 else 0.0 for c, t in zip(compute_ms, total_ms)]
        theory = bubble_theory(self.ctx.pp_size, self.num_micro, len(self.chunks))
        self.logger.info(f" pipeline bubble (iterations up to {self.state.iteration}, {n} timed, {self.num_micro} "
                         f"micro-batches): schedule ms/iter per stage {[round(t, 1) for t in total_ms]} | compute ms "
                         f"{[round(c, 1) for c in compute_ms]} | measured bubble "
                         f"{[round(b, 4) for b in bubble]} | theory (pp-1)/(vp*m+pp-1) {theory:.4f}")
        if self.logger.json_file:
            self.logger.json_file.write(json.dumps({
                "iteration": self.state.iteration, "pipeline_bubble": {
                    "pp": self.ctx.pp_size, "vp": len(self.chunks), "num_microbatches": self.num_micro,
                    "timed_iterations": n, "schedule_ms": total_ms, "compute_ms": compute_ms,
                    "measured": bubble, "theory": theory}}) + "\n")
            self.logger.json_file.flush()

    def _next_micro_batches(self, it, n: Optional[int] = None):
        return [next(it) for _ in range(self.num_micro if n is None else n)]

    @torch.no_grad()
    def evaluate(self, it, num_iters: int) -> float:
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for _ in range(num_iters):
            run_micro_batches(self.schedule, self.chunks, self._next_micro_batches(it), self.num_micro,
                              lambda b: _to_device(b, self.device), forward_only=True, total=total)
        total /= num_iters * self.num_micro
        self.model.train()
        return self._dp_mean(total).item()

    def _dp_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean of a device scalar over the data-parallel group (no host sync)."""
        if self.ctx.dp_size > 1:
            dist.all_reduce(t, group=self.ctx.dp_group)
            t /= self.ctx.dp_size
        return t

    def train(self, on_step: Optional[Callable[["Trainer", StepRecord], None]] = None) -> TrainState:
        try:
            return self._train(on_step)
        finally:  # the run is over, however it ended: another run (or a retry in this process) may take --save
            self.checkpointer.release()

    def _train(self, on_step) -> TrainState:
        cfg = self.cfg
        memory = self.optimizer.memory_report()
        copies = fp8_weight_copy_bytes(self.model)
        if copies:
            memory = {**memory, "fp8_weight_copies": copies / memory["params"]}
        if self.setup_memory is not None:
            memory["measured_total"] = self.setup_memory / memory["params"]
        print_config(cfg, self.ctx, self.recipe.description, self.device, self.model, self.padded_vocab,
                     self.tokenizer.vocab_size, memory, self.logger)
        iters = self.data_iterators()
        self.logger.start(self.state.iteration, resuming=bool(cfg.checkpoint.load))
        interrupted = False  # by the signal or the time limit: the job's remaining time is for the save alone
        while self.state.iteration < cfg.train.train_iters:
            try:
                rec = self.train_step(self._next_micro_batches(iters.train, self.step_micro_batches()))
            except torch.OutOfMemoryError as e:  # the same error and traceback, with what to change in this run
                e.args = (f"{e}\n\n" + out_of_memory_message(cfg, memory, self.ctx.dp_size, self.state.iteration),)
                raise
            self.logger.maybe_log(self.state, self.flops_per_iter)
            self._check_skips(rec)
            if self.schedule.timing and (self.state.iteration % cfg.logging.log_interval == 0
                                         or self.state.iteration == cfg.train.train_iters):
                self._log_bubble()
            if on_step is not None:
                on_step(self, rec)
            it = self.state.iteration
            if cfg.train.eval_interval and it % cfg.train.eval_interval == 0 and iters.valid is not None \
                    and it < cfg.train.train_iters:
                self.logger.log_eval(it, self.evaluate(iters.valid, cfg.train.eval_iters))
            if self.checkpointer.after_step(self):  # saves when due; True: --exit-duration-in-mins ran out
                interrupted = True
                break
            if self.exit_signal is not None and self.exit_signal.requested():
                self._save_and_exit_on_signal()
                interrupted = True
                break
            if cfg.train.exit_interval and it % cfg.train.exit_interval == 0:
                self.logger.maybe_log(self.state, self.flops_per_iter, force=True)
                self.logger.info(f"exiting at iteration {it} (--exit-interval {cfg.train.exit_interval})")
                break
        self.checkpointer.finish(self)  # final save; waits for a background (--async-save) write
        if iters.valid is not None and cfg.train.eval_iters > 0 and not interrupted:
            self.logger.log_eval(self.state.iteration, self.evaluate(iters.valid, cfg.train.eval_iters))
        finished = self.state.iteration >= cfg.train.train_iters  # not stopped early by an exit flag or signal
        if iters.test is not None and cfg.train.eval_iters > 0 and finished:  # Megatron's final test loss
            self.logger.log_eval(self.state.iteration, self.evaluate(iters.test, cfg.train.eval_iters), split="test")
        self.logger.finish()
        if self.exit_signal is not None:
            self.exit_signal.restore()
        return self.state

    def _check_skips(self, rec: StepRecord) -> None:
        """--max-skipped-iterations: stop (with an error) after N consecutive non-finite steps, the
        last checkpoint committed and untouched."""
        try:
            self.skip_guard.after_step(rec.success_t, self.state.iteration, self.checkpointer.last_saved)
        except TrainingStopped:
            self.logger.maybe_log(self.state, self.flops_per_iter, force=True)
            self.checkpointer.wait()  # a background save of a good state still commits
            self.logger.finish()
            raise

    def _save_and_exit_on_signal(self) -> None:
        it = self.state.iteration
        self.logger.maybe_log(self.state, self.flops_per_iter, force=True)
        if self.cfg.checkpoint.save and self.checkpointer.last_saved != it:
            self.checkpointer.save(self)
        elif not self.cfg.checkpoint.save:
            self.logger.info("--exit-signal-handler: no --save directory, so no checkpoint is written")
        self.logger.info(f"exiting at iteration {it}: received signal {int(self.exit_signal.signum)} "
                         "(--exit-signal-handler)")

    def close(self, failed: bool = False) -> None:
        """Leave the process group. After a failure this rank may be the only one that stopped while
        the others wait in a collective it will never join: a barrier would then hang until the
        timeout, so the group is aborted instead (the others fail on the broken connection, or are
        stopped by the launcher once this process exits with an error)."""
        if not dist.is_initialized():
            return
        if failed:
            abort_process_group()
            return
        dist.barrier()
        dist.destroy_process_group()


def _check_backend(cfg: MegacoatConfig) -> None:
    """NCCL runs on GPUs only: on the CPU, init_process_group fails with a traceback about device ids. (--use-cpu
    with nccl is refused by validate_config; here the run finds no GPU.)"""
    if cfg.parallel.distributed_backend == "nccl" and not cfg.train.use_cpu and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs GPUs, but this run is on the CPU (no GPU is visible): "
                          "use --distributed-backend gloo, or leave it at auto (nccl on GPUs, gloo on the CPU).")


def apply_recompute(chunks, cfg: MegacoatConfig) -> None:
    """--recompute-granularity: full marks each model chunk's recomputed layers (groups); selective
    marks every layer's attention core."""
    t = cfg.train
    for chunk in chunks:
        plan = RecomputePlan.from_flags(t.recompute_granularity, t.recompute_method, t.recompute_num_layers,
                                        len(chunk.layers))
        if plan is None:
            continue
        if plan.granularity == "selective":
            for layer in chunk.layers:
                layer.attention.recompute_core = True
        else:
            chunk.recompute_plan = plan


def abort_process_group() -> None:
    """Tear down the default group without waiting for any other rank."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)  # torch >= 2.6: aborts NCCL communicators
    try:
        if abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - we are already failing: the original error is what matters
        pass


def report_fp8_copies_dropped(note: Optional[str], device: torch.device, log: Callable[[str], None]) -> None:
    """The FP8 weight copies are decided per rank (pipeline stages hold different activations; stage 0 the most),
    and the logging rank is the last: it says how many ranks dropped theirs, with its own reason or that it kept
    its own. Collective over all ranks. `note`: this rank's line when it dropped them."""
    world = dist.group.WORLD if dist.is_initialized() else None
    n = int(all_reduce(torch.tensor([int(note is not None)], dtype=torch.int32, device=device), world).item())
    size = group_size(world)
    if n == 0:
        return
    if size == 1:
        log(note)
    elif note is not None:
        log(f"{note} [{n} of {size} ranks dropped theirs]")
    else:
        log(f"> --fp8-weight-cache auto: {n} of {size} ranks do not keep their FP8 weight copies (their step's "
            f"estimated peak with them would not fit); this rank keeps its own")


def _print_flushed(msg: str) -> None:
    print(msg, flush=True)


def _say_nothing(msg: str) -> None:
    pass


def pretrain(cfg: MegacoatConfig, launch: Optional[LaunchEnv] = None, **kwargs) -> TrainState:
    """Build a Trainer (`launch`: see Trainer) and train; `kwargs` go to Trainer.train."""
    trainer = Trainer(cfg, launch=launch)
    try:
        state = trainer.train(**kwargs)
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    return state
