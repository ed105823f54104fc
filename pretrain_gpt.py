#!/usr/bin/env python
"""Pretrain a GPT model with megacoat.

    python pretrain_gpt.py                                  # small GPT on the built-in corpus
    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (Megatron flags)

`python pretrain_gpt.py --help` lists every flag.
"""
import sys

from megacoat.config import ConfigError, parse_args
from megacoat.data import DataConfigError, TokenizerError
from megacoat.training.trainer import pretrain


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        pretrain(cfg)
    except (ConfigError, DataConfigError, TokenizerError) as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
