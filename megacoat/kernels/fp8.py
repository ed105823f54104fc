"""Launchers of the Triton FP8 quantizers (kernels/triton/fp8_quant.py).

Same signatures as the references in `megacoat.precision.fp8`, which decides when to call them
(CUDA tensors and Triton importable). Triton is imported lazily: this module imports without it.
Set MEGACOAT_NO_TRITON=1 to force the references.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from . import TraceableKernels, triton_available

# Kept here (the lower layer) so that precision/fp8.py and these launchers share one definition.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EPS = 1e-12
# The weight refresh's many-tensor amax (MultiCastPlan): BLOCK elements per block, ITERS blocks per program.
AMAX_BLOCK = 4096
AMAX_ITERS = 4
# Tile sizes and warps per kernel: cast (rows, cols, num_warps); 1x16 kernels (rows, 16-groups,
# num_warps, split: threads per group, 1 or 2; see kernels/triton/fp8_quant.py). A dict so that
# benchmarks/fp8_bench.py can sweep them on the GPU; the values here are the ones in use (1x16: the winners of
# `benchmarks/fp8_bench.py --parts tiles` on an H200).
# cast: 128x128 tiles so that each row of the transposed copy is written 128 bytes at a time.
# amax: (elements per block, blocks per program (unrolled: every load in flight at once), num_warps).
TILES = {"cast": (128, 128, 8), "quantize_1x16": (4, 64, 4, 1), "dequantize_1x16": (4, 64, 4, 1),
         "amax": (4096, 4, 8)}
SCALE_DTYPE_1X16 = torch.bfloat16  # group scales, rounded up (see kernels/triton/fp8_quant.py)


def fp8_gemm_reference(a: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sb: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """(a * sa) @ (bt * sb)^T in fp32 from the FP8 codes: the exact emulation of an FP8 GEMM (here, the
    lower layer, so that the FP8 linear and the weight-gradient GEMM's reference share it)."""
    return torch.mm(a.float() * sa, (bt.float() * sb).t()).to(out_dtype)


def available() -> bool:
    """Triton kernels can run (devices are checked by callers)."""
    return triton_available()


@lru_cache(maxsize=None)  # one module wrapper: its launchers (and their wrap_triton objects) are reused
def _k():
    from .triton import fp8_quant
    return TraceableKernels(fp8_quant)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous [M, K] matrix (K = last dim)."""
    x = x.contiguous()
    return x.view(-1, x.shape[-1]) if x.dim() != 2 else x


def amax_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (a zeroed fp32 scalar) = max |x|: one launch, an atomic max per program."""
    x = x.contiguous().view(-1)
    block, iters, warps = TILES["amax"]
    _k().amax_kernel[(triton_cdiv(x.numel(), block * iters),)](x, out, x.numel(), BLOCK=block, ITERS=iters,
                                                               num_warps=warps)
    return out


def amax(x: torch.Tensor) -> torch.Tensor:
    return amax_into(x, torch.zeros((), dtype=torch.float32, device=x.device))


def cast_tensorwise(x: torch.Tensor, amax: torch.Tensor, fmt: str, transpose: bool, rowwise: bool = True,
                    out=None):
    """-> (q or empty, q of x.T or empty, fp32 scale): the scale is computed from `amax` inside the kernel.
    `rowwise=False`: only the transposed copy (q comes back empty). `out`: the (q, qt, scale) tensors to
    write (a weight cache's buffers), else new ones."""
    if not (rowwise or transpose):
        raise ValueError("cast_tensorwise with rowwise=False and transpose=False writes nothing")
    x2 = _rows(x)
    m, k = x2.shape
    dt = FP8_DTYPE[fmt]
    if out is None:
        q = torch.empty((m, k) if rowwise else (0,), dtype=dt, device=x.device)
        qt = torch.empty((k, m) if transpose else (0,), dtype=dt, device=x.device)
        scale = torch.empty((), dtype=torch.float32, device=x.device)
    else:
        q, qt, scale = out
        _check_out(q, (m, k) if rowwise else None, dt, "q")
        _check_out(qt, (k, m) if transpose else None, dt, "qt")
        _check_out(scale, (), torch.float32, "scale")
    bm, bk, warps = TILES["cast"]
    grid = (triton_cdiv(m, bm), triton_cdiv(k, bk))
    _k().cast_kernel[grid](x2, amax, scale, q if rowwise else qt, qt if transpose else q, m, k, x2.stride(0),
                           FMAX=FP8_MAX[fmt], EPS=EPS, TRANSPOSE=transpose, BM=bm, BK=bk, ROWWISE=rowwise,
                           num_warps=warps)
    return (q.view(x.shape) if rowwise else q), qt, scale


def _check_out(t: torch.Tensor, shape, dtype: torch.dtype, name: str) -> None:
    """An output buffer the kernel writes: the expected shape (None: not written), dtype, contiguous."""
    if shape is not None and (tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous()):
        raise ValueError(f"FP8 cast output {name}: expected a contiguous {dtype} tensor of shape {tuple(shape)}, "
                         f"got {t.dtype} {tuple(t.shape)}")


class MultiCastPlan:
    """The descriptor tables with which `quantize_tensorwise_many` quantizes a fixed set of contiguous 2-D
    tensors into fixed buffers in two launches (after one zero-fill): per tensor its address, size and
    output addresses; per program its tensor and block (amax) or tile (cast). Built once and reused while
    `key` (the addresses and shapes) stays the same: the weights of a model and their FP8 caches."""

    def __init__(self, xs, qs, qts, scales, fmt: str):
        if not xs:
            raise ValueError("quantize_tensorwise_many needs at least one tensor")
        dev, dt, qdt = xs[0].device, xs[0].dtype, FP8_DTYPE[fmt]
        for i, (x, q, qt, s) in enumerate(zip(xs, qs, qts, scales)):
            if x.dim() != 2 or not x.is_contiguous() or x.dtype != dt or x.device != dev:
                raise ValueError(f"quantize_tensorwise_many: tensor {i} must be a contiguous 2-D {dt} tensor on {dev}, "
                                 f"got {x.dtype} {tuple(x.shape)} on {x.device}")
            _check_out(q, tuple(x.shape), qdt, "q")
            _check_out(qt, (x.shape[1], x.shape[0]), qdt, "qt")
            _check_out(s, (), torch.float32, "scale")
        self.fmt, self.x_dtype = fmt, dt
        self.key = self.key_of(xs, qs, qts, scales, fmt)
        bm, bk, _ = TILES["cast"]
        per_prog = AMAX_BLOCK * AMAX_ITERS
        amax_t, amax_b, cast_t, cast_tile = [], [], [], []
        for t, x in enumerate(xs):
            m, k = x.shape
            progs = triton_cdiv(x.numel(), per_prog)
            amax_t += [t] * progs
            amax_b += [i * AMAX_ITERS for i in range(progs)]
            tiles = triton_cdiv(m, bm) * triton_cdiv(k, bk)
            cast_t += [t] * tiles
            cast_tile += list(range(tiles))

        def table(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev)

        self.x_table = table([x.data_ptr() for x in xs], torch.int64)
        self.q_table = table([q.data_ptr() for q in qs], torch.int64)
        self.qt_table = table([qt.data_ptr() for qt in qts], torch.int64)
        self.scale_table = table([s.data_ptr() for s in scales], torch.int64)
        self.numel = table([x.numel() for x in xs], torch.int64)
        self.m = table([x.shape[0] for x in xs], torch.int32)
        self.k = table([x.shape[1] for x in xs], torch.int32)
        self.amax_tensor, self.amax_block = table(amax_t, torch.int32), table(amax_b, torch.int32)
        self.cast_tensor, self.cast_tile = table(cast_t, torch.int32), table(cast_tile, torch.int32)
        self.amax = torch.zeros(len(xs), dtype=torch.float32, device=dev)  # max |x_t| of the last launch
        # Every address 16-byte aligned and every dim a multiple of 16 (model weights): vectorized accesses.
        self.aligned = all(t.data_ptr() % 16 == 0 for group in (xs, qs, qts) for t in group) and \
            all(d % 16 == 0 for x in xs for d in x.shape)
        # The tensors themselves: the tables hold their addresses, so they must outlive the plan.
        self._keep = (list(xs), list(qs), list(qts), list(scales))

    @staticmethod
    def key_of(xs, qs, qts, scales, fmt: str):
        return (fmt, tuple((x.data_ptr(), tuple(x.shape), x.dtype, q.data_ptr(), qt.data_ptr(), s.data_ptr())
                           for x, q, qt, s in zip(xs, qs, qts, scales)))


def quantize_tensorwise_many(plan: MultiCastPlan) -> None:
    """Every tensor of the plan quantized per tensor (just-in-time scale) into its q, qt and scale: the
    results of `cast_tensorwise(x, amax(x), fmt, True, out=(q, qt, scale))` per tensor, in two launches."""
    import triton.language as tl
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    q_dtype = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}[plan.fmt]
    plan.amax.zero_()
    _k().multi_amax_kernel[(plan.amax_tensor.numel(),)](
        plan.x_table, plan.numel, plan.amax_tensor, plan.amax_block, plan.amax, X_DTYPE=tl_dtype[plan.x_dtype],
        BLOCK=AMAX_BLOCK, ITERS=AMAX_ITERS, ALIGNED=plan.aligned, num_warps=8)
    bm, bk, warps = TILES["cast"]
    _k().multi_cast_kernel[(plan.cast_tensor.numel(),)](
        plan.x_table, plan.q_table, plan.qt_table, plan.scale_table, plan.m, plan.k, plan.cast_tensor,
        plan.cast_tile, plan.amax, X_DTYPE=tl_dtype[plan.x_dtype], Q_DTYPE=q_dtype, FMAX=FP8_MAX[plan.fmt],
        EPS=EPS, BM=bm, BK=bk, ALIGNED=plan.aligned, num_warps=warps)


def quantize_1x16(x: torch.Tensor, fmt: str):
    x2 = _rows(x)
    m, k = x2.shape
    g = triton_cdiv(k, 16)
    q = torch.empty((m, k), dtype=FP8_DTYPE[fmt], device=x.device)
    s = torch.empty((m, g), dtype=SCALE_DTYPE_1X16, device=x.device)
    bm, bg, warps, split = TILES["quantize_1x16"]
    _k().quantize_1x16_kernel[group_grid(m, g, bm, bg)](x2, q, s, m, k, g, x2.stride(0), FMAX=FP8_MAX[fmt], EPS=EPS,
                                                        BM=bm, BG=bg, SPLIT=split, num_warps=warps)
    return q.view(x.shape), s.view(*x.shape[:-1], g)


def dequantize_1x16(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    q2 = _rows(q)
    m, k = q2.shape
    g = triton_cdiv(k, 16)
    if scales.shape[-1] != g:
        raise ValueError(f"1x16 scales of shape {tuple(scales.shape)} do not match codes of shape {tuple(q.shape)}")
    s2 = scales.contiguous().view(-1, g)
    y = torch.empty((m, k), dtype=dtype, device=q.device)
    bm, bg, warps, split = TILES["dequantize_1x16"]
    _k().dequantize_1x16_kernel[group_grid(m, g, bm, bg)](q2, s2, y, m, k, g, BM=bm, BG=bg, SPLIT=split,
                                                          num_warps=warps)
    return y.view(q.shape)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (>= 1): a tl.arange length covering n."""
    return 1 << max(0, (n - 1).bit_length())


def group_grid(m: int, g: int, bm: int, bg: int):
    """The 1-D grid of the 1x16 tile kernels (`group_tile`: group blocks fastest)."""
    return (triton_cdiv(m, bm) * triton_cdiv(g, bg),)
