"""Launchers of the fused cross-entropy kernels (kernels/triton/cross_entropy.py). The references with
the same signatures, and the choice between them, are in megacoat/parallel/cross_entropy.py."""
from functools import lru_cache

import torch

from . import triton_available
from .fp8 import triton_cdiv

# (BLOCK, num_warps): 8 bf16 per thread per load, one 16-byte access. Fastest of the 12 tiles measured on
# an H200 for 8192 x 32000 bf16 (`benchmarks/cross_entropy_bench.py --tiles`):
# row_stats 310.9 us (2048x8: 317.1), softmax_grad 314.8 us (2048x8: 350.0).
TILES = {"row_stats": (1024, 4), "softmax_grad": (1024, 4)}


def available() -> bool:
    return triton_available()


@lru_cache(maxsize=None)
def _k():
    from .triton import cross_entropy
    return cross_entropy


def _check(x: torch.Tensor, target: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"cross-entropy kernels take [rows, vocab] logits with contiguous rows, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if target.shape != (x.shape[0],) or target.dtype != torch.int64 or not target.is_contiguous():
        raise ValueError(f"cross-entropy target: a contiguous int64 [{x.shape[0]}] tensor, got "
                         f"{target.dtype} {tuple(target.shape)}")


def row_stats(x: torch.Tensor, target: torch.Tensor, valid: int):
    """-> (m, s, t), fp32 [rows]: max of the first `valid` logits of each row, sum of exp(x - m) over
    them, and x[row, target] where 0 <= target < valid (else 0)."""
    _check(x, target)
    rows = x.shape[0]
    m, s, t = (torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(3))
    if rows:
        block, warps = TILES["row_stats"]
        _k().row_stats_kernel[(rows,)](x, target, m, s, t, x.shape[1], valid, x.stride(0), BLOCK=block,
                                       num_warps=warps)
    return m, s, t


def softmax_grad(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, valid: int,
                 grad_loss: torch.Tensor) -> torch.Tensor:
    """d loss / d x for loss = lse - x[target] per row, scaled by grad_loss [rows] (fp32): softmax minus
    the one-hot target over the first `valid` columns, 0 past them; in x's dtype."""
    _check(x, target)
    rows, vocab = x.shape
    g = torch.empty((rows, vocab), dtype=x.dtype, device=x.device)
    if rows and vocab:
        block, warps = TILES["softmax_grad"]
        grid = (rows * triton_cdiv(vocab, block),)
        _k().softmax_grad_kernel[grid](x, g, lse, target, grad_loss, vocab, valid, x.stride(0), g.stride(0),
                                       BLOCK=block, num_warps=warps)
    return g
