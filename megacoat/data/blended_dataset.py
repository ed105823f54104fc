"""Weighted mixture of datasets (Megatron's BlendedDataset).

Sample i comes from the dataset furthest behind its target share (helpers.build_blending_indices),
so every prefix of the blend matches the weights as closely as whole samples allow. Each
component is sized ceil(ceil(size * weight) * 1.005) samples by the builder (Megatron's margin).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from megacoat.data import helpers


def component_sizes(size: int, weights: Sequence[float]) -> List[int]:
    """Samples to request from each component of a blend of `size` samples (Megatron's margin)."""
    import math

    return [int(math.ceil(math.ceil(size * w) * 1.005)) for w in weights]


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be finite and non-negative with a positive sum, got {list(weights)}")
    return w / w.sum()


class BlendedDataset:
    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, backend: Optional[str] = None):
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = size
        self.dataset_index, self.dataset_sample_index = helpers.build_blending_indices(self.weights, size, backend)
        for d, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and used.max() >= len(ds):
                raise ValueError(f"blend component {d} has {len(ds)} samples but the blend needs {used.max() + 1}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
