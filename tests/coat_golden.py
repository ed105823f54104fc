"""COAT's own FP8 AdamW kernel outputs (NVlabs/COAT 80ec99f, run on an H200; provenance and format in
tests/data/README.md), trimmed to fit the repository: each tensor's flattened prefix of `kept[i]` elements (a
whole number of 128-groups; the first 32 rows of the 256 x 512 tensor, the others whole) with its group
statistics, at steps 1, 10, 20. The initial parameters and gradients follow that README's recipes, so the
optimizer still runs on the full tensors and is compared on the kept prefix (groups never straddle it)."""
import os

import torch

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "coat_adamw_golden_nozeros_trimmed.pt")


def load_coat_golden() -> dict:
    """The golden outputs plus the regenerated initial parameters; a missing file fails (never skips)."""
    if not os.path.exists(GOLDEN):
        raise FileNotFoundError(f"{GOLDEN} is missing: it is part of the repository (see tests/data/README.md)")
    gold = torch.load(GOLDEN, weights_only=True)
    gold["init"] = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) * 0.02
                    for i, s in enumerate(gold["shapes"])]
    return gold


def golden_grad(t: int, i: int, shape) -> torch.Tensor:
    """The gradient of tensor i at step t (tests/data/README.md)."""
    gen = torch.Generator().manual_seed(1000 * t + i)
    rows = shape[0] if len(shape) == 2 else 1
    rs = torch.exp(torch.randn(rows, 1, generator=gen) * 1.5)
    x = torch.randn(shape, generator=gen) * (rs if len(shape) == 2 else rs[0])
    return x * 1e-3
