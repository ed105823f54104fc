#!/usr/bin/env python
"""Pretrain a GPT model with megacoat.

    python pretrain_gpt.py                                  # small GPT on the built-in corpus
    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)
    srun --ntasks-per-node 8 python pretrain_gpt.py ...     # SLURM without torchrun: ranks from SLURM

`python pretrain_gpt.py --help` lists every flag.
"""
import os
import sys

from megacoat.config import ConfigError, parse_args
from megacoat.data import DataConfigError, TokenizerError
from megacoat.parallel.context import LaunchError
from megacoat.training.log import configure_library_logging
from megacoat.training.faults import TrainingStopped
from megacoat.training.trainer import pretrain


def main(argv=None) -> int:
    cfg = parse_args(argv)
    configure_library_logging()  # e.g. progress while the default corpus is built on first use
    try:
        if cfg.train.dry_run:  # plan only: no process group, no GPU, no data loading
            if os.environ.get("RANK", "0") != "0":  # started by a launcher: one plan is enough
                return 0
            from megacoat.data import build_tokenizer
            from megacoat.training.planner import dry_run
            dry_run(cfg, build_tokenizer(cfg.data).vocab_size, sys.stdout)
            return 0
        pretrain(cfg)
    except (ConfigError, DataConfigError, TokenizerError, LaunchError) as e:
        # Configuration errors are found identically by every rank: print them once, not once per rank.
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        # Every rank stops at the same step for the same reason: say it once.
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_gpt.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
