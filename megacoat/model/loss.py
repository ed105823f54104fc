"""Reduction of per-token losses to the micro-batch loss."""
import torch


def masked_mean_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's micro-batch loss: mean over the tokens the mask keeps."""
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
