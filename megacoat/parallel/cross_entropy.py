"""Cross entropy over vocabulary-sharded logits.

Never gathers the logits: three all-reduces over TP (max, target logit, sum of exp) give the
exact loss; backward is softmax - onehot on each rank's own vocabulary slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, vocab_size):
        tp = group_size(group)
        vocab_local = logits.shape[-1]
        start = group_rank(group) * vocab_local
        valid_local = vocab_local if vocab_size is None else min(max(vocab_size - start, 0), vocab_local)
        if valid_local < vocab_local:
            # Padded vocabulary entries take no probability mass: the loss equals the unpadded one.
            logits = logits.float().clone()
            logits[..., valid_local:] = float("-inf")
        else:
            logits = logits.float()

        logits_max = logits.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= vocab_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp_()  # reuse the buffer: shifted is not needed after this
        sum_exp = exp.sum(dim=-1)
        if tp > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)  # target logit and sum of exp in one message
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # in place: the saved softmax is not used again
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss [...] from logits [..., padded_vocab/tp] (fp32 math) and global target ids [...].

    `vocab_size` (unpadded) excludes the padding columns from the softmax.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
