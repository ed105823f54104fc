"""FP8 linear layers: forward, dgrad and wgrad GEMMs in FP8 with just-in-time
per-tensor scaling.

- Forward `y = x W^T`: x and W per-tensor E4M3, output bf16 (plus bias).
- dgrad `dx = g W`: g per-tensor E5M2 (hybrid) or E4M3, W^T from the weight cache.
- wgrad `dW = g^T x`: the transposed FP8 copies of g and x; with gradient-accumulation fusion the fp32
  result goes straight into `weight.main_grad` (the optimizer's gradient buffer): written by the GEMM
  itself on the step's first micro-batch (the optimizer's `main_grad_overwrite` flag), added after.

GEMMs run through `torch._scaled_mm` on sm_89+ GPUs when every dim is a multiple of 16; otherwise
(CPU, odd shapes, older GPUs) through an exact emulation: the same FP8 codes and scales,
dequantized to fp32 and multiplied in fp32 (same numerics up to accumulation order).

`_scaled_mm(a, b)` wants `a` row-major and `b` column-major; every GEMM here is written as
`a @ bt^T` with both `a` and `bt` row-major, so each operand's FP8 copy is made in the layout its
GEMM reads: x (fwd) and x^T (wgrad); g (dgrad) and g^T (wgrad), by one fused cast+transpose pass;
W (fwd) and W^T (dgrad) by the weight cache.

Saved for backward: under `coat` the transposed FP8 copy of x (1 byte/element) and its scale; under
`tensorwise` the bf16 x (its FP8 copies are remade in backward with the forward's scale).

Weight cache (`Fp8WeightCache`): the FP8 weight, its transpose and scale are made once per optimizer
step and reused by every micro-batch (`--fp8-weight-cache`: kept unless a step of one micro-batch waits for
overlapped parameter gathers; not kept, the forward casts W and the backward W^T). They are refreshed outside
compiled code: the trainer invalidates them after each optimizer step and checkpoint load and, unless the
parameter all-gather overlaps the next forward, remakes them all right away (`Fp8WeightRefresher`: two
launches for every weight, while the GPU runs the optimizer); otherwise the model remakes each layer's
(its own refresher per layer) before that layer's forward. Eager calls also refresh when the weight's version counter
moved (in-place updates).

Sequence parallelism (`coat`): the column-parallel input is cast with one scale shared by the TP
group (a scalar max all-reduce), the FP8 codes are all-gathered (1 byte/element instead of 2) and
the backward reduce-scatters dx in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..kernels.fp8 import fp8_gemm_reference
from ..kernels.fp8_gemm import fp8_wgrad_gemm, lt_gemm_ops
from ..kernels.wgrad import placeholder_grad, require_main_grad_storage
from ..parallel.mappings import (all_gather_first, all_reduce, copy_to_tp_region, gather_from_sequence_parallel_region,
                                 gather_from_tp_region, group_size, reduce_scatter_first, scatter_to_tp_region)
from . import fp8
from .activations import swiglu_backward_quantized, swiglu_backward_with_amax, swiglu_forward_saving_fp8
from .handoff import Activation, Handoff, split, value_of
from .recipe import Fp8Recipe


# ----------------------------------------------------------------------------- GEMM
def device_has_fp8_gemm(device) -> bool:
    """sm_89+ CUDA device and a torch with `_scaled_mm`. Asked once per layer at construction: the
    answer is then a constant inside compiled code."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_ok(a: torch.Tensor, bt: torch.Tensor, hw: Optional[bool]) -> bool:
    if hw is None:
        hw = device_has_fp8_gemm(a.device)
    if not (hw and a.is_cuda):
        return False
    if a.dtype == torch.float8_e5m2 and bt.dtype == torch.float8_e5m2:
        return False  # cuBLAS has no e5m2 x e5m2 kernel
    return all(d % 16 == 0 for d in (*a.shape, bt.shape[0]))


def fp8_gemm(a: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
             fast_accum: bool = False, hw: Optional[bool] = None, candidates: int = 1, lt: bool = False) -> torch.Tensor:
    """a [M, K] @ bt [N, K]^T with per-tensor fp32 scales; both operands FP8 row-major. `hw`: whether
    the device has FP8 GEMMs (None: ask). Odd shapes (a dim not a multiple of 16) and e5m2 x e5m2 run
    the emulation. `lt`: the extension's ops exist (`lt_gemm_ops()`, asked outside compiled code): its C++ op
    runs the GEMM with a cached cuBLASLt algorithm, the fastest of `candidates` (--fp8-gemm-candidates);
    False: torch._scaled_mm."""
    if _scaled_mm_ok(a, bt, hw):
        if lt:
            return torch.ops.megacoat_lt.fp8_mm(a, sa.float().reshape(()), bt, sb.float().reshape(()), out_dtype,
                                                fast_accum, candidates)
        out = torch._scaled_mm(a, bt.t(), scale_a=sa.float().reshape(()), scale_b=sb.float().reshape(()),
                               out_dtype=out_dtype, use_fast_accum=fast_accum)
        return out[0] if isinstance(out, tuple) else out  # torch < 2.4 returned (out, amax)
    return fp8_gemm_reference(a, sa, bt, sb, out_dtype)


def _fp8_wgrad_impl(main_grad: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
               overwrite: torch.Tensor, hw: bool, candidates: int = 1) -> None:
    """main_grad (+)= (gqt * sg) @ (xqt * sx)^T in fp32. The one-element CPU flag `overwrite` (the
    optimizer's: this is the step's first gradient) makes the GEMM write main_grad straight from its
    epilogue (no temporary, no stale read); later micro-batches add in the epilogue too (cuBLASLt with
    beta = 1, `kernels/fp8_gemm.py`), or through a temporary and an add where that extension is missing.
    Clears the flag. A custom op: compiled backward graphs keep it whole and do not trace the flag's host read."""
    first = bool(overwrite.item())  # CPU tensor: no device sync
    require_main_grad_storage(main_grad)
    shape = main_grad.shape
    mg = main_grad.view(gqt.shape[0], xqt.shape[0])
    # The extension checks the problem itself (cheaper than here: this runs per micro-batch and linear).
    written = hw and main_grad.dtype == torch.float32 and fp8_wgrad_gemm(mg, gqt, sg, xqt, sx, accumulate=not first,
                                                                             candidates=candidates)
    if not written and main_grad.dtype == torch.float32 and _scaled_mm_ok(gqt, xqt, hw):
        if first and main_grad.is_contiguous() and scaled_mm_writes_out(gqt.device):
            try:
                torch._scaled_mm(gqt, xqt.t(), scale_a=sg.float().reshape(()), scale_b=sx.float().reshape(()),
                                 out_dtype=torch.float32, out=mg)
                written = True
            except (TypeError, RuntimeError):  # a torch without the out= variant: temporary + copy below
                written = False
    if not written:
        dw = fp8_gemm(gqt, sg, xqt, sx, torch.float32, hw=hw)
        if first:
            mg.copy_(dw)
        else:
            mg.add_(dw)
    assert main_grad.shape == shape
    overwrite.fill_(False)


def scaled_mm_writes_out(device) -> bool:
    """Whether this torch's `_scaled_mm` takes `out=` (asked once per device: a failing call inside
    every backward would cost a raised exception each time)."""
    device = torch.device(device)
    return _scaled_mm_out_probe(device.type, device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _scaled_mm_out_probe(device_type: str, index: int) -> bool:
    dev = torch.device(device_type, index)
    a = torch.zeros(16, 16, device=dev, dtype=torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                         out=torch.empty(16, 16, device=dev))
        return True
    except (TypeError, RuntimeError):
        return False


@torch.library.custom_op("megacoat::fp8_wgrad", mutates_args=())
def _fp8_wgrad_op(main_grad: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                  overwrite: torch.Tensor, hw: bool, weight_dtype: torch.dtype, candidates: int) -> torch.Tensor:
    """Writes main_grad and the flag undeclared and returns the placeholder weight gradient: declared
    mutations of bucket views break compiled layers (kernels/wgrad.py explains)."""
    _fp8_wgrad_impl(main_grad, gqt, sg, xqt, sx, overwrite, hw, candidates)
    return placeholder_grad(main_grad, weight_dtype)


@_fp8_wgrad_op.register_fake
def _(main_grad, gqt, sg, xqt, sx, overwrite, hw, weight_dtype, candidates) -> torch.Tensor:
    return placeholder_grad(main_grad, weight_dtype)


def fp8_wgrad(main_grad, gqt, sg, xqt, sx, overwrite, hw: bool, weight_dtype: torch.dtype,
              candidates: int = 1, lt: bool = False) -> torch.Tensor:
    """main_grad (+)= the FP8 weight gradient; returns the placeholder gradient of the weight. With the
    extension's ops (`lt`, see fp8_gemm) and a problem its GEMM takes: its C++ op; otherwise eager: the
    implementation (no custom-op dispatch cost); compiled: the opaque Python op."""
    if lt and main_grad.dtype == torch.float32 and main_grad.is_contiguous() and _scaled_mm_ok(gqt, xqt, hw):
        return torch.ops.megacoat_lt.fp8_wgrad(main_grad, gqt, sg.float().reshape(()), xqt, sx.float().reshape(()),
                                               overwrite, candidates, weight_dtype)
    if fp8.is_compiling():
        return _fp8_wgrad_op(main_grad, gqt, sg, xqt, sx, overwrite, hw, weight_dtype, candidates)
    _fp8_wgrad_impl(main_grad, gqt, sg, xqt, sx, overwrite, hw, candidates)
    return placeholder_grad(main_grad, weight_dtype)


# ----------------------------------------------------------------------------- weight cache
class Fp8WeightCache:
    """The FP8 copy of one weight (row-major W and W^T, one scale), remade when the weight changed.

    `persistent=False` keeps nothing between micro-batches: the forward casts W (amax + cast) and the
    backward casts W^T again with the forward's scale, as torchao does. That saves 2 bytes per weight
    element of memory at ~5 bytes per element of extra traffic per micro-batch (--fp8-weight-cache none, or
    auto with one micro-batch per step under --overlap-param-gather: recipe.keep_fp8_weights)."""

    def __init__(self, fmt: str, persistent: bool = True):
        self.fmt = fmt
        self.persistent = persistent
        self.wq = self.wqt = self.scale = self._amax = None
        self.stale = True
        self.version = None

    def invalidate(self) -> None:
        self.stale = True

    def needs_refresh(self, weight: torch.Tensor) -> bool:
        if not self.persistent:
            return False
        return self.stale or self.wq is None or self.version != (weight._version, weight.data_ptr())

    def buffers_for(self, weight: torch.Tensor):
        """(W, W^T, scale) buffers for this weight, allocated on first use. The same buffers every time:
        compiled graphs hold them as inputs (new objects would recompile), and quantizing in place saves a
        copy of W and of W^T per refresh."""
        w = weight.detach()
        if self.wq is None or self.wq.shape != w.shape or self.wq.device != w.device:
            dt = fp8.get_format(self.fmt).dtype
            self.wq = torch.empty(w.shape, dtype=dt, device=w.device)
            self.wqt = torch.empty((w.shape[1], w.shape[0]), dtype=dt, device=w.device)
            self.scale = torch.empty((), dtype=torch.float32, device=w.device)
            self._amax = torch.empty((), dtype=torch.float32, device=w.device)
        return self.wq, self.wqt, self.scale

    def mark_fresh(self, weight: torch.Tensor) -> None:
        self.version = (weight._version, weight.data_ptr())
        self.stale = False

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor) -> None:
        self.buffers_for(weight)
        fp8.quantize_tensorwise_into(weight.detach(), self.fmt, self.wq, self.wqt, self.scale, self._amax)
        self.mark_fresh(weight)


# ----------------------------------------------------------------------------- autograd
@dataclass(frozen=True)
class _Opts:
    fwd_fmt: str
    grad_fmt: str
    save_fp8: bool           # coat: save x^T in FP8; tensorwise: save bf16 x
    sp_group: object         # column-parallel input gathered over this group (SP), or None
    has_main_grad: bool
    hw_gemm: bool            # the device has FP8 GEMMs (decided outside compiled code)
    activation: Optional[str] = None  # "swiglu": the output goes through the fused FP8 SwiGLU (coat)
    grad_amax_token: bool = False  # also return a token whose gradient is max |output gradient| (see fp8_linear)
    gemm_candidates: int = 1  # cuBLASLt algorithms timed per GEMM shape (--fp8-gemm-candidates)
    lt: bool = False  # the extension's GEMM ops exist (kernels.fp8_gemm.lt_gemm_ops); False: _scaled_mm


# torch versions whose dynamo traces the FP8 linear's own SP collectives (verified: 2.13 on CPU; 2.11 fails).
_FP8_GATHER_COMPILES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def _gather_fp8_rows(q: torch.Tensor, group) -> torch.Tensor:
    """All-gather FP8 codes along dim 0 (as uint8: gloo and older NCCL reject fp8 dtypes)."""
    return all_gather_first(q.contiguous().view(torch.uint8), group).view(q.dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_amax, weight, bias, wq, wqt, w_scale, main_grad, overwrite, opts: _Opts):
        # Every amax and scale stays on the device: each quantization is one kernel reading the amax
        # tensor (no host sync, no eager scale arithmetic).
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        amax = fp8.amax(x2) if x_amax is None else x_amax
        if opts.sp_group is not None:
            # One scale for the gathered x (a copy: x_amax may be the producer's tensor).
            amax = all_reduce(amax.float().clone(), opts.sp_group, dist.ReduceOp.MAX)
            xq_local, _, sx = fp8.cast_tensorwise(x2, amax, opts.fwd_fmt, False)
            xq = _gather_fp8_rows(xq_local, opts.sp_group)
            xqt = xq.t().contiguous() if opts.save_fp8 else None
            lead = (x.shape[0] * group_size(opts.sp_group), *x.shape[1:-1])
        else:
            xq, xqt, sx = fp8.cast_tensorwise(x2, amax, opts.fwd_fmt, opts.save_fp8)
            lead = x.shape[:-1]
        transient = wq is None
        w_amax = None
        if transient:  # no cache: cast W now, W^T again in backward (only the bf16 weight is kept)
            w_amax = fp8.amax(weight.detach())
            wq, _, w_scale = fp8.cast_tensorwise(weight.detach(), w_amax, opts.fwd_fmt, False)
        y = fp8_gemm(xq, sx, wq, w_scale, x.dtype, fast_accum=True, hw=opts.hw_gemm, candidates=opts.gemm_candidates,
                     lt=opts.lt)
        if bias is not None:
            y = y + bias
        act_saved = (None, None)
        if opts.activation == "swiglu":
            # The SwiGLU in the same autograd node: its backward hands this linear's backward the amax
            # of the output gradient it produced, so that cast needs no amax pass.
            y, y_amax, hq, hs = swiglu_forward_saving_fp8(y)
            act_saved = (hq, hs)
        # coat: the transposed FP8 copy; tensorwise: the bf16 input (gathered in bf16 by the layer
        # under SP, as Megatron saves it) and its amax (backward recasts it with the same scale).
        ctx.save_for_backward(xqt if opts.save_fp8 else x2, sx, amax if not opts.save_fp8 else None,
                              weight if transient else wqt, w_scale, w_amax, *act_saved)
        ctx.transient = transient
        # Not saved tensors: other micro-batches write into them between this forward and its backward.
        ctx.main_grad, ctx.overwrite = main_grad, overwrite
        ctx.opts, ctx.has_bias, ctx.in_shape = opts, bias is not None, x.shape
        ctx.w_meta = (weight.shape, weight.dtype)
        ctx.out_dtype = x.dtype  # dx's (g's before the fused SwiGLU backward, which returns no bf16 g)
        if opts.activation is not None:
            ctx.mark_non_differentiable(y_amax)
            return y.view(*lead, y.shape[-1]), y_amax
        if opts.grad_amax_token:
            # Never read: its gradient, from the consumer's backward, is the amax of this output's gradient. Not
            # materialized: in eager code an unused token's gradient arrives as None (-> the amax pass). Compiled
            # code's outer autograd node fills a missing gradient with zeros, which would read as amax 0 and
            # saturate the whole gradient: every token must reach a consumer.
            ctx.set_materialize_grads(False)
            return y.view(*lead, y.shape[-1]), torch.empty((), dtype=torch.float32, device=y.device)
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, g, *extra):
        opts = ctx.opts
        x_saved, sx, x_amax, wqt, w_scale, w_amax, hq, hs = ctx.saved_tensors
        # The token's gradient: max |g|, computed by the consumer that produced g (None: not given).
        g_amax = extra[0] if opts.grad_amax_token else None
        if g is None:  # (only without materialized gradients) the output was not used
            return (None,) * 10
        g2 = None
        if opts.activation == "swiglu" and not ctx.has_bias:
            # The SwiGLU's gradient straight to FP8 in both layouts: its bf16 copy is never written or read.
            gq, gqt, sg = swiglu_backward_quantized(g.reshape(-1, g.shape[-1]).contiguous(), hq, hs, opts.grad_fmt)
        else:
            if opts.activation == "swiglu":  # the bias gradient needs the bf16 gradient
                g, g_amax = swiglu_backward_with_amax(g.reshape(-1, g.shape[-1]).contiguous(), hq, hs)
            g2 = g.reshape(-1, g.shape[-1])
            gq, gqt, sg = fp8.quantize_tensorwise(g2, opts.grad_fmt, transpose=True, amax_value=g_amax)
        if ctx.transient:  # the saved tensor is the bf16 weight: its W^T codes with the forward's scale
            _, wqt, _ = fp8.cast_tensorwise(wqt.detach(), w_amax, opts.fwd_fmt, True, rowwise=False)
        dx = fp8_gemm(gq, sg, wqt, w_scale, ctx.out_dtype, hw=opts.hw_gemm, candidates=opts.gemm_candidates, lt=opts.lt)
        if opts.sp_group is not None:
            dx = reduce_scatter_first(dx, opts.sp_group)
        dx = dx.view(ctx.in_shape)
        if opts.save_fp8:
            xqt = x_saved
        else:
            _, xqt, _ = fp8.cast_tensorwise(x_saved, x_amax, opts.fwd_fmt, True, rowwise=False)
        w_shape, w_dtype = ctx.w_meta
        if opts.has_main_grad:
            dw = fp8_wgrad(ctx.main_grad, gqt, sg, xqt, sx, ctx.overwrite, opts.hw_gemm, w_dtype,  # placeholder
                           opts.gemm_candidates, opts.lt)
        else:
            dw = fp8_gemm(gqt, sg, xqt, sx, w_dtype, hw=opts.hw_gemm, candidates=opts.gemm_candidates,
                          lt=opts.lt).view(w_shape)
        db = g2.sum(0) if ctx.has_bias else None
        return dx, None, dw, db, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cache: Fp8WeightCache,
               recipe: Fp8Recipe, x_amax: Optional[torch.Tensor] = None, sp_group=None,
               fuse_wgrad: bool = False, hw_gemm: Optional[bool] = None, activation: Optional[str] = None,
               grad_amax_token: bool = False, lt_gemm: bool = False):
    """y = x W^T + b in FP8. `x_amax`: max |x| if the producer emitted it (saves the amax pass).
    `sp_group`: gather x over this group first (column-parallel under SP; coat gathers FP8).
    `activation="swiglu"` (coat): returns (silu(gate) * up of y = [gate; up], its amax) through the fused
    FP8 SwiGLU, whose backward gives this linear its output gradient's amax.
    `grad_amax_token=True`: returns (y, token). Hand the token to the one consumer of y that computes y's whole
    gradient (`fp8_norm(y, ..., residual=r, grad_amax_token=token)`, the fused RoPE over a QKV output
    `rope_qkv(Handoff(qkv, token=token), cos, sin)`, or precision/handoff.py's `add` and `value_of`): its backward
    returns max |dy| as the token's gradient, and this linear's backward casts dy with it instead of an amax pass of
    its own. Every token must reach such a consumer: in eager code a dropped token's gradient is None and the linear
    makes its own pass, but inside torch.compile'd code it arrives as zeros (AOTAutograd materializes it), an amax of
    0 that would saturate the whole gradient.
    `lt_gemm`: the GEMMs run the extension's C++ ops (`Fp8LinearImpl` asks `lt_gemm_ops()` at construction)."""
    if activation not in (None, "swiglu"):
        raise ValueError(f"unknown fused activation {activation!r} of the FP8 linear: use None or 'swiglu'")
    if grad_amax_token and activation is not None:
        raise ValueError("the FP8 linear's grad_amax_token is for a plain output; the fused SwiGLU gives its own amax")
    if activation is not None and not recipe.fp8_activations:
        raise ValueError("the FP8 linear's fused SwiGLU saves FP8 activations: it belongs to the coat recipe")
    if not fp8.is_compiling() and cache.needs_refresh(weight):  # compiled callers refresh beforehand
        cache.refresh(weight)
    if hw_gemm is None:
        hw_gemm = device_has_fp8_gemm(x.device)
    main_grad = getattr(weight, "main_grad", None)
    overwrite = getattr(weight, "main_grad_overwrite", None)  # the optimizer's first-gradient-of-the-step flag
    fuse = (fuse_wgrad and main_grad is not None and overwrite is not None and weight.requires_grad
            and torch.is_grad_enabled())
    if sp_group is not None and not recipe.fp8_activations:
        raise ValueError("the FP8 gather under sequence parallelism is the coat recipe's; tensorwise gathers bf16")
    opts = _Opts(recipe.fwd_format, recipe.grad_format, recipe.fp8_activations, sp_group, fuse, hw_gemm, activation,
                 grad_amax_token, recipe.gemm_candidates, bool(lt_gemm and hw_gemm))
    return _Fp8LinearFn.apply(x, x_amax, weight, bias, cache.wq, cache.wqt, cache.scale,
                              main_grad if fuse else None, overwrite if fuse else None, opts)


# ----------------------------------------------------------------------------- module plumbing
class Fp8LinearImpl:
    """The FP8 forward of Column/RowParallelLinear under an FP8 recipe (handed to them by the model, so that
    parallel/ does not import precision/): the layer's tensor-parallel communication around `fp8_linear`.

    Inputs may be a `Handoff` with their producer's amax (the cast then needs no amax pass). `with_token`: the op
    that takes the output returns its gradient's amax (the model says so through `LayerOps.linear_impl`): the output
    comes as a `Handoff` with the linear's token where the output gradient is this rank's own (not through a
    gathered output, nor a row-parallel output under SP, whose gradient is gathered over TP)."""

    def __init__(self, recipe: Fp8Recipe, device=None, with_token: bool = False):
        self.recipe = recipe
        self.with_token = with_token
        self.hw_gemm = device_has_fp8_gemm(device) if device is not None else None
        # The extension's C++ GEMM ops: decided here, outside compiled code (loading them inside breaks the graph).
        self.lt_gemm = bool(self.hw_gemm) and lt_gemm_ops() is not None

    def make_cache(self) -> Fp8WeightCache:
        return Fp8WeightCache(self.recipe.fwd_format, persistent=self.recipe.cache_weights)

    def gathers_fp8(self, sequence_parallel: bool) -> bool:
        """Under SP, coat gathers the FP8 codes itself; tensorwise gathers bf16 (and saves it). Inside
        torch.compile on torch < 2.13 coat gathers bf16 too, through the SP region: torch 2.11's dynamo
        broke the graph at a collective inside this autograd function and then failed an internal assertion
        tracing the next FP8 linear (H200, TP=2 + SP, `test_compiled_tp2_sp_weight_gradients_run_in_backward_on_gpu`)."""
        if not (sequence_parallel and self.recipe.fp8_activations):
            return False
        return not torch.compiler.is_compiling() or _FP8_GATHER_COMPILES

    def _linear(self, x, layer, bias, x_amax, sp_group=None, activation=None, grad_amax_token=False):
        return fp8_linear(x, layer.weight, bias, layer.fp8_cache, self.recipe, x_amax=x_amax, sp_group=sp_group,
                          fuse_wgrad=layer.fuse_wgrad, hw_gemm=self.hw_gemm, activation=activation,
                          grad_amax_token=grad_amax_token, lt_gemm=self.lt_gemm)

    def column_parallel(self, layer, x: Activation, activation: Optional[str] = None):
        """ColumnParallelLinear's output (this rank's columns, or all of them with `gather_output`). `activation`
        ("swiglu", coat): the fused FP8 SwiGLU of the output, returned as a Handoff with its amax."""
        if activation is not None and layer.gather_output:
            raise ValueError(f"{layer.weight.global_name}: a fused activation needs a rank-local output "
                             "(gather_output=False)")
        x, x_amax = _input(x)
        with_token = self.with_token and activation is None and not layer.gather_output
        tp = group_size(layer.tp_group)
        if layer.sequence_parallel and self.gathers_fp8(True):
            # fp8_linear gathers the (FP8) input itself, with one scale for the whole group.
            y = self._linear(x, layer, layer.bias, x_amax, sp_group=layer.tp_group if tp > 1 else None,
                             activation=activation, grad_amax_token=with_token)
        else:
            if layer.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, layer.tp_group)
                x_amax = x_amax if tp == 1 else None  # a shard's amax is not the gathered tensor's
            else:
                x = copy_to_tp_region(x, layer.tp_group)
            y = self._linear(x, layer, layer.bias, x_amax, activation=activation, grad_amax_token=with_token)
        if activation is not None:
            return Handoff(*y)  # (product, its amax)
        if with_token:
            return Handoff(y[0], token=y[1])
        if layer.gather_output:
            y = gather_from_tp_region(y, layer.tp_group)
        return y

    def row_parallel(self, layer, x: Activation):
        """RowParallelLinear's output (summed over TP, or reduce-scattered along the sequence under SP)."""
        x, x_amax = _input(x)
        if not layer.input_is_parallel:
            x = scatter_to_tp_region(x, layer.tp_group)
            x_amax = None
        # Without SP the reduction's backward is the identity: every rank's GEMM gets the full output gradient.
        with_token = self.with_token and not layer.sequence_parallel
        y = self._linear(x, layer, None, x_amax, grad_amax_token=with_token)
        if with_token:
            y, token = y
        y = layer.reduce_output(y)
        return Handoff(y, token=token) if with_token else y


def _input(x: Activation):
    """(tensor, its amax or None) of a linear's input (a token on it gets its gradient amax in `value_of`)."""
    return value_of(x), split(x)[1]


def _fp8_caches(module: nn.Module):
    for m in module.modules():
        cache = getattr(m, "fp8_cache", None)
        if cache is not None and getattr(m, "weight", None) is not None:
            yield m, cache


def refresh_fp8_weights(module: nn.Module) -> None:
    """Remake the stale kept FP8 weight copies of the layers in `module` now (outside compiled code). A caller
    that refreshes the same module again and again keeps an `Fp8WeightRefresher` instead (its module walk and
    launch tables are made once)."""
    Fp8WeightRefresher(module)()


def fp8_weight_copy_bytes(module: nn.Module) -> int:
    """Bytes of the FP8 weight copies the layers in `module` keep (W and W^T at 1 byte per element, a scale)."""
    return sum(2 * m.weight.numel() + 4 for m, c in _fp8_caches(module) if c.persistent)


def allocate_fp8_weight_copies(module: nn.Module) -> None:
    """Allocate the kept FP8 weight copies now (filled at their first refresh): model-state memory measured
    at start-up then includes them."""
    for m, c in _fp8_caches(module):
        if c.persistent:
            c.buffers_for(m.weight)


class Fp8WeightRefresher:
    """Remakes the stale kept FP8 weight copies of a module at once (the trainer's for the whole model after each
    optimizer step; the model's per layer under --overlap-param-gather): on the GPU the weights of one format
    and dtype go through two launches in all (the per-tensor amax and the cast of every weight) instead of two
    per weight, and the Python work per fresh weight is a check (the module is walked once, here). Owns the
    launches' descriptor tables (rebuilt when a weight or buffer moves)."""

    def __init__(self, module: nn.Module):
        self.pairs = [(m, c) for m, c in _fp8_caches(module) if c.persistent]
        self._plans = {}

    @torch.no_grad()
    def __call__(self) -> None:
        groups = {}
        for m, c in self.pairs:
            if c.needs_refresh(m.weight):
                w = m.weight.detach()
                if w.dim() == 2 and w.is_contiguous():
                    groups.setdefault((c.fmt, w.dtype, w.device), []).append((m, c))
                else:  # one at a time (the batched kernels take contiguous 2-D weights)
                    c.refresh(m.weight)
        for key, members in groups.items():
            xs = [m.weight.detach() for m, _ in members]
            bufs = [c.buffers_for(m.weight) for m, c in members]
            self._plans[key] = fp8.quantize_tensorwise_many(xs, key[0], [b[0] for b in bufs], [b[1] for b in bufs],
                                                            [b[2] for b in bufs], self._plans.get(key))
            for m, c in members:
                c.mark_fresh(m.weight)


def release_fp8_weight_copies(module: nn.Module) -> int:
    """Stop keeping FP8 weight copies in the layers of `module`: from now on each casts W in its forward and W^T in
    its backward (--fp8-weight-cache none's path). Frees the copies' buffers; returns their bytes. Call it before
    the first forward: compiled layers trace whichever path the caches take then."""
    freed = fp8_weight_copy_bytes(module)
    for _, c in _fp8_caches(module):
        c.persistent = False
        c.wq = c.wqt = c.scale = c._amax = None
    for m in module.modules():  # caches made later (make_cache) keep nothing either
        impl = getattr(m, "linear_impl", None)
        if isinstance(impl, Fp8LinearImpl) and impl.recipe.cache_weights:
            impl.recipe = replace(impl.recipe, cache_weights=False)
    return freed


def invalidate_fp8_weights(module: nn.Module) -> None:
    """The weights changed (optimizer step, checkpoint load): remake the FP8 copies before next use."""
    for _, cache in _fp8_caches(module):
        cache.invalidate()
