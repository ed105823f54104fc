"""A recipe's operations of a transformer layer besides attention: norms, residual adds, the MLP activation, and
which FP8 implementation each linear gets. The layer calls the same operations under every recipe
(model/transformer.py); what differs lives here.

- `LayerOps` (bf16, fp32, and FP8 `tensorwise`): torch's norms, adds and activations; under `tensorwise` the
  linears run FP8 GEMMs (precision/linear.py) and the fused RoPE hands the QKV linear its gradient amax.
- `CoatLayerOps` (FP8 `coat`): COAT's fused ops with FP8 saved tensors (precision/activations.py). A norm emits
  its output with its amax for the FP8 linear that follows (`Handoff`); a residual add whose sum goes into a norm is
  left to that norm's kernel (`PendingAdd`: the norm adds them, and its backward adds the two residual gradients in
  fp32 with one rounding); the projection and fc2 hand their output with a grad-amax token to that add, whose
  backward returns the output gradient's amax (no amax pass in those linears' backward); fc1 runs the SwiGLU in its
  own autograd node and hands fc2 the product with its amax.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .activations import fp8_activation, fp8_norm
from .handoff import Activation, Handoff, PendingAdd, add, split
from .linear import Fp8LinearImpl
from .recipe import Fp8Recipe

# Consumers of a linear's output that can return the amax of its gradient (LayerOps.linear_impl):
ROPE = "rope"          # the fused RoPE over the QKV output (model/rope.py)
RESIDUAL = "residual"  # the residual add, straight after the linear (no dropout in between)


class LayerOps:
    """bf16 / fp32 layers, and FP8 `tensorwise` (FP8 GEMMs in the linears; norms, adds, activations in bf16)."""

    # The residual add whose sum goes into the next layer's input norm may be left to that norm (`PendingAdd`).
    defers_residual_add = False
    # The consumers whose backward in this recipe returns the amax of their input's gradient.
    _token_consumers = (ROPE,)

    def __init__(self, fp8: Optional[Fp8Recipe] = None, device=None):
        self.fp8, self.device = fp8, device

    def linear_impl(self, output_to: Optional[str] = None) -> Optional[Fp8LinearImpl]:
        """What a Column/RowParallelLinear runs instead of F.linear (None: F.linear). `output_to`: the op that takes
        the linear's output (ROPE, RESIDUAL or None); where this recipe's version of it returns the output
        gradient's amax, the linear hands its output with a token (`Handoff`)."""
        if self.fp8 is None:
            return None
        return Fp8LinearImpl(self.fp8, self.device, with_token=output_to in self._token_consumers)

    def norm(self, norm, x):
        """-> (residual stream, normalized x). `norm`: the layer's Norm module (weight, bias, eps, rms)."""
        return x, norm(x)

    def residual_add(self, stream: torch.Tensor, branch: Activation, into_norm: bool):
        """stream + branch. `into_norm`: the sum goes into a norm next (which may add it: `defers_residual_add`)."""
        return stream + branch

    def linear_activation(self, linear, x: Activation, kind: str) -> Activation:
        """kind(linear(x)): "swiglu" (silu(gate) * up of the output [gate; up]) or "gelu" (tanh approximation)."""
        h = linear(x)
        if kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")


class CoatLayerOps(LayerOps):
    """COAT: fused FP8 norms and activations, residual adds inside the norms, amax hand-offs to the FP8 linears."""

    defers_residual_add = True
    _token_consumers = (ROPE, RESIDUAL)

    def norm(self, norm, x):
        if isinstance(x, PendingAdd):
            stream, y, y_amax = fp8_norm(x.branch, norm.weight, norm.bias, norm.eps, norm.rms, residual=x.stream,
                                         grad_amax_token=x.token)
        else:
            stream, y, y_amax = fp8_norm(x, norm.weight, norm.bias, norm.eps, norm.rms)
        return stream, Handoff(y, amax=y_amax)

    def residual_add(self, stream, branch, into_norm):
        value, _, token = split(branch)
        if into_norm:
            return PendingAdd(stream, value, token)
        return add(stream, value, token)

    def linear_activation(self, linear, x, kind):
        if kind == "swiglu":  # in fc1's autograd node, which then gets its output gradient's amax for free
            return linear(x, activation="swiglu")
        y, y_amax = fp8_activation(linear(x), "gelu")
        return Handoff(y, amax=y_amax)


def layer_ops(fp8: Optional[Fp8Recipe], device=None) -> LayerOps:
    """The operations of `fp8`'s layers (None: bf16 / fp32)."""
    if fp8 is not None and fp8.fp8_activations:
        return CoatLayerOps(fp8, device)
    return LayerOps(fp8, device)
