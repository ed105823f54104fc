"""Activation recomputation (Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers).

full: the chosen transformer layers keep only their input for backward and run their forward
again inside backward (uniform: every group of N consecutive layers is one recomputed unit;
block: the first N layers of each model chunk are recomputed one by one, the rest are not).
selective: only the attention core (QKV split, RoPE, SDPA) of every layer is recomputed.

Recomputation must replay the same dropout masks: torch's checkpoint restores the default RNG
state, and the snapshot below restores megacoat's model-parallel RNG stream (RNGTracker) too, so
gradients are bit-identical to a run without recomputation.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class RecomputePlan:
    granularity: str          # "full" or "selective"
    method: str = "uniform"   # full: "uniform" or "block"
    num_layers: int = 1

    @classmethod
    def from_flags(cls, granularity: Optional[str], method: Optional[str], num_layers: Optional[int],
                   layers_per_chunk: int) -> Optional["RecomputePlan"]:
        """The plan of the flags (validated by config.validate_config), or None."""
        if granularity is None:
            return None
        if granularity == "selective":
            return cls("selective")
        method = method or "uniform"
        n = num_layers if num_layers is not None else (1 if method == "uniform" else layers_per_chunk)
        return cls("full", method, n)

    def layer_groups(self, layers: Sequence) -> List[tuple]:
        """(recompute?, layers) units in order."""
        layers = list(layers)
        if self.granularity != "full":
            return [(False, [l]) for l in layers]
        if self.method == "uniform":
            return [(True, layers[i:i + self.num_layers]) for i in range(0, len(layers), self.num_layers)]
        n = min(self.num_layers, len(layers))
        return [(True, [l]) for l in layers[:n]] + [(False, [l]) for l in layers[n:]]


def _tracker_snapshot_context(rng) -> Callable:
    """context_fn for torch's non-reentrant checkpoint: the recomputation runs with the tracker's
    streams as they were at the original forward (the forward itself runs unchanged)."""

    def context_fn():
        if rng is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        snapshot = rng.state_dict()

        @contextlib.contextmanager
        def replay():
            current = rng.states
            rng.states = {k: v.clone() for k, v in snapshot.items()}
            try:
                yield
            finally:
                rng.states = current

        return contextlib.nullcontext(), replay()

    return context_fn


@torch.compiler.disable
def recompute(fn: Callable, *args, rng=None):
    """fn(*args) whose intermediate activations are recomputed in backward (bit-identical).

    Always eager: inside a torch.compile'd layer (selective recomputation) it is a graph break.
    Traced, the checkpoint saved the weights' main_grad buffers, which the fused weight-gradient
    GEMM of an earlier micro-batch updates in place (autograd then refuses the backward)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=_tracker_snapshot_context(rng))


def run_layer_group(layers: Sequence, x, rope, attention_mask, recomputed: bool, rng=None):
    def run(h, *rest):
        for layer in layers:
            h = layer(h, rope, attention_mask)
        return h

    return recompute(run, x, rng=rng) if recomputed else run(x)
