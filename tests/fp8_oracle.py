"""Independent float64 oracles for the FP8 tests: brute-force nearest-even rounding over the table of
every finite FP8 value (no torch fp8 cast involved), and the tolerance for interpreted Triton casts."""
from __future__ import annotations

import torch

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def positive_table(fmt: str):
    """(sorted non-negative finite values as float64, their codes) of the format."""
    codes = torch.arange(0, 128, dtype=torch.uint8)  # sign bit clear
    vals = codes.view(DTYPE[fmt]).double()
    keep = torch.isfinite(vals)
    return vals[keep], codes[keep].long()


def round_fp8_oracle(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 values -> nearest finite FP8 value (ties to the even code), saturating, as float64."""
    vals, codes = positive_table(fmt)
    a = v.double().abs().clamp(max=FMAX[fmt])
    idx = torch.searchsorted(vals, a).clamp(1, len(vals) - 1)
    lo, hi = vals[idx - 1], vals[idx]
    d_lo, d_hi = a - lo, hi - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[idx] % 2 == 0))
    out = torch.where(pick_hi, hi, lo)
    out = torch.where(a >= vals[-1], vals[-1], out)
    return out * torch.sign(v.double())


def scale_oracle(amax: float, fmt: str) -> float:
    return (amax + 1e-12) / FMAX[fmt]


def assert_interpreted_fp8_close(q: torch.Tensor, q_ref: torch.Tensor, max_mismatch: float = 0.1) -> None:
    """Codes cast by the Triton interpreter vs the reference. The interpreter (triton 3.6/3.9) rounds
    ties away from even and mis-rounds values that round up across a power of two (126.8 -> 64): a
    differing code must be a neighbour of the reference code, or half of a power-of-two reference."""
    a, b = q.float(), q_ref.float()
    bad = a != b
    assert bad.float().mean().item() <= max_mismatch, f"{bad.float().mean().item():.3f} of the codes differ"
    if not bad.any():
        return
    ai, bi = q.view(torch.uint8)[bad].long(), q_ref.view(torch.uint8)[bad].long()
    neighbour = (ai - bi).abs() == 1
    av, bv = a[bad], b[bad]
    pow2 = (bv != 0) & (torch.log2(bv.abs()) == torch.log2(bv.abs()).round())
    halved = pow2 & (av == bv / 2)
    ok = neighbour | halved
    assert ok.all(), f"interpreted codes {av[~ok][:5].tolist()} vs reference {bv[~ok][:5].tolist()}"
