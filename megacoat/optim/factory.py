"""Choose the optimizer from the flags: non-sharded mixed-precision AdamW or the ZeRO optimizer."""
from __future__ import annotations

import torch
from torch import nn

from ..comm.base import CommStats
from ..comm.sdp4bit import build_comm
from ..config import MegacoatConfig
from ..parallel.context import ParallelContext
from .distributed import DistributedOptimizer, ZeroOptions
from .optimizer import MixedPrecisionAdamW

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # Megatron's default: max(40M, 1M x DP)


def build_optimizer(model: nn.Module, cfg: MegacoatConfig, ctx: ParallelContext, grad_dtype: torch.dtype):
    p = cfg.parallel
    bucket = p.ddp_bucket_size or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * ctx.dp_size)
    if not p.use_distributed_optimizer:
        return MixedPrecisionAdamW(model, cfg.optim, ctx, grad_dtype, bucket_size=bucket)
    opts = ZeroOptions(bucket_size=bucket, overlap_grad_reduce=p.overlap_grad_reduce,
                       overlap_param_gather=p.overlap_param_gather, grad_dtype=grad_dtype)
    comm = build_comm(cfg.comm, ctx, CommStats(), cfg.train.seed)  # None: plain reduce-scatter / all-gather
    return DistributedOptimizer(model, cfg.optim, ctx, opts, comm=comm)
