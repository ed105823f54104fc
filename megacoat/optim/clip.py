"""Global gradient norm over all parallel groups, and clipping."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


def global_grad_norm(grads: List[torch.Tensor], counted: List[bool], mp_group, extra_group=None) -> torch.Tensor:
    """L2 norm of the full model's gradient, as a 0-dim fp32 tensor on every rank.

    `counted[i]` is False for a tensor-parallel duplicate on TP ranks other than 0, so that
    duplicated parameters (norms, biases of row-parallel layers) are counted once. The sum of
    squares is all-reduced over the model-parallel group (TP x PP); DP ranks already hold the
    same averaged gradient, except under ZeRO, where each holds a different slice: then
    `extra_group` (the DP group) sums the slices first.
    """
    mine = [g for g, c in zip(grads, counted) if c]
    device = grads[0].device if grads else torch.device("cpu")
    return norm_from_local_square_sum(local_square_sum(mine, device), mp_group, extra_group)


def local_norms(grads: List[torch.Tensor], device) -> torch.Tensor:
    """The L2 norm of each of `grads`, as a 1-D fp32 tensor ([0.] for an empty list)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    # fp32 accumulation and result straight from bf16 gradients: no full-size fp32 temporaries.
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))


def local_square_sum(grads: List[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of `grads` as a 0-dim fp32 tensor (0 for an empty list)."""
    return local_norms(grads, device).square().sum()


def norm_from_local_square_sum(sq: torch.Tensor, mp_group, extra_group=None) -> torch.Tensor:
    """Global L2 norm from this rank's sum of squares (summed over `extra_group`, then `mp_group`)."""
    for group in (extra_group, mp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Megatron's: scale = max_norm / (norm + 1e-6), applied only when below 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
