"""The communication-strategy interface of the ZeRO optimizer.

A strategy decides how one bucket crosses the wire:
- `reduce_grads(bucket_grad, shard_out)`: every DP rank contributes its full bucket gradient;
  afterwards `shard_out` (this rank's owned slice of the bucket) holds the DP-averaged gradient.
- `gather_params(bucket_param, shard_param, master_shard)`: this rank's new fp32 master shard
  becomes the bucket's new weights on every rank (`bucket_param` is the flat weight view of the
  bucket, `shard_param` this rank's slice of it).
Both return a `Pending` (wait() completes the collective and any post-processing) so that
the optimizer can overlap them with compute. Strategies count the bytes this rank sends.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch.distributed as dist


class Pending:
    """An in-flight collective plus what must run after it (copy-out, dequantize, ...)."""

    def __init__(self, works: Optional[List] = None, finish: Optional[Callable[[], None]] = None):
        self.works = [w for w in (works or []) if w is not None]
        self.finish = finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            w.wait()
        if self.finish is not None:
            self.finish()
        self.done = True


class CommStats:
    """Bytes this rank sent per step, per kind, as counted at each collective: "grad" (plain gradient
    sync), "grad_intra" / "grad_inter" (SDP4Bit's two gradient levels), "param" (parameter sync)."""

    def __init__(self):
        self.bytes = {"grad": 0, "param": 0}

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)

    def pop(self) -> dict:
        out, self.bytes = self.bytes, {"grad": 0, "param": 0}
        return out


def backend_supports_inplace(group) -> bool:
    """NCCL takes in-place reduce-scatter/all-gather on buffer slices; gloo gets separate buffers."""
    return dist.get_backend(group) == "nccl"
