"""Build a model + optimizer at a given layout and compare it with the single-process full model."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megacoat.config import ModelConfig, OptimizerConfig, resolve_model_defaults
from megacoat.model.gpt import GPTModel, padded_vocab_size
from megacoat.model.transformer import LayerContext
from megacoat.optim.optimizer import MixedPrecisionAdamW
from megacoat.parallel.context import ParallelContext
from megacoat.parallel.layers import full_from_shards
from megacoat.parallel.random import seed_everything
from megacoat.model.loss import masked_mean_loss

VOCAB = 203  # deliberately not a multiple of anything: exercises vocabulary padding


def small_model_config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, attention_dropout=0.0,
                hidden_dropout=0.0, make_vocab_size_divisible_by=8)
    base.update(kw)
    m = ModelConfig(**base)
    resolve_model_defaults(m)
    return m


def build(m: ModelConfig, ctx: ParallelContext, sp: bool, seed: int = 11, lr: float = 1e-2, zero=None,
          dtype: torch.dtype = torch.float32, compile_layers: bool = False, fp8=None):
    """Model + optimizer; `zero` (a ZeroOptions) selects the distributed optimizer."""
    rng = seed_everything(seed, ctx.tp_rank, ctx.device)
    lc = LayerContext(ctx.tp_group, sp, rng, dtype, ctx.device, seed, fp8=fp8)
    model = GPTModel(m, lc, VOCAB, padded_vocab_size(VOCAB, m.make_vocab_size_divisible_by, ctx.tp_size),
                     compile_layers=compile_layers)
    # adam_eps large enough that near-zero gradients (pure round-off) are not blown up to full
    # lr-sized updates of random sign: the test checks parallel equivalence, not Adam at eps 1e-8.
    ocfg = OptimizerConfig(lr=lr, clip_grad=1.0, weight_decay=0.1, adam_eps=1e-5)
    if zero is not None:
        from megacoat.optim.distributed import DistributedOptimizer
        return model, DistributedOptimizer(model, ocfg, ctx, zero)
    opt = MixedPrecisionAdamW(model, ocfg, ctx)
    return model, opt


def batches(step: int, n_micro: int, mbs: int, seq: int):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n_micro):
        tokens = torch.randint(0, VOCAB, (mbs, seq + 1), generator=g)
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                        loss_mask=(torch.rand(mbs, seq, generator=g) > 0.1).float(),
                        position_ids=torch.arange(seq).unsqueeze(0).expand(mbs, seq)))
    return out


def run_step(model, opt, micro, n_micro: int):
    opt.zero_grad()
    total = 0.0
    device = next(model.parameters()).device
    for i, b in enumerate(micro):
        opt.start_micro_batch(is_last=i == len(micro) - 1)
        b = {k: v.to(device) for k, v in b.items()}
        loss = masked_mean_loss(model(b["tokens"], b["position_ids"], labels=b["labels"]), b["loss_mask"])
        (loss / n_micro).backward()
        total += loss.item() / n_micro
    return total


def full_weights(model, ctx: ParallelContext) -> dict:
    """Full-model weights by global name (TP shards gathered)."""
    out = {}
    for p in model.parameters():
        w = p.detach().clone()
        if p.tensor_model_parallel and ctx.tp_size > 1:
            parts = [torch.empty_like(w) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, w.contiguous(), group=ctx.tp_group)
            dim, sizes = p.shard_info
            w = full_from_shards(parts, dim, sizes)
        out[p.global_name] = trim_vocab(p.global_name, w)
    return out


def full_grads(model, ctx: ParallelContext) -> dict:
    """Full-model gradient of every parameter by global name (TP shards gathered)."""
    out = {}
    for p in model.parameters():
        g = p.main_grad.detach().clone()
        if p.tensor_model_parallel and ctx.tp_size > 1:
            parts = [torch.empty_like(g) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=ctx.tp_group)
            dim, sizes = p.shard_info
            g = full_from_shards(parts, dim, sizes)
        out[p.global_name] = g
    return out


def trim_vocab(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.startswith("embedding.word_embeddings") or name.startswith("output_layer"):
        return t[:VOCAB]
    return t
