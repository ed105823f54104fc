"""Cross entropy over vocabulary-sharded logits.

Never gathers the logits: each rank reduces its own vocabulary slice per row to (max, sum of exp,
target logit), two small all-reduces over TP combine them into the exact log-sum-exp, and backward is
softmax - onehot on each rank's own slice, recomputed from the saved logits. On CUDA both passes are
fused Triton kernels that read the logits in their own dtype (kernels/cross_entropy.py); elsewhere the
torch references below (same signatures) run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import cross_entropy as ce_kernels
from .mappings import group_rank, group_size


def row_stats_reference(x: torch.Tensor, target: torch.Tensor, valid: int):
    """-> (m, s, t), fp32 [rows]: max of the first `valid` logits of each row (-inf if none), sum of
    exp(x - m) over them, and x[row, target] where 0 <= target < valid (else 0).
    One fp32 copy of the logits, worked on in place (the eager path's cost: also --no-cross-entropy-loss-fusion)."""
    rows = x.shape[0]
    if valid == 0:
        return (torch.full((rows,), float("-inf"), device=x.device), torch.zeros(rows, device=x.device),
                torch.zeros(rows, device=x.device))
    xf = x[:, :valid].to(torch.float32, copy=True)
    m = xf.max(dim=-1).values
    inside = (target >= 0) & (target < valid)
    t = xf.gather(-1, target.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1).masked_fill_(~inside, 0.0)
    s = xf.sub_(m.unsqueeze(-1)).exp_().sum(dim=-1)
    return m, s, t


def softmax_grad_reference(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, valid: int,
                           grad_loss: torch.Tensor) -> torch.Tensor:
    """(softmax - onehot(target)) * grad_loss over the first `valid` columns, 0 past them; x's dtype.
    One fp32 copy worked on in place, the one-hot subtracted by a scatter (no host synchronization)."""
    p = x.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()
    p[:, valid:] = 0.0
    inside = ((target >= 0) & (target < valid)).to(p.dtype)
    p.scatter_add_(-1, target.clamp(0, max(valid - 1, 0)).unsqueeze(-1), -inside.unsqueeze(-1))
    return p.mul_(grad_loss.unsqueeze(-1)).to(x.dtype)


def _use_kernels(x: torch.Tensor, fused: bool = True) -> bool:
    return fused and x.is_cuda and ce_kernels.available()


def row_stats(x: torch.Tensor, target: torch.Tensor, valid: int, fused: bool = True):
    return (ce_kernels.row_stats if _use_kernels(x, fused) else row_stats_reference)(x, target, valid)


def softmax_grad(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, valid: int,
                 grad_loss: torch.Tensor, fused: bool = True) -> torch.Tensor:
    kernel = ce_kernels.softmax_grad if _use_kernels(x, fused) else softmax_grad_reference
    return kernel(x, lse, target, valid, grad_loss)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, vocab_size, fused: bool):
        tp = group_size(group)
        vocab_local = logits.shape[-1]
        start = group_rank(group) * vocab_local
        # Padded vocabulary entries take no probability mass: the loss equals the unpadded one.
        valid = vocab_local if vocab_size is None else min(max(vocab_size - start, 0), vocab_local)
        x = logits.reshape(-1, vocab_local)
        if x.stride(-1) != 1:
            x = x.contiguous()
        local_target = (target.reshape(-1).to(torch.int64) - start).contiguous()
        m, s, t = row_stats(x, local_target, valid, fused)
        if tp > 1:
            row_max = m.clone()
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            # Each slice's sum of exp rescaled to the global max (a slice without columns adds 0).
            s = torch.where(m == float("-inf"), torch.zeros_like(s), s * torch.exp(m - row_max))  # NaN stays NaN
            both = torch.stack([t, s])
            dist.all_reduce(both, group=group)  # target logit (one rank holds it) and sum of exp in one message
            t, s = both[0], both[1]
            m = row_max
        log_s = s.log()
        ctx.save_for_backward(x, local_target, m + log_s)
        ctx.valid, ctx.shape, ctx.fused = valid, logits.shape, fused
        # log s + (m - t): the loss without the rounding of m + log s (small losses of large logits).
        # A target outside [0, vocab) adds no target term (such tokens are for the loss mask to drop).
        return (log_s + (m - t)).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        x, local_target, lse = ctx.saved_tensors
        g = softmax_grad(x, lse, local_target, ctx.valid, grad_loss.reshape(-1).float().contiguous(), ctx.fused)
        return g.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size: int | None = None, fused: bool = True) -> torch.Tensor:
    """Per-token loss [...] from logits [..., padded_vocab/tp] (fp32 math) and global target ids [...].

    `vocab_size` (unpadded) excludes the padding columns from the softmax. `fused`: the Triton kernels
    where they run (CUDA); False: the torch references (--no-cross-entropy-loss-fusion).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, fused)
