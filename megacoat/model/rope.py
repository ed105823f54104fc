"""Rotary position embeddings (the rotate-half layout used by Megatron and HF Llama)."""
from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables [max_pos, head_dim] in fp32; looks them up by position id."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device=None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        pos = torch.arange(max_positions, dtype=torch.float64, device=device)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Buffers, not parameters: recomputed from the config, never checkpointed.
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids [b, s] -> cos, sin shaped [s, b, 1, d] for [s, b, heads, d] tensors."""
        cos = self.cos[position_ids].transpose(0, 1).unsqueeze(2).to(dtype)
        sin = self.sin[position_ids].transpose(0, 1).unsqueeze(2).to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d]."""
    return x * cos + rotate_half(x) * sin
