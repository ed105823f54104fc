"""Weight-gradient GEMM that accumulates straight into the main gradient (gradient-accumulation fusion).

`wgrad_accumulate_(main_grad, grad_output, inp, overwrite)` does `main_grad += grad_output^T @ inp` (both
flattened to 2-D over their leading dims), or `main_grad = ...` when the one-element CPU flag `overwrite`
is set (the first gradient of a step: no zeroing pass over the buffer, and the GEMM does not read the
stale values); the op clears the flag. On CUDA with bf16 operands and an fp32 `main_grad`, cuBLAS reads and
writes the fp32 buffer in the GEMM's epilogue (`torch.addmm(..., out_dtype=float32, out=main_grad)`):
no bf16 gradient tensor, no rounding of the micro-batch gradient to bf16, no separate add pass.
Elsewhere (CPU, older torch) the reference runs: the GEMM in the operands' dtype, then one add.

It is a custom op, so `torch.compile`d layers keep it as one opaque call in their backward graph. It returns
the placeholder weight gradient (uninitialised, the weight's shape and dtype: autograd needs a gradient for the
weight so that the optimizer's post-accumulate hook runs, and the hook ignores it), and it writes `main_grad`
and the flag WITHOUT declaring them mutated. Declared mutations of main_grad (views of one gradient bucket)
made AOTAutograd functionalize them: aliased mutated graph inputs, regenerated from a cloned synthetic base
in the layer's forward and copied back after its backward. On the H200 at TP=2 the compiled layers' gradients
then never reached the buffer (benchmarks/grad_snapshot.py: relative error 1.0 against eager for every layer
weight) and micro-batch 4 failed inside that clone kernel. An undeclared write is safe here: no compiled graph
reads main_grad, the op cannot be dropped (its output is the weight's gradient), and it runs before the hook
that reads the buffer.
The FP8 linear's weight-gradient op (precision/linear.py) follows the same rule.
"""
from __future__ import annotations

import torch


def require_main_grad_storage(main_grad: torch.Tensor) -> None:
    """A gradient bucket released between steps (its storage resized to 0) must be re-allocated before
    anything writes it: refuse loudly instead of writing into freed memory."""
    if main_grad.untyped_storage().nbytes() < (main_grad.storage_offset() + main_grad.numel()) * main_grad.element_size():
        raise RuntimeError("a gradient arrived for a parameter whose gradient buffer is released (its bucket was not "
                           "re-allocated before this backward: the model did not call its pre_backward_hook before "
                           "this module's backward; a module used outside GPTModel.forward?)")


def wgrad_accumulate_reference(main_grad: torch.Tensor, grad_output: torch.Tensor, inp: torch.Tensor,
                               overwrite: bool) -> None:
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = inp.reshape(-1, inp.shape[-1])
    if overwrite:
        torch.mm(g.t(), x, out=main_grad) if main_grad.dtype == g.dtype else main_grad.copy_(torch.mm(g.t(), x))
    elif main_grad.dtype == g.dtype:
        main_grad.addmm_(g.t(), x)
    else:
        main_grad.add_(torch.mm(g.t(), x))


class _FusedSupport:
    """Whether this torch/device can write a mixed-dtype GEMM into `main_grad` (found out once per run)."""

    ok = None


def wgrad_accumulate_fused(main_grad: torch.Tensor, grad_output: torch.Tensor, inp: torch.Tensor,
                           overwrite: bool) -> bool:
    """The fused CUDA path; False when it is not available (the caller then runs the reference)."""
    if not main_grad.is_cuda or _FusedSupport.ok is False:
        return False
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = inp.reshape(-1, inp.shape[-1])
    try:
        torch.addmm(main_grad, g.t(), x, beta=0 if overwrite else 1, out_dtype=main_grad.dtype, out=main_grad)
    except (TypeError, RuntimeError, NotImplementedError):
        _FusedSupport.ok = False  # torch without addmm(out_dtype=...): fall back for the rest of the run
        return False
    _FusedSupport.ok = True
    return True


def placeholder_grad(main_grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight gradient autograd receives when the real one went into main_grad (never read)."""
    return torch.empty(main_grad.shape, dtype=dtype, device=main_grad.device)


def _wgrad_accumulate_impl(main_grad: torch.Tensor, grad_output: torch.Tensor, inp: torch.Tensor,
                           overwrite: torch.Tensor) -> None:
    require_main_grad_storage(main_grad)
    first = bool(overwrite.item())  # a CPU flag: no device sync
    if main_grad.dtype == grad_output.dtype or not wgrad_accumulate_fused(main_grad, grad_output, inp, first):
        wgrad_accumulate_reference(main_grad, grad_output, inp, first)
    overwrite.fill_(False)


@torch.library.custom_op("megacoat::wgrad_accumulate", mutates_args=())
def wgrad_accumulate(main_grad: torch.Tensor, grad_output: torch.Tensor, inp: torch.Tensor,
                     overwrite: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """main_grad (+)= grad_output^T @ inp (the flag says which, and is cleared); returns the placeholder
    gradient of the weight. Writes main_grad and the flag undeclared (module doc)."""
    _wgrad_accumulate_impl(main_grad, grad_output, inp, overwrite)
    return placeholder_grad(main_grad, weight_dtype)


@wgrad_accumulate.register_fake
def _(main_grad, grad_output, inp, overwrite, weight_dtype) -> torch.Tensor:
    return placeholder_grad(main_grad, weight_dtype)
