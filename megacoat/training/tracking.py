"""Experiment trackers: Weights & Biases and TensorBoard, fed by the iteration logger.

Only the rank that prints the log line (the last rank) creates trackers, so each figure is
recorded once. Both are optional packages: asking for one that is not installed is a clear
error at start-up, not a crash at the first log line.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional

from ..config import ConfigError, MegacoatConfig


def flatten_metrics(record: dict, prefix: str = "") -> Dict[str, float]:
    """Numbers of a (nested) log record as flat 'a/b' keys; None, strings and the iteration are left out."""
    out = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_metrics(v, key + "/"))
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)) and k != "iteration":
            out[key] = v
    return out


class Trackers:
    """The trackers the flags ask for; `log` sends one record to each of them."""

    def __init__(self, cfg: MegacoatConfig):
        lg = cfg.logging
        self.wandb_run = None
        self.tb_writer = None
        if lg.wandb_project:
            self.wandb_run = _start_wandb(cfg)
        if lg.tensorboard_dir:
            self.tb_writer = _start_tensorboard(lg.tensorboard_dir, cfg)

    def log(self, record: dict, step: int) -> None:
        metrics = flatten_metrics(record)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.tb_writer is not None:
            for k, v in metrics.items():
                self.tb_writer.add_scalar(k, v, global_step=step)
            self.tb_writer.flush()

    def finish(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.tb_writer is not None:
            self.tb_writer.close()
            self.tb_writer = None


def make_output_dir(directory: str, flag: str) -> None:
    """Create an output directory of `flag` (a missing one is made, as Megatron's writers do); a path that
    cannot be a directory (a file, or under one) is refused naming the flag."""
    try:
        os.makedirs(directory or ".", exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{flag}: {directory} is a file, not a directory; choose another path") from None
    except OSError as e:
        raise ConfigError(f"{flag}: cannot create the directory {directory} ({e.strerror}: {e.filename}); give a "
                          "writable path") from None


def _start_wandb(cfg: MegacoatConfig):
    lg = cfg.logging
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("--wandb-project needs the wandb package: pip install wandb (or pip install "
                          "'megacoat[wandb]'); WANDB_MODE=offline logs without a network.") from e
    if lg.wandb_save_dir:
        make_output_dir(lg.wandb_save_dir, f"--wandb-save-dir {lg.wandb_save_dir}")
    # A run that saves checkpoints keeps one W&B run id across restarts (preemption, requeue), so a
    # resumed job continues its curves; W&B ignores the records of iterations it already has.
    kw = {}
    if cfg.checkpoint.save:
        kw = dict(id=wandb_run_id(cfg), resume="allow")
    # The resolved config (defaults filled in by validation) is the run's config.
    try:
        return wandb.init(project=lg.wandb_project, entity=lg.wandb_entity, name=lg.wandb_exp_name,
                          dir=lg.wandb_save_dir, config=cfg.to_dict(), **kw)
    except wandb.errors.Error as e:  # no API key, no network, an unknown entity: before the first step
        raise ConfigError(f"--wandb-project {lg.wandb_project}: W&B could not start a run ({e}); log in (wandb login "
                          "or WANDB_API_KEY), or log without a network with WANDB_MODE=offline, or drop "
                          "--wandb-project.") from None


def wandb_run_id(cfg: MegacoatConfig) -> str:
    """Stable id of a training run: its project, name and checkpoint directory."""
    key = "|".join([cfg.logging.wandb_project or "", cfg.logging.wandb_exp_name or "",
                    os.path.abspath(cfg.checkpoint.save or "")])
    return "megacoat-" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _start_tensorboard(log_dir: str, cfg: MegacoatConfig):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch.utils.tensorboard imports the tensorboard package
        raise ConfigError(f"--tensorboard-dir {log_dir} needs the tensorboard package: pip install tensorboard "
                          "(or drop --tensorboard-dir).") from e
    make_output_dir(log_dir, f"--tensorboard-dir {log_dir}")
    writer = SummaryWriter(log_dir=log_dir)
    writer.add_text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n```", 0)
    return writer


def tracker_for(cfg: MegacoatConfig, enabled: bool) -> Optional[Trackers]:
    """Trackers on the logging rank when any is asked for; None elsewhere."""
    lg = cfg.logging
    if not (lg.wandb_project or lg.wandb_entity or lg.wandb_save_dir or lg.tensorboard_dir):
        return None
    if not enabled:
        return None
    return Trackers(cfg)
