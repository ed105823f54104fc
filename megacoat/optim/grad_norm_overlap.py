"""The gradient norm's sum of squares, computed per bucket while the backward is still running.

The norm otherwise re-reads every gradient after the backward (4 bytes/parameter: ~6 ms per step at
7B on an H200). A bucket's gradients are final as soon as its last parameter's gradient of the step's
last micro-batch has arrived; from then on its partial sum of squares runs on a side stream and
overlaps the remaining backward (compute-bound GEMMs). Only valid where nothing changes gradients
between the backward and the optimizer step (no data-parallel averaging, no TP sum of
sequence-parallel norm weights, no pre-sync of tied embeddings): the optimizer decides with `usable`.
Buckets that never became complete (a parameter without gradient) are summed in `total`.

A bucket whose every parameter counts is one flat tensor whose gaps are zero: its norm is one reduction over it.
The per-parameter path (a multi-tensor norm, a stack, a square and a sum per bucket, 26 times per 1.36B step) was
host time in a coat step whose GPU waited for the host (`benchmarks/profile_step.py --lead-trace`, H200).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from .clip import local_norms


class BucketNormOverlap:
    def __init__(self, bucket_params: List[List[nn.Parameter]], counted_ids: set, device: torch.device,
                 flats: Optional[List[torch.Tensor]] = None):
        """`flats[i]`: bucket i's flat gradient tensor (every main_grad of the bucket a view of it, gaps zero), used
        where every parameter of the bucket counts."""
        self.bucket_params = bucket_params
        self.counted = [[p for p in ps if id(p) in counted_ids] for ps in bucket_params]
        self.flats = [flats[i] if flats is not None and len(self.counted[i]) == len(ps) else None
                      for i, ps in enumerate(bucket_params)]
        self.bucket_of = {id(p): i for i, ps in enumerate(bucket_params) for p in ps}
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.enabled = True
        self._active = False
        self.reset()

    def reset(self) -> None:
        """A new step: no gradient is final yet."""
        self._ready = [0] * len(self.bucket_params)
        self._partials: Dict[int, torch.Tensor] = {}

    def set_last_micro_batch(self, is_last: bool) -> None:
        self._active = is_last and self.enabled

    def on_ready(self, p: nn.Parameter) -> None:
        if not self._active:
            return
        i = self.bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.bucket_params[i]):
            self._launch(i)
        elif self._ready[i] > len(self.bucket_params[i]):
            # Gradients arrived again after the bucket was complete (the last-micro-batch flag was given
            # more than once): its partial is stale, so `total` reads the bucket after the backward.
            self._partials.pop(i, None)

    def _norms(self, i: int) -> torch.Tensor:
        """1-D fp32 norms whose squares sum to bucket i's counted sum of squares."""
        if self.flats[i] is not None:
            return torch.linalg.vector_norm(self.flats[i], 2, dtype=torch.float32).reshape(1)
        return local_norms([p.main_grad for p in self.counted[i]], self.device)

    def _launch(self, i: int) -> None:
        if self.stream is None:
            self._partials[i] = self._norms(i)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the GEMMs that wrote them
        with torch.cuda.stream(self.stream):
            self._partials[i] = self._norms(i)

    def total(self) -> torch.Tensor:
        """This rank's sum of squares over every counted gradient (call after the backward)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        parts = [self._partials[i] if i in self._partials else self._norms(i) for i in range(len(self.bucket_params))]
        self.reset()
        return torch.cat(parts).square().sum() if parts else torch.zeros((), device=self.device)
