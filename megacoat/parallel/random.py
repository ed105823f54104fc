"""RNG streams for dropout under tensor parallelism, and layout-independent initialisation.

Two streams (Megatron's convention):
- the default (data-parallel) stream, seeded with `seed` on every rank: used where all TP
  ranks hold the same activations (dropout outside TP regions without sequence parallelism);
- the model-parallel stream, seeded with `seed + 2718 + tp_rank`: used where TP ranks hold
  different parts of a tensor (attention heads, sequence shards), so each part gets its own mask.
"""
from __future__ import annotations

import contextlib
import zlib

import torch

MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG states that can be swapped in around a region (`with tracker.fork(): ...`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        orig = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(self.device, orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel"):
        orig = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, orig)

    def state_dict(self) -> dict:
        return {k: v.clone() for k, v in self.states.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.states = {k: v.clone() for k, v in sd.items()}


def seed_everything(seed: int, tp_rank: int, device: torch.device) -> RNGTracker:
    """Seed the default stream and return a tracker holding the model-parallel stream."""
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    tracker = RNGTracker(device)
    tracker.add("model-parallel", seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator determined by (seed, global parameter name) only.

    Every rank that needs any part of a parameter draws the full tensor from this generator
    and keeps its slice, so the full weights are the same at any TP/PP/DP layout.
    """
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g
