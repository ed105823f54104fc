"""Where a rank's TP-local tensor sits in the full tensor, and the layout-free "canonical" form.

The canonical form of a parameter is its full tensor with the vocabulary padding rows removed
(padding depends on the TP size, so it is not part of the model). A checkpoint stores pieces of
TP-local tensors exactly as they sit in memory plus the layout they came from; loading at
another layout goes local pieces -> canonical -> the new rank's local tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..parallel.layers import full_from_shards, shard_of_full

# Parameters whose first dimension is the padded vocabulary.
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


@dataclass
class TensorLayout:
    full_shape: Tuple[int, ...]           # full tensor at this layout (vocabulary padded)
    tp_size: int                          # 1 for tensors replicated over TP
    dim: Optional[int] = None             # sharded dimension (None: replicated)
    partition_sizes: Optional[List[int]] = None
    vocab_rows: Optional[int] = None      # unpadded rows along dim 0 (vocabulary parameters)

    @property
    def canonical_shape(self) -> Tuple[int, ...]:
        if self.vocab_rows is None:
            return tuple(self.full_shape)
        return (self.vocab_rows,) + tuple(self.full_shape[1:])

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.full_shape)
        if self.dim is not None:
            shape[self.dim] //= self.tp_size
        return tuple(shape)

    @property
    def local_numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def same_local_layout(self, other: "TensorLayout") -> bool:
        """Local flat coordinates mean the same elements in both layouts."""
        return (tuple(self.full_shape) == tuple(other.full_shape) and self.tp_size == other.tp_size
                and self.dim == other.dim and list(self.partition_sizes or []) == list(other.partition_sizes or [])
                and self.vocab_rows == other.vocab_rows)

    def to_json(self) -> dict:
        return {"full_shape": list(self.full_shape), "tp_size": self.tp_size, "dim": self.dim,
                "partition_sizes": self.partition_sizes, "vocab_rows": self.vocab_rows}

    @classmethod
    def from_json(cls, d: dict) -> "TensorLayout":
        return cls(tuple(d["full_shape"]), d["tp_size"], d["dim"], d["partition_sizes"], d["vocab_rows"])

    # ------------------------------------------------------------------------- conversions
    def canonical_from_locals(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """All TP ranks' local tensors (flat or shaped) -> canonical tensor."""
        shaped = [t.view(self.local_shape) for t in locals_]
        full = shaped[0] if self.dim is None else full_from_shards(shaped, self.dim, self.partition_sizes)
        return full if self.vocab_rows is None else full[: self.vocab_rows]

    def local_from_canonical(self, canonical: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Canonical tensor -> this TP rank's local tensor (zero vocabulary padding)."""
        full = canonical
        if self.vocab_rows is not None and self.full_shape[0] != canonical.shape[0]:
            full = canonical.new_zeros(self.full_shape)
            full[: canonical.shape[0]] = canonical
        if self.dim is None:
            return full
        return shard_of_full(full, self.dim, self.partition_sizes, tp_rank, self.tp_size)


def layout_of_parameter(p: torch.nn.Parameter, tp_size: int, vocab_size: Optional[int]) -> TensorLayout:
    """The layout of a model parameter built by megacoat.parallel.layers (reads its annotations)."""
    shard = getattr(p, "shard_info", None)
    vocab_rows = vocab_size if p.global_name in VOCAB_PARAMETERS else None
    if shard is None or not getattr(p, "tensor_model_parallel", False):
        return TensorLayout(tuple(p.shape), 1, None, None, vocab_rows)
    dim, sizes = shard
    full = list(p.shape)
    full[dim] *= tp_size
    return TensorLayout(tuple(full), tp_size, dim, list(sizes), vocab_rows)
