"""COAT's mixed-granularity FP8 activation path: fused norms and activations whose
saved-for-backward tensors are FP8 with 1x16 per-group scales.

Ops (each an autograd function over `torch.library` custom ops, so `torch.compile` keeps every
kernel whole and opaque; eager calls skip the custom-op dispatcher and call the same implementation;
they run the Triton kernels of `megacoat.kernels.fp8_act` on CUDA and the plain-PyTorch references
below elsewhere):

- `fp8_norm(x, weight, bias, eps, rms, residual=None)` -> `(stream, y, y_amax)`: RMSNorm or
  LayerNorm of `stream = x (+ residual)`. The optional residual add is fused (the bf16 residual
  stream is kept and returned, its 1x16 FP8 copy is made in the same pass). Saved: the stream as
  E4M3 1x16 (bf16 group scales, rounded up) + fp32 rstd (+ fp32 mean for LayerNorm). `y` is
  emitted in bf16 together with its
  per-tensor amax (reduced by the same kernel: a 0-d device tensor), so the following FP8 linear casts it
  to per-tensor E4M3 (and the transposed copy for its wgrad) in one pass without an amax pass;
  the linear saves that FP8 copy, never the bf16 `y`.
- `fp8_swiglu(h)` -> `(p, p_amax)`: `silu(gate) * up` of `h = [gate; up]` (last dim). Saved:
  gate and up as E4M3 1x16. The SiLU output is recomputed from the saved gate in backward (a
  fused kernel does not need it stored: 0.5 bytes/element of ffn less than storing it).
- `fp8_activation(h, kind)` -> `(y, y_amax)`: SiLU or GELU (tanh). Saved: `h` as E4M3 1x16.

All math is fp32; outputs are rounded once to the input dtype. Backward dequantizes the saved
copies (x = q * s) and computes in fp32.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..kernels import fp8 as fp8_quant_kernels
from ..kernels import fp8_act as act_kernels
from .fp8 import cast_tensorwise_reference, dequantize_1x16_reference, get_format, is_compiling, quantize_1x16_reference

SAVE_FMT = "e4m3"  # forward activations are E4M3 (precision/fp8.py)
ACTIVATIONS = ("silu", "gelu")


def _empty(ref: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return ref.new_empty(0, dtype=dtype)


def _amax_of(y: torch.Tensor) -> torch.Tensor:
    """amax of the values as emitted (after rounding to the output dtype): exactly what the cast sees."""
    return y.float().abs().amax() if y.numel() else torch.zeros((), dtype=torch.float32, device=y.device)


# ----------------------------------------------------------------------------- references
def norm_fwd_reference(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       bias: Optional[torch.Tensor], eps: float, rms: bool):
    """-> (stream or empty, y, y_amax, xq, xs, rstd, mean or empty)."""
    stream = x + residual if residual is not None else x
    sf = stream.float()
    if rms:
        mean = None
        centred = sf
    else:
        mean = sf.mean(-1)
        centred = sf - mean.unsqueeze(-1)
    var = centred.pow(2).mean(-1)
    rstd = 1.0 / torch.sqrt(var + eps)
    yf = centred * rstd.unsqueeze(-1) * weight.float()
    if bias is not None:
        yf = yf + bias.float()
    y = yf.to(x.dtype)
    xq, xs = quantize_1x16_reference(stream, SAVE_FMT)
    return (stream if residual is not None else _empty(x, x.dtype), y, _amax_of(y), xq, xs, rstd,
            mean if mean is not None else _empty(x))


def norm_bwd_reference(dy: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor,
                       mean: torch.Tensor, weight: torch.Tensor, has_bias: bool, rms: bool,
                       dres: Optional[torch.Tensor] = None, want_amax: bool = False):
    """-> (dx, dweight, dbias or empty, max |dx| or empty), from the saved FP8 copy of the input. `dres`: the
    residual stream's own gradient, added to dx in fp32 before its one rounding (the fused residual add).
    `want_amax`: also the amax of dx as rounded (what the FP8 linear that produced the norm's input casts)."""
    k = dy.shape[-1]
    x = dequantize_1x16_reference(xq, xs, torch.float32)
    centred = x if rms else x - mean.unsqueeze(-1)
    xhat = centred * rstd.unsqueeze(-1)
    g = dy.float()
    gw = g * weight.float()
    c2 = (gw * xhat).sum(-1, keepdim=True) / k
    dx = gw - xhat * c2
    if not rms:
        dx = dx - gw.sum(-1, keepdim=True) / k
    dx = dx * rstd.unsqueeze(-1)
    if dres is not None:
        dx = dx + dres.float()
    g2, xh2 = g.reshape(-1, k), xhat.reshape(-1, k)
    dw = (g2 * xh2).sum(0).to(weight.dtype)
    db = g2.sum(0).to(weight.dtype) if has_bias else _empty(dy, weight.dtype)
    dx = dx.to(dy.dtype)
    return dx, dw, db, (_amax_of(dx) if want_amax else _empty(dy))


def _split_gate_up(h: torch.Tensor):
    if h.shape[-1] % 2:
        raise ValueError(f"SwiGLU input's last dim ({h.shape[-1]}) must be even: [gate; up] halves")
    f = h.shape[-1] // 2
    return h.reshape(*h.shape[:-1], 2, f)


def swiglu_fwd_reference(h: torch.Tensor):
    """-> (p, p_amax, hq [..., 2, f], hs [..., 2, ceil(f/16)])."""
    h2 = _split_gate_up(h)
    gate, up = h2[..., 0, :].float(), h2[..., 1, :].float()
    p = (gate * torch.sigmoid(gate) * up).to(h.dtype)
    hq, hs = quantize_1x16_reference(h2, SAVE_FMT)
    return p, _amax_of(p), hq, hs


def swiglu_bwd_reference(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor):
    """-> (dh, max |dh|): dh is the output gradient of the FP8 linear before the SwiGLU, which casts it
    per tensor with this amax."""
    h2 = dequantize_1x16_reference(hq, hs, torch.float32)
    gate, up = h2[..., 0, :], h2[..., 1, :]
    g = dp.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = g * up * sig * (1.0 + gate * (1.0 - sig))
    dup = g * silu
    dh = torch.stack([dgate, dup], dim=-2).reshape(*dp.shape[:-1], 2 * dp.shape[-1]).to(dp.dtype)
    return dh, _amax_of(dh)


def swiglu_bwd_quantized_reference(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor, fmt: str):
    """-> (gq [M, 2F], gqt [2F, M], scale, max |dh|): `swiglu_bwd_reference`'s dh (M = its rows) cast per tensor
    to `fmt` with its own amax, in both layouts (what the preceding FP8 linear's dgrad and wgrad read)."""
    dh, amax = swiglu_bwd_reference(dp, hq, hs)
    gq, gqt, scale = cast_tensorwise_reference(dh.reshape(-1, dh.shape[-1]), amax, fmt, True)
    return gq, gqt, scale, amax


_GELU_C = math.sqrt(2.0 / math.pi)


def _act_fp32(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return x * torch.sigmoid(x)
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * x * x * x)))


def _act_grad_fp32(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    t = torch.tanh(_GELU_C * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)


def _check_act(kind: str) -> None:
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown FP8 activation {kind!r}: use one of {ACTIVATIONS}")


def act_fwd_reference(h: torch.Tensor, kind: str):
    """-> (y, y_amax, hq, hs)."""
    _check_act(kind)
    y = _act_fp32(h.float(), kind).to(h.dtype)
    hq, hs = quantize_1x16_reference(h, SAVE_FMT)
    return y, _amax_of(y), hq, hs


def act_bwd_reference(dy: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor, kind: str):
    _check_act(kind)
    x = dequantize_1x16_reference(hq, hs, torch.float32)
    return (dy.float() * _act_grad_fp32(x, kind)).to(dy.dtype)


# ----------------------------------------------------------------------------- custom ops
def _kernel_ok(*tensors) -> bool:
    return (all(t is None or t.is_cuda for t in tensors) and fp8_quant_kernels.available()
            and all(t is None or t.numel() > 0 for t in tensors))


def _norm_fwd_impl(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                   eps: float, rms: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor, torch.Tensor]:
    if _kernel_ok(x, residual, weight, bias):
        return act_kernels.norm_fwd(x, residual, weight, bias, eps, rms)
    return norm_fwd_reference(x, residual, weight, bias, eps, rms)


@torch.library.triton_op("megacoat::fp8_norm_fwd", mutates_args=())
def _norm_fwd_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                 eps: float, rms: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor, torch.Tensor]:
    return _norm_fwd_impl(x, residual, weight, bias, eps, rms)


def _norm_fwd(x, residual, weight, bias, eps, rms):
    """Eager: the implementation itself (no custom-op dispatch cost); compiled: the opaque op."""
    return (_norm_fwd_op if is_compiling() else _norm_fwd_impl)(x, residual, weight, bias, eps, rms)


@_norm_fwd_op.register_fake
def _(x, residual, weight, bias, eps, rms):
    lead, k = x.shape[:-1], x.shape[-1]
    return (x.new_empty(x.shape) if residual is not None else x.new_empty(0), x.new_empty(x.shape),
            x.new_empty((), dtype=torch.float32), x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*lead, (k + 15) // 16), dtype=torch.bfloat16), x.new_empty(lead, dtype=torch.float32),
            x.new_empty(lead if not rms else (0,), dtype=torch.float32))


def _norm_bwd_impl(dy: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, mean: torch.Tensor,
                   weight: torch.Tensor, has_bias: bool, rms: bool, dres: Optional[torch.Tensor],
                   want_amax: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _kernel_ok(dy, xq, xs, rstd, weight, dres):
        return act_kernels.norm_bwd(dy.contiguous(), xq, xs, rstd, mean, weight, has_bias, rms, dres, want_amax)
    return norm_bwd_reference(dy, xq, xs, rstd, mean, weight, has_bias, rms, dres, want_amax)


@torch.library.triton_op("megacoat::fp8_norm_bwd", mutates_args=())
def _norm_bwd_op(dy: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, mean: torch.Tensor,
                 weight: torch.Tensor, has_bias: bool, rms: bool, dres: Optional[torch.Tensor],
                 want_amax: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_bwd_impl(dy, xq, xs, rstd, mean, weight, has_bias, rms, dres, want_amax)


def _norm_bwd(dy, xq, xs, rstd, mean, weight, has_bias, rms, dres=None, want_amax=False):
    """Eager: the implementation itself (no custom-op dispatch cost); compiled: the opaque op."""
    return (_norm_bwd_op if is_compiling() else _norm_bwd_impl)(dy, xq, xs, rstd, mean, weight, has_bias, rms, dres,
                                                                 want_amax)


@_norm_bwd_op.register_fake
def _(dy, xq, xs, rstd, mean, weight, has_bias, rms, dres, want_amax):
    return (dy.new_empty(dy.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape if has_bias else (0,)),
            dy.new_empty(() if want_amax else (0,), dtype=torch.float32))


def _swiglu_fwd_impl(h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _kernel_ok(h):
        return act_kernels.swiglu_fwd(h)
    return swiglu_fwd_reference(h)


@torch.library.triton_op("megacoat::fp8_swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _swiglu_fwd_impl(h)


def _swiglu_fwd(h):
    """Eager: the implementation itself (no custom-op dispatch cost); compiled: the opaque op."""
    return (_swiglu_fwd_op if is_compiling() else _swiglu_fwd_impl)(h)


@_swiglu_fwd_op.register_fake
def _(h):
    f = h.shape[-1] // 2
    lead = h.shape[:-1]
    return (h.new_empty((*lead, f)), h.new_empty((), dtype=torch.float32),
            h.new_empty((*lead, 2, f), dtype=torch.float8_e4m3fn),
            h.new_empty((*lead, 2, (f + 15) // 16), dtype=torch.bfloat16))


def _swiglu_bwd_impl(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if _kernel_ok(dp, hq, hs):
        return act_kernels.swiglu_bwd(dp.contiguous(), hq, hs)
    return swiglu_bwd_reference(dp, hq, hs)


@torch.library.triton_op("megacoat::fp8_swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_bwd_impl(dp, hq, hs)


def _swiglu_bwd(dp, hq, hs):
    """Eager: the implementation itself (no custom-op dispatch cost); compiled: the opaque op."""
    return (_swiglu_bwd_op if is_compiling() else _swiglu_bwd_impl)(dp, hq, hs)


@_swiglu_bwd_op.register_fake
def _(dp, hq, hs):
    return dp.new_empty((*dp.shape[:-1], 2 * dp.shape[-1])), dp.new_empty((), dtype=torch.float32)


def _swiglu_bwd_quantized_impl(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor,
                               fmt: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    get_format(fmt)
    if _kernel_ok(dp, hq, hs):
        return act_kernels.swiglu_bwd_quantized(dp, hq, hs, fmt)
    return swiglu_bwd_quantized_reference(dp, hq, hs, fmt)


@torch.library.triton_op("megacoat::fp8_swiglu_bwd_quantized", mutates_args=())
def _swiglu_bwd_quantized_op(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor,
                             fmt: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _swiglu_bwd_quantized_impl(dp, hq, hs, fmt)


@_swiglu_bwd_quantized_op.register_fake
def _(dp, hq, hs, fmt):
    f = dp.shape[-1]
    m = dp.numel() // f if f else 0
    dt = get_format(fmt).dtype
    return (dp.new_empty((m, 2 * f), dtype=dt), dp.new_empty((2 * f, m), dtype=dt),
            dp.new_empty((), dtype=torch.float32), dp.new_empty((), dtype=torch.float32))


def _act_fwd_impl(h: torch.Tensor, kind: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_act(kind)
    if _kernel_ok(h):
        return act_kernels.act_fwd(h, kind)
    return act_fwd_reference(h, kind)


@torch.library.triton_op("megacoat::fp8_act_fwd", mutates_args=())
def _act_fwd_op(h: torch.Tensor, kind: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _act_fwd_impl(h, kind)


def _act_fwd(h, kind):
    """Eager: the implementation itself (no custom-op dispatch cost); compiled: the opaque op."""
    return (_act_fwd_op if is_compiling() else _act_fwd_impl)(h, kind)


@_act_fwd_op.register_fake
def _(h, kind):
    return (h.new_empty(h.shape), h.new_empty((), dtype=torch.float32),
            h.new_empty(h.shape, dtype=torch.float8_e4m3fn),
            h.new_empty((*h.shape[:-1], (h.shape[-1] + 15) // 16), dtype=torch.bfloat16))


def _act_bwd_impl(dy: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor, kind: str) -> torch.Tensor:
    _check_act(kind)
    if _kernel_ok(dy, hq, hs):
        return act_kernels.act_bwd(dy.contiguous(), hq, hs, kind)
    return act_bwd_reference(dy, hq, hs, kind)


@torch.library.triton_op("megacoat::fp8_act_bwd", mutates_args=())
def _act_bwd_op(dy: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor, kind: str) -> torch.Tensor:
    return _act_bwd_impl(dy, hq, hs, kind)


def _act_bwd(dy, hq, hs, kind):
    """Eager: the implementation itself (no custom-op dispatch cost); compiled: the opaque op."""
    return (_act_bwd_op if is_compiling() else _act_bwd_impl)(dy, hq, hs, kind)


@_act_bwd_op.register_fake
def _(dy, hq, hs, kind):
    return dy.new_empty(dy.shape)


# ----------------------------------------------------------------------------- autograd
class _Fp8Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, grad_amax_token):
        stream, y, amax, xq, xs, rstd, mean = _norm_fwd(x, residual, weight, bias, eps, rms)
        ctx.save_for_backward(xq, xs, rstd, mean, weight)
        ctx.rms, ctx.has_bias, ctx.has_residual = rms, bias is not None, residual is not None
        ctx.has_token = grad_amax_token is not None
        ctx.mark_non_differentiable(amax)
        ctx.set_materialize_grads(False)
        return stream, y, amax

    @staticmethod
    def backward(ctx, g_stream, g_y, _g_amax):
        xq, xs, rstd, mean, weight = ctx.saved_tensors
        if g_y is None:
            g_y = torch.zeros(xq.shape, dtype=weight.dtype, device=xq.device)
        # The stream's own gradient joins dx inside the kernel (fp32 add, one rounding).
        dres = g_stream if ctx.has_residual else None
        dx, dw, db, dx_amax = _norm_bwd(g_y, xq, xs, rstd, mean, weight, ctx.has_bias, ctx.rms, dres, ctx.has_token)
        # The token's "gradient" is max |dx|: the FP8 linear that made x receives it with x's gradient.
        return (dx, (dx if ctx.has_residual else None), dw, (db if ctx.has_bias else None), None, None,
                (dx_amax if ctx.has_token else None))


def fp8_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, rms: bool,
             residual: Optional[torch.Tensor] = None, grad_amax_token: Optional[torch.Tensor] = None):
    """-> (stream, y, y_amax). `stream` is `x + residual` (or `x` itself without a residual).

    `grad_amax_token`: the token an FP8 linear returned with `x` (`fp8_linear(..., grad_amax_token=True)`): the
    norm's backward returns max |dx| as the token's gradient, so that linear casts dx without an amax pass. Only
    when dx is exactly the gradient of that linear's output (x goes nowhere else: no dropout in between)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"norm weight of size {weight.shape[-1]} does not match the hidden size {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from the input's {tuple(x.shape)}")
    if grad_amax_token is not None and residual is None:
        # Without the fused residual, x's gradient is dx plus whatever x's other users give it.
        raise ValueError("fp8_norm's grad_amax_token needs the fused residual (x must have no other user)")
    stream, y, amax = _Fp8Norm.apply(x, residual, weight, bias, float(eps), bool(rms), grad_amax_token)
    return (stream if residual is not None else x), y, amax


class _Fp8SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        p, amax, hq, hs = _swiglu_fwd(h)
        ctx.save_for_backward(hq, hs)
        ctx.mark_non_differentiable(amax)
        return p, amax

    @staticmethod
    def backward(ctx, dp, _g_amax):
        hq, hs = ctx.saved_tensors
        return _swiglu_bwd(dp, hq, hs)[0]


def swiglu_forward_saving_fp8(h: torch.Tensor):
    """The fused SwiGLU forward for a caller that does its own autograd (the FP8 linear with a fused
    activation): -> (p, p_amax, hq, hs), hq/hs to be saved for `swiglu_backward_with_amax`."""
    _split_gate_up(h)
    return _swiglu_fwd(h)


def swiglu_backward_with_amax(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor):
    """-> (dh, max |dh|) from the saved FP8 gate and up."""
    return _swiglu_bwd(dp, hq, hs)


def swiglu_backward_quantized(dp: torch.Tensor, hq: torch.Tensor, hs: torch.Tensor, fmt: str):
    """-> (gq, gqt, scale): the SwiGLU's input gradient as per-tensor FP8 (`fmt`) codes in both layouts, for
    the FP8 linear whose output went through the SwiGLU; the bf16 gradient is never written (on the GPU: an
    amax pass and a cast that recomputes it, bit for bit the codes of `swiglu_backward_with_amax` + the cast)."""
    out = (_swiglu_bwd_quantized_op if is_compiling() else _swiglu_bwd_quantized_impl)(dp, hq, hs, fmt)
    return out[0], out[1], out[2]


def fp8_swiglu(h: torch.Tensor):
    """silu(gate) * up of h = [gate; up] along the last dim -> (product, its amax)."""
    _split_gate_up(h)
    return _Fp8SwiGLU.apply(h)


class _Fp8Act(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, kind):
        y, amax, hq, hs = _act_fwd(h, kind)
        ctx.save_for_backward(hq, hs)
        ctx.kind = kind
        ctx.mark_non_differentiable(amax)
        return y, amax

    @staticmethod
    def backward(ctx, dy, _g_amax):
        hq, hs = ctx.saved_tensors
        return _act_bwd(dy, hq, hs, ctx.kind), None


def fp8_activation(h: torch.Tensor, kind: str):
    """SiLU or GELU (tanh) -> (y, its amax); saves h as E4M3 1x16."""
    _check_act(kind)
    return _Fp8Act.apply(h, kind)
