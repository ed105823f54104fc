"""One step's micro-batches through the pipeline schedule (any PP size, PP = 1 included).

The schedule (`megacoat.parallel.pipeline`) decides the order of forwards, backwards and
transfers; this module says what a forward is (data -> model chunk -> loss) and hooks the
optimizer in: `start_micro_batch(is_last)` before every backward, True for the last micro-batch
of each model chunk, so the ZeRO optimizer launches each bucket's gradient sync only once all its
gradients are final; and the tied word embedding of the first and last stage, whose gradients are
summed over the embedding group before the optimizer's own gradient sync.

Data: every stage reads the step's micro-batches (the PP ranks of one DP rank get the same
samples) and moves them to its device; the first stage uses tokens (and positions), the last
labels and the loss mask, every stage positions (RoPE) and masks (--reset-attention-mask). The
micro-batches are small next to activations, so this simplest scheme costs nothing measurable.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..model.loss import masked_mean_loss


def run_micro_batches(schedule, chunks: Sequence, micro_batches: Sequence[dict], num_micro: int,
                      to_device: Callable[[dict], dict], optimizer=None, forward_only: bool = False,
                      total: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run the schedule over `micro_batches`; returns the sum of their losses (a device scalar,
    zero on ranks without the last stage), added into `total` when given. Training backpropagates
    `loss / num_micro`."""
    if total is None:
        total = torch.zeros((), dtype=torch.float32, device=schedule.device)

    def forward_step(chunk: int, mb: int, hidden: Optional[torch.Tensor]):
        model = chunks[chunk]
        b = to_device(micro_batches[mb])
        tokens = b["tokens"] if model.pre_process else None
        if not model.post_process:
            return model(tokens, b["position_ids"], b.get("attention_mask"), hidden=hidden)
        per_token = model(tokens, b["position_ids"], b.get("attention_mask"), labels=b["labels"], hidden=hidden)
        loss = masked_mean_loss(per_token, b["loss_mask"])
        total.add_(loss.detach())
        return loss / num_micro

    def before_backward(chunk: int, mb: int, is_last: bool) -> None:
        optimizer.start_micro_batch(is_last=is_last)

    schedule.run(len(micro_batches), forward_step, before_backward if optimizer is not None else None,
                 forward_only=forward_only)
    return total


def tied_embedding_weights(chunks: Sequence) -> List[torch.nn.Parameter]:
    """The word embedding weights of this rank that have a tied twin on another pipeline stage."""
    out = []
    for c in chunks:
        if c.tied and c.embedding is not None and not (c.pre_process and c.post_process):
            out.append(c.embedding.weight)
    return out


def install_embedding_grad_sync(chunks: Sequence, optimizer, ctx) -> None:
    """Sum the gradients of the tied word embedding over the first and last stage (the embedding
    group) at the start of the optimizer step, before its data-parallel gradient sync."""
    params = tied_embedding_weights(chunks)
    if not params or ctx.embedding_group is None:
        return

    def all_reduce_embedding_grads(ps) -> None:
        for p in ps:
            dist.all_reduce(p.main_grad, group=ctx.embedding_group)

    optimizer.add_pre_sync_params(params, all_reduce_embedding_grads)


def bubble_theory(pp: int, m: int, vp: int = 1) -> float:
    """Idle fraction of an ideal pipeline step: (pp - 1) / (vp m + pp - 1) (vp = 1: 1F1B)."""
    return (pp - 1) / (vp * m + pp - 1)
