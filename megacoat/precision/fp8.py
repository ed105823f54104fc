"""FP8 formats and the one quantizer every caller uses.

- E4M3 (max 448) for weights and forward activations, E5M2 (max 57344) for gradients.
- Just-in-time scaling: `scale = (amax + EPS) / fp8_max` (fp32, IEEE division on every device),
  `q = sat(x * r)` with `r = 1 / scale` (fp32, IEEE), rounded to nearest even, saturating at
  +-fp8_max. One multiply per element instead of a division (cheaper in the kernels; the reference
  does the same, so the codes agree bit for bit). Dequantization: `q * scale`.
- Per-tensor scaling (GEMM inputs) with an optional transposed copy (the weight-gradient GEMM
  wants both `x` and `x^T` row-major), and per-group 1x16 scaling along the last dim (inputs of
  non-linear ops) with bf16 group scales `[..., ceil(K / 16)]`, rounded *up* from the fp32 scale
  (half the bytes of fp32 scales; rounding up keeps |x| / scale <= fp8_max, so no code saturates
  and `q * scale` never exceeds the group's range by more than the rounding).
- The per-tensor amax is reduced by the kernel that reads the tensor (an atomic max per program;
  the producing kernels of `activations.py` emit it themselves, so no extra read), and the cast
  kernel turns it into the scale: a quantization costs one launch and no host sync.

Every function here is the plain-PyTorch reference *or* the public entry point: on a CUDA tensor
with Triton available the same-signature kernel of `megacoat.kernels.fp8` runs instead. Under
`torch.compile` the public functions go through `torch.library` custom ops (compiled graphs keep
them whole); eager calls skip the custom-op dispatch (its host cost is paid per call).
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
    """Just-in-time scale (fp32): IEEE (amax + EPS) / fp8_max. A tensor divisor, not a Python number:
    CUDA torch turns `t / number` into `t * (1 / number)` (off by one ulp half the time)."""
    a = amax.float() + EPS
    return torch.div(a, torch.full_like(a, get_format(fmt).max))


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """fp32 1 / scale, IEEE on every device (the kernels' div_rn(1, s))."""
    s = scale.float()
    return torch.div(torch.ones_like(s), s)


def round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """Positive finite fp32 values -> the smallest bf16 values >= them (exact integer bit arithmetic)."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 65535) & -65536).view(torch.float32).to(torch.bfloat16)


def cast_saturate(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values already multiplied by the reciprocal scale -> fp8 codes (RNE, saturating; NaN stays NaN)."""
    f = get_format(fmt)
    return scaled.clamp(-f.max, f.max).to(f.dtype)


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def cast_tensorwise_reference(x: torch.Tensor, amax: torch.Tensor, fmt: str, transpose: bool,
                              rowwise: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q or empty, q of x.T or empty, scale) with the per-tensor scale of `amax`; `transpose` needs a
    2-D x; `rowwise=False` returns only the transposed copy (q empty)."""
    _check_cast_args(x, transpose, rowwise)
    scale = scale_from_amax(amax, fmt)
    q = cast_saturate(x.detach().float() * reciprocal(scale), fmt)
    qt = q.t().contiguous() if transpose else q.new_empty(0)
    return (q if rowwise else q.new_empty(0)), qt, scale


def _check_cast_args(x: torch.Tensor, transpose: bool, rowwise: bool) -> None:
    if transpose and x.dim() != 2:
        raise ValueError(f"the transposed FP8 copy needs a 2-D tensor, got shape {tuple(x.shape)}: flatten it first")
    if not (rowwise or transpose):
        raise ValueError("an FP8 cast with rowwise=False needs transpose=True: otherwise it writes nothing")


def quantize_1x16_reference(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-group 1x16 along the last dim: (codes shaped like x, bf16 scales [..., ceil(K/16)])."""
    k = x.shape[-1]
    g = num_groups(k)
    xf = x.detach().float()
    if g * GROUP != k:  # the last group is partial: pad with zeros (they never raise the amax)
        xf = torch.nn.functional.pad(xf, (0, g * GROUP - k))
    xg = xf.reshape(*x.shape[:-1], g, GROUP)
    scales = round_up_bf16(scale_from_amax(xg.abs().amax(-1), fmt))
    q = cast_saturate(xg * reciprocal(scales).unsqueeze(-1), fmt).reshape(*x.shape[:-1], g * GROUP)[..., :k]
    return q.contiguous(), scales


def dequantize_1x16_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k = q.shape[-1]
    g = scales.shape[-1]
    if g != num_groups(k):
        raise ValueError(f"1x16 scales of shape {tuple(scales.shape)} do not match codes of shape {tuple(q.shape)}")
    per_elem = scales.float().repeat_interleave(GROUP, dim=-1)[..., :k]
    return (q.float() * per_elem).to(dtype)


# ----------------------------------------------------------------------------- dispatch
def is_compiling() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    if fn is None:  # torch < 2.3
        import torch._dynamo as dynamo
        fn = dynamo.is_compiling
    return fn()


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and fp8_kernels.available()


def _amax_impl(x: torch.Tensor) -> torch.Tensor:
    if _kernel_ok(x) and x.numel() > 0:
        return fp8_kernels.amax(x)
    return amax_reference(x)


def _cast_impl(x, amax_t, fmt, transpose, rowwise=True):
    get_format(fmt)
    _check_cast_args(x, transpose, rowwise)
    if _kernel_ok(x, amax_t) and x.numel() > 0:
        return fp8_kernels.cast_tensorwise(x, amax_t.float().reshape(()), fmt, transpose, rowwise)
    return cast_tensorwise_reference(x, amax_t, fmt, transpose, rowwise)


def _quantize_1x16_impl(x, fmt):
    get_format(fmt)
    if _kernel_ok(x) and x.numel() > 0:
        return fp8_kernels.quantize_1x16(x, fmt)
    return quantize_1x16_reference(x, fmt)


def _dequantize_1x16_impl(q, scales, dtype):
    if _kernel_ok(q, scales) and q.numel() > 0:
        return fp8_kernels.dequantize_1x16(q, scales, dtype)
    return dequantize_1x16_reference(q, scales, dtype)


@torch.library.triton_op("megacoat::fp8_amax", mutates_args=())
def _amax_op(x: torch.Tensor) -> torch.Tensor:
    return _amax_impl(x)


@_amax_op.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.triton_op("megacoat::fp8_cast_tensorwise", mutates_args=())
def _cast_op(x: torch.Tensor, amax: torch.Tensor, fmt: str, transpose: bool,
             rowwise: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _cast_impl(x, amax, fmt, transpose, rowwise)


@_cast_op.register_fake
def _(x, amax, fmt, transpose, rowwise=True):
    dt = get_format(fmt).dtype
    q = x.new_empty(x.shape if rowwise else (0,), dtype=dt)
    qt = x.new_empty((x.shape[1], x.shape[0]), dtype=dt) if transpose else x.new_empty(0, dtype=dt)
    return q, qt, x.new_empty((), dtype=torch.float32)


@torch.library.triton_op("megacoat::fp8_quantize_1x16", mutates_args=())
def _quantize_1x16_op(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return _quantize_1x16_impl(x, fmt)


@_quantize_1x16_op.register_fake
def _(x, fmt):
    return (x.new_empty(x.shape, dtype=get_format(fmt).dtype),
            x.new_empty((*x.shape[:-1], num_groups(x.shape[-1])), dtype=torch.bfloat16))


@torch.library.triton_op("megacoat::fp8_dequantize_1x16", mutates_args=())
def _dequantize_1x16_op(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_1x16_impl(q, scales, dtype)


@_dequantize_1x16_op.register_fake
def _(q, scales, dtype):
    return q.new_empty(q.shape, dtype=dtype)


# ----------------------------------------------------------------------------- public entry points
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| (fp32, 0-d); on the GPU one kernel (atomic max per program), no host sync."""
    return _amax_op(x) if is_compiling() else _amax_impl(x)


def cast_tensorwise(x: torch.Tensor, amax: torch.Tensor, fmt: str, transpose: bool, rowwise: bool = True):
    """(q, q of x.T or empty, scale) with the per-tensor scale of the given amax (one pass).
    `rowwise=False` (with transpose): only the transposed copy, q empty (a backward that has no use for q)."""
    if is_compiling():
        return _cast_op(x, amax, fmt, transpose, rowwise)
    return _cast_impl(x, amax, fmt, transpose, rowwise)


def quantize_tensorwise_into(x: torch.Tensor, fmt: str, q: torch.Tensor, qt: torch.Tensor, scale: torch.Tensor,
                             amax_buf: torch.Tensor) -> None:
    """Just-in-time per-tensor quantization of a 2-D x written into existing buffers (a weight cache's:
    compiled graphs hold them as inputs, and writing in place saves a copy of each): q, its transpose qt,
    the fp32 scale; `amax_buf` (an fp32 scalar) receives max |x|. Eager only (not a custom op)."""
    get_format(fmt)
    _check_cast_args(x, True, True)
    if _kernel_ok(x, q, qt, scale, amax_buf) and x.numel() > 0:
        fp8_kernels.amax_into(x, amax_buf.zero_())
        fp8_kernels.cast_tensorwise(x, amax_buf, fmt, True, out=(q, qt, scale))
        return
    a = amax_reference(x)
    rq, rqt, rs = cast_tensorwise_reference(x, a, fmt, True)
    for dst, src in ((q, rq), (qt, rqt), (scale, rs), (amax_buf, a)):
        dst.copy_(src)


def quantize_tensorwise_many(xs, fmt: str, qs, qts, scales, plan=None):
    """`quantize_tensorwise_into` for many contiguous 2-D tensors at once (the weight refresh after each
    optimizer step): on the GPU two launches for all of them, the same codes and scales. `plan`: what the
    previous call returned (descriptor tables, reused while the tensors and buffers are the same).
    Returns the plan to pass next time (None where the references ran). Eager only (not a custom op)."""
    get_format(fmt)
    if not xs:
        return plan
    if _kernel_ok(*xs) and all(x.numel() > 0 for x in xs) and xs[0].dtype in (torch.bfloat16, torch.float16,
                                                                             torch.float32):
        if plan is None or plan.key != fp8_kernels.MultiCastPlan.key_of(xs, qs, qts, scales, fmt):
            plan = fp8_kernels.MultiCastPlan(xs, qs, qts, scales, fmt)
        fp8_kernels.quantize_tensorwise_many(plan)
        return plan
    for x, q, qt, s in zip(xs, qs, qts, scales):
        quantize_tensorwise_into(x, fmt, q, qt, s, torch.empty((), dtype=torch.float32, device=x.device))
    return None


def quantize_1x16(x: torch.Tensor, fmt: str):
    """Per-group 1x16 quantization along the last dim -> (codes, bf16 group scales)."""
    return _quantize_1x16_op(x, fmt) if is_compiling() else _quantize_1x16_impl(x, fmt)


def dequantize_1x16(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_1x16_op(q, scales, dtype) if is_compiling() else _dequantize_1x16_impl(q, scales, dtype)


def quantize_tensorwise(x: torch.Tensor, fmt: str, transpose: bool = False,
                        amax_value: Optional[torch.Tensor] = None):
    """Just-in-time per-tensor quantization: (q, qT or empty, scale). `amax_value` skips the amax
    pass when the producer already emitted it."""
    a = amax(x) if amax_value is None else amax_value
    return cast_tensorwise(x, a, fmt, transpose)


def dequantize_tensorwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)
