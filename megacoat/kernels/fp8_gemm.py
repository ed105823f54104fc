"""FP8 GEMMs through cuBLASLt (`csrc/fp8_gemm.cpp`): out (+)= (a * sa) @ (b * sb)^T with an fp32 or bf16 output.

- `lt_gemm_ops()`: the extension's dispatcher ops the FP8 linear calls on a GPU (`megacoat_lt::fp8_mm`, the forward
  and dgrad GEMM; `megacoat_lt::fp8_wgrad`, the weight gradient written or added into main_grad), with their fake
  kernels for torch.compile. They keep the cuBLASLt algorithm per problem (timed among `--fp8-gemm-candidates`)
  and fall back to torch._scaled_mm inside, in C++.
- `fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate)`: the same GEMM called from Python, for the FP8 linear's
  Python weight-gradient path (no dispatcher ops: the layer was built without a device, or on a problem the
  C++ op is not given): out [N, K] (+)= (gqt [N, T] * sg) @ (xqt [K, T] * sx)^T, adding in the epilogue
  (beta = 1), where `torch._scaled_mm` can only overwrite its output. Returns False where the extension is
  missing or declines the problem (shapes, dtypes or alignment it cannot take, checked by the extension; or a
  problem cuBLASLt refused once, remembered for the run): the caller then runs `_scaled_mm` and an add.
- `fp8_wgrad_reference` (same signature): dequantize and multiply in fp32, the tests' oracle.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch

from .fp8 import fp8_gemm_reference


def fp8_wgrad_reference(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                        accumulate: bool) -> None:
    prod = fp8_gemm_reference(gqt, sg.float(), xqt, sx.float(), torch.float32)
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)


@lru_cache(maxsize=None)  # looked up once: this runs on every micro-batch of every linear
def cuda_extension():
    """The compiled cuBLASLt GEMM, or None (no CUDA, no toolkit: one warning)."""
    from .cuda_ext import load_extension
    return load_extension("fp8_gemm")


class _Refused:
    """Problems cuBLASLt refused (no algorithm for that shape, dtype pair and alignment on this GPU and
    library): each then runs the fallback for the rest of the run, after one warning, instead of failing
    every backward. Other problems keep the extension."""

    keys: set = set()


def _problem_key(out, gqt, xqt, accumulate):
    # out's alignment up to 256 bytes, as the extension's algorithm cache tells problems apart (it takes >= 16)
    return (tuple(gqt.shape), xqt.shape[0], gqt.dtype, xqt.dtype, out.data_ptr() % 256, accumulate, out.device)


def fp8_wgrad_gemm(out: torch.Tensor, gqt: torch.Tensor, sg: torch.Tensor, xqt: torch.Tensor, sx: torch.Tensor,
                   accumulate: bool, candidates: int = 1) -> bool:
    """Runs the extension when it exists and takes the problem; False otherwise (nothing written).

    The extension decides what it takes (csrc/fp8_gemm.cpp `takes`: every tensor on one GPU; out a
    contiguous fp32 [N, K]; gqt [N, T] and xqt [K, T] contiguous FP8, not both e5m2; N, K, T non-zero
    multiples of 16; one-element fp32 scales; every pointer 16-byte aligned) and returns False for the rest:
    in C++, because these checks in Python cost more host time than the launch, on every micro-batch of
    every linear. `candidates` > 1: the fastest of that many cuBLASLt algorithms, timed on the problem's first
    call (--fp8-gemm-candidates). A refusal (cuBLASLt has no algorithm for the problem) is remembered, with one
    warning."""
    ext = cuda_extension()  # None off-GPU
    if ext is None:
        return False
    if _Refused.keys and _problem_key(out, gqt, xqt, accumulate) in _Refused.keys:
        return False
    try:
        return ext.fp8_gemm(out, gqt, sg, xqt, sx, accumulate, False, candidates)
    except torch.OutOfMemoryError:
        raise  # a transient condition of this call, not a property of the problem
    except RuntimeError as e:
        if "megacoat fp8_gemm: " not in str(e):
            raise  # a CUDA error, not cuBLASLt refusing the problem (its checks come before the launch)
        _Refused.keys.add(_problem_key(out, gqt, xqt, accumulate))
        warnings.warn(f"megacoat: the FP8 weight-gradient GEMM extension refused a problem ({str(e)[:300]}); "
                      "that problem uses _scaled_mm and an add for the rest of this run (slower)", stacklevel=2)
        return False


@lru_cache(maxsize=None)
def lt_gemm_ops():
    """The extension's dispatcher ops (`torch.ops.megacoat_lt`: fp8_mm, the forward and dgrad GEMM; fp8_wgrad, the
    weight gradient into main_grad) with their fake kernels registered for torch.compile, or None where the
    extension is missing. Ask outside compiled code (at layer construction): asked inside, the import breaks the
    graph. C++ ops, not Python custom ops: a Python op's wrapper costs host time on every call. Measured without
    cProfile (fp8_bench.py --parts host, H200): fp8_mm 18 us of host per call, torch._scaled_mm 19 us."""
    if cuda_extension() is None:
        return None
    torch.library.register_fake("megacoat_lt::fp8_mm")(
        lambda a, sa, b, sb, out_dtype, fast_accum, candidates: a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype))
    torch.library.register_fake("megacoat_lt::fp8_wgrad")(
        lambda main_grad, gqt, sg, xqt, sx, overwrite, candidates, weight_dtype:
        main_grad.new_empty(main_grad.shape, dtype=weight_dtype))
    return torch.ops.megacoat_lt
