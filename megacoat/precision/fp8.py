"""FP8 formats and the one quantizer every caller uses (DESIGN 5.1).

- E4M3 (max 448) for weights and forward activations, E5M2 (max 57344) for gradients.
- Just-in-time scaling: `scale = (amax + EPS) / fp8_max` in fp32, `q = sat(x / scale)` rounded to
  nearest even, saturating at +-fp8_max. The scale is kept exactly as used (dequant: `q * scale`).
- Per-tensor scaling (GEMM inputs) with an optional transposed copy (the weight-gradient GEMM
  wants both `x` and `x^T` row-major), and per-group 1x16 scaling along the last dim (inputs of
  non-linear ops), with fp32 group scales `[..., ceil(K / 16)]`.
- The per-tensor amax is two-stage: a pass emits per-block maxima, a tiny reduction takes the max
  (the producing kernels of `activations.py` emit the maxima themselves, so no extra read).

Every function here is the plain-PyTorch reference *and* the public entry point: on a CUDA tensor
with Triton available the same-signature kernel of `megacoat.kernels.fp8` runs instead. The public
functions are `torch.library` custom ops, so `torch.compile` neither traces into nor breaks them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..kernels import fp8 as fp8_kernels

# EPS keeps an all-zero tensor's scale finite and non-zero (its codes are then 0). The constants
# live in the kernel layer so that the Triton launchers use the very same numbers.
EPS = fp8_kernels.EPS
GROUP = 16   # elements per group of the 1x16 per-group scaling (along the last dim)


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float


E4M3 = Fp8Format("e4m3", fp8_kernels.FP8_DTYPE["e4m3"], fp8_kernels.FP8_MAX["e4m3"])
E5M2 = Fp8Format("e5m2", fp8_kernels.FP8_DTYPE["e5m2"], fp8_kernels.FP8_MAX["e5m2"])
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def get_format(name: str) -> Fp8Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}: use one of {sorted(FORMATS)}") from None


def num_groups(k: int) -> int:
    return (k + GROUP - 1) // GROUP


# ----------------------------------------------------------------------------- references
def scale_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Just-in-time scale (fp32) from an amax; also used by the kernels' callers (one definition)."""
    return (amax.float() + EPS) / get_format(fmt).max


def cast_saturate(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values already divided by their scale -> fp8 codes (RNE, saturating; NaN stays NaN)."""
    f = get_format(fmt)
    return scaled.clamp(-f.max, f.max).to(f.dtype)


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def cast_tensorwise_reference(x: torch.Tensor, scale: torch.Tensor, fmt: str,
                              transpose: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """q = sat(x / scale) with a per-tensor fp32 scale; with `transpose`, also q of x.T (2-D x)."""
    q = cast_saturate(x.detach().float() / scale, fmt)
    if not transpose:
        return q, q.new_empty(0)
    if x.dim() != 2:
        raise ValueError(f"the transposed FP8 copy needs a 2-D tensor, got shape {tuple(x.shape)}: flatten it first")
    return q, q.t().contiguous()


def quantize_1x16_reference(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-group 1x16 along the last dim: (codes shaped like x, fp32 scales [..., ceil(K/16)])."""
    k = x.shape[-1]
    g = num_groups(k)
    xf = x.detach().float()
    if g * GROUP != k:  # the last group is partial: pad with zeros (they never raise the amax)
        xf = torch.nn.functional.pad(xf, (0, g * GROUP - k))
    xg = xf.reshape(*x.shape[:-1], g, GROUP)
    scales = scale_from_amax(xg.abs().amax(-1), fmt)
    q = cast_saturate(xg / scales.unsqueeze(-1), fmt).reshape(*x.shape[:-1], g * GROUP)[..., :k]
    return q.contiguous(), scales


def dequantize_1x16_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k = q.shape[-1]
    g = scales.shape[-1]
    if g != num_groups(k):
        raise ValueError(f"1x16 scales of shape {tuple(scales.shape)} do not match codes of shape {tuple(q.shape)}")
    per_elem = scales.repeat_interleave(GROUP, dim=-1)[..., :k]
    return (q.float() * per_elem).to(dtype)


# ----------------------------------------------------------------------------- dispatch
def _kernel_ok(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and fp8_kernels.available()


def _check_fmt(fmt: str) -> None:
    get_format(fmt)


@torch.library.custom_op("megacoat::fp8_amax", mutates_args=())
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| (fp32, 0-d), two-stage on the GPU (per-block maxima, then their max)."""
    if _kernel_ok(x) and x.numel() > 0:
        return fp8_kernels.amax(x)
    return amax_reference(x)


@amax.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("megacoat::fp8_cast_tensorwise", mutates_args=())
def cast_tensorwise(x: torch.Tensor, scale: torch.Tensor, fmt: str,
                    transpose: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, q of x.T) with a given per-tensor scale; the second is empty unless `transpose`."""
    _check_fmt(fmt)
    if _kernel_ok(x, scale) and x.numel() > 0 and (x.dim() == 2 or not transpose):
        return fp8_kernels.cast_tensorwise(x, scale, fmt, transpose)
    return cast_tensorwise_reference(x, scale, fmt, transpose)


@cast_tensorwise.register_fake
def _(x, scale, fmt, transpose):
    dt = get_format(fmt).dtype
    q = x.new_empty(x.shape, dtype=dt)
    return q, (x.new_empty((x.shape[1], x.shape[0]), dtype=dt) if transpose else x.new_empty(0, dtype=dt))


@torch.library.custom_op("megacoat::fp8_quantize_1x16", mutates_args=())
def quantize_1x16(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-group 1x16 quantization along the last dim -> (codes, fp32 group scales)."""
    _check_fmt(fmt)
    if _kernel_ok(x) and x.numel() > 0:
        return fp8_kernels.quantize_1x16(x, fmt)
    return quantize_1x16_reference(x, fmt)


@quantize_1x16.register_fake
def _(x, fmt):
    return (x.new_empty(x.shape, dtype=get_format(fmt).dtype),
            x.new_empty((*x.shape[:-1], num_groups(x.shape[-1])), dtype=torch.float32))


@torch.library.custom_op("megacoat::fp8_dequantize_1x16", mutates_args=())
def dequantize_1x16(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if _kernel_ok(q, scales) and q.numel() > 0:
        return fp8_kernels.dequantize_1x16(q, scales, dtype)
    return dequantize_1x16_reference(q, scales, dtype)


@dequantize_1x16.register_fake
def _(q, scales, dtype):
    return q.new_empty(q.shape, dtype=dtype)


# ----------------------------------------------------------------------------- conveniences
def quantize_tensorwise(x: torch.Tensor, fmt: str, transpose: bool = False,
                        amax_value: Optional[torch.Tensor] = None):
    """Just-in-time per-tensor quantization: (q, qT or empty, scale). `amax_value` skips the amax
    pass when the producer already emitted it (two-stage amax)."""
    a = amax(x) if amax_value is None else amax_value
    scale = scale_from_amax(a, fmt)
    q, qt = cast_tensorwise(x, scale, fmt, transpose)
    return q, qt, scale


def dequantize_tensorwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)
