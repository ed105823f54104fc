"""The training loop's checkpoint hooks: load at start, save at intervals and exits, async saves.

The trainer calls, in this order:
    apply_checkpoint_args(cfg)          before building anything (--use-checkpoint-args)
    ckpt = Checkpointer(cfg, ctx, log)
    ckpt.load(trainer)                  after model/optimizer/scheduler exist, before the data: resumes,
                                        then claims --save (a lock; no other run's checkpoints to overwrite)
    stop = ckpt.after_step(trainer)     after every step: saves when due; True: --exit-duration-in-mins
    ckpt.finish(trainer)                at the end: final save, waits for a background write, releases --save
    ckpt.release()                      when the run ends otherwise (an error): releases --save
It reads `trainer.{model, optimizer, scheduler, rng, state, ctx, cfg, tokenizer}` and nothing else.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..config import MegacoatConfig
from .collect import GROUP_SIZE, MODEL_KIND, OPTIM_PREFIX, collect_pieces, held_ranges
from .ownership import SaveDirLock, check_save_dir_is_ours, new_run_id
from .retention import prune_checkpoints
from .format import (METADATA_FILE, TOKENIZER_DIR, TRACKER_FILE, CheckpointError, complete_iterations,
                     copy_file_durably, foreign_format_hint, fsync_dir, resolve_checkpoint_dir)
from .layout import layout_of_parameter
from .reader import CheckpointReader
from .writer import (BackgroundWrite, HostSnapshot, RankSave, commit, piece_records, plan_offsets,
                     prepare_partial_dir, raise_if_any_failed, rank_file_path, write_pieces)

# Model flags that decide tensor shapes; a checkpoint only loads into a model with the same ones.
ARCHITECTURE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                      "kv_channels", "normalization", "position_embedding_type", "activation", "add_bias_linear",
                      "untie_embeddings_and_output_weights")
# Flags that change what the weights compute without changing their shapes (loading with other
# values would silently train a different function); rotary_base only matters with RoPE.
FUNCTION_FLAGS = ("norm_epsilon", "rotary_base")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _same_dir(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b)


def find_checkpoint(load: str, save: Optional[str], log: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The iteration directory to load; None when resuming into an empty --save directory. A directory
    with complete iter_* checkpoints but no tracker is never empty (resolve_checkpoint_dir)."""
    empty = not os.path.isdir(load) or not (os.path.exists(os.path.join(load, TRACKER_FILE))
                                            or os.path.exists(os.path.join(load, METADATA_FILE))
                                            or complete_iterations(load))
    if empty and _same_dir(load, save) and foreign_format_hint(load) is None:
        return None  # first launch of a run that saves and resumes from the same directory
    return resolve_checkpoint_dir(load, log)


def _print_on_rank0(msg: str) -> None:
    """apply_checkpoint_args' default log: rank 0 once torch.distributed runs, else every process (the trainer,
    which knows its rank earlier, passes its own)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def apply_checkpoint_args(cfg: MegacoatConfig, log: Callable[[str], None] = _print_on_rank0) -> None:
    """--use-checkpoint-args: take the architecture (and tokenizer, when unset) flags from the checkpoint."""
    c = cfg.checkpoint
    if not (c.use_checkpoint_args and c.load):
        return
    path = find_checkpoint(c.load, c.save, log)
    if path is None:
        return
    saved = CheckpointReader(path).config
    model = dict(saved.get("model", {}))
    if not model.get("group_query_attention", False):
        model["num_query_groups"] = None  # resolved to the head count, which the flag parser refuses without GQA
    for name, value in model.items():
        if getattr(cfg.model, name) != value:
            log(f"--use-checkpoint-args: {_flag(name)} {value} (was {getattr(cfg.model, name)})")
            setattr(cfg.model, name, value)
    for name in ("tokenizer_type", "tokenizer_model", "vocab_size", "vocab_file", "merge_file"):
        if getattr(cfg.data, name) is None and saved.get("data", {}).get(name) is not None:
            setattr(cfg.data, name, saved["data"][name])


def check_architecture(saved: dict, model_cfg, path: str) -> None:
    saved_model = saved.get("model", {})
    names = ARCHITECTURE_FLAGS + FUNCTION_FLAGS
    if model_cfg.position_embedding_type != "rope":
        names = tuple(k for k in names if k != "rotary_base")
    if model_cfg.position_embedding_type == "learned_absolute":  # the size of the position table
        names += ("max_position_embeddings",)
    diffs = [f"{_flag(k)}: checkpoint {saved_model[k]}, this run {getattr(model_cfg, k)}"
             for k in names if k in saved_model and saved_model[k] != getattr(model_cfg, k)]
    if diffs:
        raise CheckpointError(f"the checkpoint {path} was saved with other model flags:\n  " + "\n  ".join(diffs) +
                              "\npass the checkpoint's flags, or --use-checkpoint-args to take them from it")


def capture_rng(trainer) -> dict:
    dev = trainer.ctx.device
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
            "tracker": trainer.rng.state_dict()}


def restore_rng(trainer, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and trainer.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], trainer.ctx.device)
    trainer.rng.load_state_dict(state["tracker"])


def parallel_layout(ctx) -> dict:
    return {"world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size}


# ------------------------------------------------------------------------------ model/optim
def load_model_weights(reader: CheckpointReader, model: torch.nn.Module, tp_rank: int, tp_size: int,
                       keep: frozenset = frozenset()) -> None:
    """Every parameter from the checkpoint's model weights, resharded to this rank (cast to its dtype). Those
    whose id() is in `keep` keep their values: their weights are read (and checked) but not used."""
    # A pipeline stage holds some of the model; ModelChunks knows the names of every stage's.
    names = getattr(model, "all_parameter_names", None) or {p.global_name for p in model.parameters()}
    extra = sorted(set(reader.names()) - names)
    if extra:
        raise CheckpointError(f"{reader.path} holds tensors this model does not have ({', '.join(extra[:4])}"
                              f"{' ...' if len(extra) > 4 else ''}); the model flags differ from the saved ones")
    with torch.no_grad():
        for p in model.parameters():
            target = layout_of_parameter(p, tp_size, model.vocab_size)
            flat = p.detach().view(-1) if id(p) not in keep else torch.empty_like(p).view(-1)
            reader.read_into(MODEL_KIND, p.global_name, target, tp_rank, 0, flat.numel(), flat)


def load_optimizer_state(reader: CheckpointReader, model, optimizer, tp_rank: int, tp_size: int, log=None) -> None:
    """Masters, moments and codec states into this rank's ranges, whatever layout saved them.

    The saved state format loads as it is when it matches the optimizer's (at any DP size; FP8
    group statistics need the same TP layout). Otherwise (fp32 <-> bf16 <-> FP8 moments, or FP8
    moments across TP sizes) the moments are read as fp32 (FP8 dequantized) and the optimizer
    re-encodes them in its own format (`conversion_ranges`, `after_load`)."""
    ranges = optimizer.state_ranges()
    direct = [_loads_directly(reader, model, r, tp_size) for r in ranges]
    if all(direct):
        for r in ranges:
            _load_range(reader, model, r, tp_rank, tp_size)
        return
    convert = getattr(optimizer, "conversion_ranges", None)
    r = ranges[direct.index(False)]
    stored = sorted(reader.optimizer_states(r.param.global_name))
    if convert is None or not _convertible(stored):
        raise CheckpointError(f"optimizer state of {r.param.global_name}: the checkpoint holds {stored}, this "
                              f"optimizer {sorted({**r.tensors, **r.groups})}; the optimizer or its state format "
                              "differs from the saved one: use the same flags, or --no-load-optim to load weights only")
    with torch.no_grad():
        for r in convert():
            _load_converted(reader, model, optimizer, r, tp_rank, tp_size)
    if log is not None:
        log(f"optimizer states converted from the checkpoint's format ({', '.join(stored)}) to this run's "
            "(moments read as fp32, FP8 dequantized, then re-encoded)")


_MOMENTS = ("exp_avg", "exp_avg_sq")
_FP8_PARTS = (".fp8", ".scale", ".exponent", ".centre")  # codes per element; s, k, c per group


def _convertible(stored) -> bool:
    return "master" in stored and all(m in stored or all(m + x in stored for x in _FP8_PARTS) for m in _MOMENTS)


def _loads_directly(reader: CheckpointReader, model, r, tp_size: int) -> bool:
    name = r.param.global_name
    groups = getattr(r, "groups", {})
    if set(reader.optimizer_states(name)) != set(r.tensors) | set(groups):
        return False
    if any(reader.stored_dtype(OPTIM_PREFIX + k, name) != t.dtype for k, t in {**r.tensors, **groups}.items()):
        return False
    return not groups or reader.same_local_layout(name, layout_of_parameter(r.param, tp_size, model.vocab_size))


def _load_range(reader: CheckpointReader, model, r, tp_rank: int, tp_size: int) -> None:
    name = r.param.global_name
    target = layout_of_parameter(r.param, tp_size, model.vocab_size)
    with torch.no_grad():
        for state, view in r.tensors.items():
            reader.read_into(OPTIM_PREFIX + state, name, target, tp_rank, r.start, r.end, view)
        g0, g1 = r.start // GROUP_SIZE, -(-r.end // GROUP_SIZE)
        for state, view in getattr(r, "groups", {}).items():
            reader.read_groups(OPTIM_PREFIX + state, name, tp_rank, g0, g1, view)


def _load_converted(reader: CheckpointReader, model, optimizer, r, tp_rank: int, tp_size: int) -> None:
    """fp32 master and moments (r.tensors) from whatever the checkpoint holds."""
    name = r.param.global_name
    target = layout_of_parameter(r.param, tp_size, model.vocab_size)
    stored = set(reader.optimizer_states(name))
    for state, view in r.tensors.items():
        if state in stored:  # fp32 or bf16 per element (cast by read_into)
            reader.read_into(OPTIM_PREFIX + state, name, target, tp_rank, r.start, r.end, view)
            continue
        parts = []
        for i, x in enumerate(_FP8_PARTS):
            kind = OPTIM_PREFIX + state + x
            canon = reader.canonical(kind, name) if i == 0 else reader.canonical_per_element(kind, name, GROUP_SIZE)
            parts.append(target.local_from_canonical(canon, tp_rank).reshape(-1)[r.start: r.end])
        view.copy_(optimizer.dequantize_state(*parts))


def weights_that_are_masters(optimizer) -> frozenset:
    """id() of the parameters whose whole tensor is their fp32 master (one storage: no separate copy)."""
    return frozenset(id(r.param) for r in optimizer.state_ranges()
                     if "master" in r.tensors and r.start == 0 and r.end == r.param.numel()
                     and r.tensors["master"].data_ptr() == r.param.data_ptr())


def masters_from_weights(optimizer) -> None:
    """Weights-only load: the fp32 masters start from the loaded weights."""
    with torch.no_grad():
        for r in optimizer.state_ranges():
            if "master" in r.tensors:
                r.tensors["master"].copy_(r.param.detach().reshape(-1)[r.start:r.end])
    optimizer.after_load()


def copy_tokenizer(tokenizer, partial: str) -> dict:
    """A copy of the tokenizer model inside the checkpoint, so tools/generate.py needs nothing else."""
    info = {"type": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size}
    src = getattr(tokenizer, "model_file", None)
    if src and os.path.isfile(src):
        dst_dir = os.path.join(partial, TOKENIZER_DIR)
        os.makedirs(dst_dir, exist_ok=True)
        siblings = ("tokenizer_config.json", "special_tokens_map.json", "config.json")
        companions = list(getattr(tokenizer, "companion_files", ()))  # e.g. GPT-2 BPE's merges.txt
        for path in [src] + companions + [os.path.join(os.path.dirname(src), s) for s in siblings]:
            if os.path.isfile(path):
                copy_file_durably(path, os.path.join(dst_dir, os.path.basename(path)))
        fsync_dir(dst_dir)  # the directory entries too: the checkpoint is published right after
        info["file"] = os.path.join(TOKENIZER_DIR, os.path.basename(src))
        if companions:
            info["companion_files"] = [os.path.join(TOKENIZER_DIR, os.path.basename(c)) for c in companions]
    return {"tokenizer": info}


def point_at_tokenizer_copy(data, tokenizer, iter_dir: str) -> None:
    """Set the tokenizer flags of `data` (a DataConfig) to the copy copy_tokenizer makes inside `iter_dir`,
    so the checkpoint's saved flags name files that travel with it."""
    kind = type(tokenizer).__name__
    data.tokenizer_type = kind
    inside = os.path.join(os.path.abspath(iter_dir), TOKENIZER_DIR)
    if kind == "NullTokenizer":
        data.vocab_size = tokenizer.vocab_size - 1
    elif kind == "GPT2BPETokenizer":
        data.vocab_file = os.path.join(inside, os.path.basename(tokenizer.model_file))
        data.merge_file = os.path.join(inside, os.path.basename(tokenizer.merge_file))
    elif kind == "HuggingFaceTokenizer":
        data.tokenizer_model = inside
    else:
        data.tokenizer_model = os.path.join(inside, os.path.basename(tokenizer.model_file))


@dataclass
class _PendingSave:
    write: Optional[BackgroundWrite]
    mine: RankSave
    pieces: list
    offsets: List[int]
    file_name: str
    common: Optional[dict]
    metadata: Optional[dict]
    extra: Callable
    save_dir: str
    iteration: int


class Checkpointer:
    def __init__(self, cfg: MegacoatConfig, ctx, log: Callable[[str], None] = print,
                 start_time: Optional[float] = None):
        """`start_time` (time.time() units): when the job started, for --exit-duration-in-mins, which
        counts start-up work (imports, model build, data, loading) too. Default: now."""
        c = cfg.checkpoint  # flags checked by config.validate_config
        self.cfg, self.full_cfg, self.ctx, self.log = c, cfg, ctx, log
        self.start_time = time.time() if start_time is None else start_time
        self.snapshot = HostSnapshot()
        self.pending: Optional[_PendingSave] = None
        self.last_saved: Optional[int] = None
        self.last_stall_s = 0.0
        # Ownership of --save (ownership.py): a fresh id, or the loaded checkpoint's on resume.
        self.run_id = new_run_id()
        self.lock: Optional[SaveDirLock] = None
        self.own_iterations: set = set()  # this run's checkpoints in --save: the only ones retention deletes
        self.source: Optional[dict] = None  # where the weights came from (a converted Megatron checkpoint's layer spec)

    # ------------------------------------------------------------------------------- load
    def load(self, trainer) -> bool:
        """Resume from --load when it holds a checkpoint, then claim --save for this run (collective)."""
        c = self.cfg
        loaded, loaded_iteration = False, None
        if c.load:
            path = find_checkpoint(c.load, c.save, self.log)
            if path is None:
                self.log(f"no checkpoint in {c.load} yet: starting from scratch")
            else:
                t0 = time.time()
                reader = CheckpointReader(path)
                try:
                    self._load(reader, trainer)
                finally:
                    reader.close()
                loaded = True
                self.source = (reader.meta.get("extra") or {}).get("source")  # kept by every later save
                self.last_saved = trainer.state.iteration if not c.finetune else None
                if not c.finetune:  # a resumed run keeps its id; finetuning starts a new run
                    self.run_id = reader.meta.get("run_id") or self.run_id
                    loaded_iteration = reader.iteration
                self.log(f"loaded checkpoint {path} (iteration {reader.iteration}) in {time.time() - t0:.2f} s")
        if c.save:
            same = _same_dir(c.load, c.save)
            self._claim_save_dir(loaded_iteration if same else None, finetuned_here=same and loaded and c.finetune)
        return loaded

    def _claim_save_dir(self, resumed_at: Optional[int], finetuned_here: bool = False) -> None:
        """Rank 0 locks --save and checks that it holds no other run's checkpoints this run could
        overwrite; every rank raises the same error when either fails."""
        error = None
        if self.ctx.rank == 0:
            try:
                self.lock = SaveDirLock(self.cfg.save, self.run_id, self.log)
                found = check_save_dir_is_ours(self.cfg.save, self.run_id, resumed_at, finetuned_here)
                self.own_iterations = {it for it, rid in found.items() if rid == self.run_id or it == resumed_at}
            except CheckpointError as e:
                self.release()
                error = e
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise_if_any_failed(error, f"claiming --save {self.cfg.save}")
        elif error is not None:
            raise error

    def release(self) -> None:
        """Let other runs write --save (the end of this run, or its failure)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _load(self, reader: CheckpointReader, trainer) -> None:
        c, ctx = self.cfg, trainer.ctx
        check_architecture(reader.config, trainer.cfg.model, reader.path)
        saved_vocab = reader.meta.get("vocab_size")
        if saved_vocab is not None and saved_vocab != trainer.model.vocab_size:
            raise CheckpointError(f"the checkpoint {reader.path} has a vocabulary of {saved_vocab} but this run's "
                                  f"tokenizer has {trainer.model.vocab_size}; use the checkpoint's tokenizer flags")
        weights_only = c.finetune or c.no_load_optim or not reader.has_optimizer
        if weights_only:
            if not (c.finetune or c.no_load_optim):
                self.log(f"{reader.path} holds no optimizer state: loading weights only")
            load_model_weights(reader, trainer.model, ctx.tp_rank, ctx.tp_size)
            masters_from_weights(trainer.optimizer)
        else:
            load_optimizer_state(reader, trainer.model, trainer.optimizer, ctx.tp_rank, ctx.tp_size, self.log)
            trainer.optimizer.load_scalar_state(reader.common()["optimizer"])
            trainer.optimizer.after_load()
            # The saved weights themselves, not a rounding of the masters: under weight-difference
            # communication (qWD) they differ, and exact resume needs the ones training used. Weights that
            # are their own (fp32) masters keep the masters just loaded: from a bf16 run's checkpoint, its
            # weights are those masters rounded to bf16.
            load_model_weights(reader, trainer.model, ctx.tp_rank, ctx.tp_size,
                               keep=weights_that_are_masters(trainer.optimizer))
        if c.finetune:
            return
        common = reader.common()
        st = common["train_state"]
        for k in ("iteration", "consumed_samples", "skipped_iters", "nan_iters"):
            setattr(trainer.state, k, st[k])
        if not weights_only:
            trainer.scheduler.load_state_dict(common["scheduler"])
        elif c.no_load_optim:
            # As in Megatron-LM: the schedule is part of the optimizer state it skips.
            self.log(f"--no-load-optim: the optimizer state and the learning-rate schedule start fresh at iteration "
                     f"{st['iteration']} (the warm-up runs again); omit the flag to resume them")
        if not c.no_load_rng:
            if reader.meta.get("parallel") == parallel_layout(ctx) and ctx.rank in common["rng"]:
                restore_rng(trainer, common["rng"][ctx.rank])
            else:
                self.log("the parallel layout differs from the saved one: RNG states are not restored "
                         "(dropout masks after resume differ from an uninterrupted run)")

    # ------------------------------------------------------------------------------- save
    def after_step(self, trainer) -> bool:
        """Save when due; returns True when --exit-duration-in-mins has run out (after saving)."""
        c, it = self.cfg, trainer.state.iteration
        # The time check is a collective with a host sync: only at log iterations, where the
        # logger synchronises anyway, so ordinary steps never wait for the device.
        time_up = it % max(trainer.cfg.logging.log_interval, 1) == 0 and self._time_is_up()
        exit_interval = trainer.cfg.train.exit_interval
        due = (c.save_interval and it % c.save_interval == 0) or time_up or \
            (exit_interval and it % exit_interval == 0)
        if c.save and due:
            self.save(trainer)
        elif self.pending is not None and it % max(trainer.cfg.logging.log_interval, 1) == 0:
            self._maybe_finalize()
        if time_up:
            self.log(f"exiting at iteration {it}: --exit-duration-in-mins {c.exit_duration_in_mins} reached")
        return time_up

    def finish(self, trainer) -> None:
        if self.cfg.save and self.last_saved != trainer.state.iteration:
            self.save(trainer)
        self.wait()
        self.release()

    def save(self, trainer) -> None:
        t0 = time.time()
        self.wait()
        ctx, it = trainer.ctx, trainer.state.iteration
        save_dir = self.cfg.save
        partial = prepare_partial_dir(save_dir, it, ctx.rank)
        ranges = held_ranges(trainer.model, trainer.optimizer)
        layouts, dtypes, pieces = collect_pieces(ranges, ctx.tp_rank, ctx.tp_size, trainer.model.vocab_size)
        offsets, total = plan_offsets(pieces)
        path, file_name = rank_file_path(partial, ctx.rank)
        mine = RankSave(ctx.rank, {n: l.to_json() for n, l in layouts.items()}, dtypes, rng=capture_rng(trainer))
        common = metadata = None
        st = trainer.state
        st.resolve_counters()  # the skipped/NaN steps since the last log line count too
        if ctx.rank == 0:
            common = {"train_state": {"iteration": st.iteration, "consumed_samples": st.consumed_samples,
                                      "skipped_iters": st.skipped_iters, "nan_iters": st.nan_iters},
                      "scheduler": trainer.scheduler.state_dict(), "optimizer": trainer.optimizer.scalar_state()}
            metadata = {"config": trainer.cfg.to_dict(), "parallel": parallel_layout(ctx), "run_id": self.run_id,
                        "vocab_size": trainer.model.vocab_size, "padded_vocab_size": trainer.model.padded_vocab}
        source = {"source": self.source} if self.source else {}
        extra = lambda d, tok=trainer.tokenizer: {**copy_tokenizer(tok, d), **source}  # noqa: E731
        pending = _PendingSave(None, mine, pieces, offsets, file_name, common, metadata, extra, save_dir, it)
        if self.cfg.async_save:
            pending.pieces = self.snapshot.take(pieces, offsets, total)
            pending.write = BackgroundWrite(path, pending.pieces, offsets) if pieces else None
            self.pending = pending
            self.last_stall_s = time.time() - t0
            self.log(f"checkpoint iteration {it}: copied to host in {self.last_stall_s:.3f} s, writing in the background")
        else:
            crcs = []
            try:
                crcs = write_pieces(path, pieces, offsets) if pieces else []
            except OSError as e:
                mine.error = f"writing {path}: {e}"
            self._commit(pending, crcs)
            self.last_stall_s = time.time() - t0
            self.log(f"saved checkpoint iteration {it} to {save_dir} in {self.last_stall_s:.2f} s")
        self.last_saved = it

    def wait(self) -> None:
        """Finish a background save (collective: every rank calls it at the same point)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        crcs = []
        try:
            crcs = pending.write.result() if pending.write is not None else []
        except CheckpointError as e:
            pending.mine.error = str(e)
        self._commit(pending, crcs)
        self.log(f"checkpoint iteration {pending.iteration} committed")

    def _commit(self, pending: _PendingSave, crcs: List[int]) -> None:
        if pending.mine.error is None:
            pending.mine.records = piece_records(pending.pieces, pending.offsets, crcs, pending.file_name)
        commit(pending.save_dir, pending.iteration, pending.mine, pending.common, pending.metadata, pending.extra)
        self.own_iterations.add(pending.iteration)
        if self.cfg.save_retain and self.ctx.rank == 0:  # published (commit is collective): prune the oldest
            prune_checkpoints(pending.save_dir, self.cfg.save_retain, self.own_iterations, self.log)
            self.own_iterations.intersection_update(complete_iterations(pending.save_dir))

    def _maybe_finalize(self) -> None:
        """Commit a background save once every rank's write has finished (one tiny all-reduce)."""
        done = self.pending.write is None or self.pending.write.done()
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1 if done else 0], device=self.ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        if done:
            self.wait()

    def _time_is_up(self) -> bool:
        mins = self.cfg.exit_duration_in_mins
        if mins is None:
            return False
        up = (time.time() - self.start_time) / 60.0 > mins
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1 if up else 0], device=self.ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same iteration
            up = bool(flag.item())
        return up
