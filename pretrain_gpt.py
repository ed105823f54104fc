#!/usr/bin/env python
"""Pretrain a GPT model with megacoat.

    python pretrain_gpt.py                                  # small GPT on the built-in corpus
    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)
    srun --ntasks-per-node 8 python pretrain_gpt.py ...     # SLURM without torchrun: ranks from SLURM

`python pretrain_gpt.py --help` lists every flag.
"""
import sys
import time

from megacoat.training.allocator import default_cuda_allocator_settings

# Before anything starts CUDA: the allocator's expandable segments, unless you configured it yourself.
default_cuda_allocator_settings()

from megacoat.config import ConfigError, parse_args_with_notes  # noqa: E402 (after the allocator setting)
from megacoat.data import DataConfigError, TokenizerError  # noqa: E402
from megacoat.parallel.launch_env import LaunchError, read_launch_env  # noqa: E402
from megacoat.training.log import configure_library_logging  # noqa: E402
from megacoat.training.faults import TrainingStopped  # noqa: E402
from megacoat.training.trainer import pretrain  # noqa: E402


# How long a rank other than 0 waits before reporting a configuration error itself (see report_config_error).
ERROR_GRACE_S = 5.0


def report_config_error(e: Exception, rank: int) -> None:
    """Configuration errors are found identically by every rank: rank 0 prints them, once. The others
    wait a little first: a launcher such as torchrun ends every process as soon as one exits, so a rank
    that exited at once could take rank 0's message with it. If the error is theirs alone (a file missing
    on one node), they print it after the wait, with their rank."""
    if rank != 0:
        time.sleep(ERROR_GRACE_S)
    print(f"pretrain_gpt.py: error: {e}" if rank == 0 else f"pretrain_gpt.py: error on rank {rank}: {e}",
          file=sys.stderr, flush=True)


def main(argv=None) -> int:
    cfg, notes = parse_args_with_notes(argv)
    rank = 0  # until the launcher's environment is read (an error there is reported as rank 0's)
    try:
        launch = read_launch_env()  # torchrun's or SLURM's variables: read here only, passed on
        rank = launch.rank
        configure_library_logging(rank=rank)  # e.g. progress while the default corpus is built on first use
        if rank == 0:
            for note in notes:  # Megatron flags accepted without effect
                print(f"pretrain_gpt.py: note: {note}", file=sys.stderr, flush=True)
        if cfg.train.dry_run:  # plan only: no process group, no GPU, no data loading
            if rank != 0:  # started by a launcher: one plan is enough
                return 0
            from megacoat.data import build_tokenizer
            from megacoat.training.planner import dry_run
            dry_run(cfg, build_tokenizer(cfg.data).vocab_size, sys.stdout, launch.world_size)
            return 0
        pretrain(cfg, launch=launch)
    except (ConfigError, DataConfigError, TokenizerError, LaunchError) as e:
        report_config_error(e, rank)
        return 2
    except TrainingStopped as e:
        # Every rank stops at the same step for the same reason: say it once.
        if rank == 0:
            print(f"pretrain_gpt.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
