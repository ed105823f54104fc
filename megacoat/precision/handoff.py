"""What an FP8 recipe hands from one operation of a layer to the next, besides the bf16 tensor itself.

- `Handoff(value, amax, token)`: a bf16 tensor with
  - `amax`: max |value|, reduced by the kernel that produced it (a fused norm or activation): the FP8 linear that
    takes `value` casts it with this amax instead of an amax pass of its own;
  - `token`: the grad-amax token of the FP8 linear that produced `value` (`fp8_linear(..., grad_amax_token=True)`):
    the operation that takes `value` returns max |d value| as the token's gradient, and that linear casts its output
    gradient with it instead of an amax pass. Every token must reach such an operation: in compiled code a token
    left behind gets zeros as its gradient, an amax of 0 that would saturate the whole gradient. `value_of` is the
    way out for an operation that cannot compute the amax itself: its backward reduces it (the pass the linear
    would otherwise make), so a handoff is never dropped by accident (it is not a tensor: using it as one fails).
- `PendingAdd(stream, branch, token)`: the residual add `stream + branch` left to the norm that follows it, whose
  kernel adds the two (and whose backward returns the branch's gradient amax for `token`).

Both are named tuples: they cross compiled layers' boundaries and recomputed groups' checkpoints as tuples do.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import fp8


class Handoff(NamedTuple):
    value: torch.Tensor
    amax: Optional[torch.Tensor] = None
    token: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.value.shape

    def view(self, *shape) -> "Handoff":
        """The same handoff with its value viewed (max |.| and the gradient's amax do not depend on the shape)."""
        return Handoff(self.value.view(*shape), self.amax, self.token)


class PendingAdd(NamedTuple):
    stream: torch.Tensor
    branch: torch.Tensor
    token: Optional[torch.Tensor] = None


Activation = Union[torch.Tensor, Handoff]


def split(x: Activation) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(value, amax or None, token or None) of a tensor or handoff; the caller takes over the token."""
    if isinstance(x, Handoff):
        return x.value, x.amax, x.token
    return x, None, None


def value_of(x: Activation) -> torch.Tensor:
    """The tensor of `x`; a token it carries gets its gradient amax from here (one amax pass in backward)."""
    value, _, token = split(x)
    return value if token is None else _GradAmaxHere.apply(value, token)


class _GradAmaxHere(torch.autograd.Function):
    """Identity on `value`; backward returns max |d value| as `token`'s gradient."""

    @staticmethod
    def forward(ctx, value, token):
        ctx.set_materialize_grads(False)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, g):
        return g, (None if g is None else fp8.amax(g))


class _ResidualAddGradAmaxHere(torch.autograd.Function):
    """stream + branch; backward also returns max |d branch| (= max |d sum|) as `token`'s gradient."""

    @staticmethod
    def forward(ctx, stream, branch, token):
        ctx.set_materialize_grads(False)
        return stream + branch

    @staticmethod
    def backward(ctx, g):
        return g, g, (None if g is None else fp8.amax(g))


def add(stream: torch.Tensor, branch: torch.Tensor, token: Optional[torch.Tensor]) -> torch.Tensor:
    """stream + branch, now; `token` (of the FP8 linear that produced branch) gets its gradient amax here."""
    return stream + branch if token is None else _ResidualAddGradAmaxHere.apply(stream, branch, token)
