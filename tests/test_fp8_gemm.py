"""The cuBLASLt FP8 GEMM extension (kernels/fp8_gemm.py, csrc/fp8_gemm.cpp): the weight gradient added into the
fp32 gradient buffer, the forward/dgrad GEMM with a bf16 output, algorithm tuning, and the dispatcher ops the FP8
linear calls (megacoat_lt::fp8_mm, megacoat_lt::fp8_wgrad).

CPU: the reference against a float64 product of the same codes, and the dispatch (the extension is
never tried off-GPU; the FP8 linear's fallback then runs). GPU (marked): the extension against
the reference, overwrite and accumulate, e4m3 x e5m2 and e4m3 x e4m3, several shapes, bf16 outputs, tuned
algorithms; the FP8 linear's wgrad over three micro-batches (Python op and C++ op, eager and compiled). The
extension accumulates on the tensor cores with periodic fp32 promotion (no fast accumulation), the reference in
fp32: they agree to a fraction (2^-9) of sum |a||b|, while a wrong scale, layout or beta is off by ~100%.
"""
import warnings

import pytest
import torch

from megacoat.kernels import fp8_gemm as W
from megacoat.precision import fp8
from megacoat.precision import linear as L
from megacoat.precision.linear import _fp8_wgrad_impl


def _codes(shape, fmt, seed, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3.0
    x.view(-1)[::53] *= 40.0  # outliers
    q, _, s = fp8.quantize_tensorwise(x.to(torch.bfloat16), fmt)
    return q.to(device), s.to(device)


def _exact(out0, gqt, sg, xqt, sx, accumulate):
    prod = (gqt.double() * sg.double()) @ (xqt.double() * sx.double()).t()
    return (out0.double() + prod) if accumulate else prod


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", [(16, 32, 48), (40, 24, 8), (3, 5, 7)])
def test_reference_matches_float64(accumulate, shape):
    n, k, t = shape
    gqt, sg = _codes((n, t), "e5m2", 1)
    xqt, sx = _codes((k, t), "e4m3", 2)
    out = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    expect = _exact(out, gqt, sg, xqt, sx, accumulate)
    W.fp8_wgrad_reference(out, gqt, sg, xqt, sx, accumulate)
    scale = ((gqt.double().abs() * sg.double()) @ (xqt.double().abs() * sx.double()).t()).max()
    assert (out.double() - expect).abs().max() <= 1e-6 * float(scale) + 1e-6


def test_extension_never_runs_off_gpu():
    """CPU tensors: declined (off-GPU no extension exists; on a GPU machine the extension declines them)."""
    gqt, sg = _codes((16, 32), "e5m2", 4)
    xqt, sx = _codes((16, 32), "e4m3", 5)
    out = torch.full((16, 16), 7.0)
    assert W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate=True) is False
    assert torch.equal(out, torch.full((16, 16), 7.0))  # nothing written


def _declined_problems(dev):
    """Problems the extension does not take (csrc/fp8_gemm.cpp `takes`), each with its out [N, K]."""
    out = torch.zeros(32, 48, device=dev)
    gqt = torch.ones(32, 64, device=dev).to(torch.float8_e5m2)
    xqt = torch.ones(48, 64, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)

    def off16(shape, dtype, fill=1.0):  # contiguous, 1 byte past a 16-byte boundary
        n = shape[0] * shape[1]
        t = torch.empty(n + 16, dtype=torch.uint8, device=dev)[1:n + 1].view(dtype).view(shape)
        return t.copy_(torch.full(shape, fill, device=dev).to(dtype))

    return {
        "e5m2 x e5m2": (out, gqt, one, xqt.view(torch.float8_e5m2), one),
        "bf16 operand": (out, torch.ones(32, 64, device=dev, dtype=torch.bfloat16), one, xqt, one),
        "fp16 out": (torch.zeros(32, 48, device=dev, dtype=torch.float16), gqt, one, xqt, one),
        "N not a multiple of 16": (torch.zeros(24, 48, device=dev), gqt[:24].contiguous(), one, xqt, one),
        "T not a multiple of 16": (out, gqt[:, :40].contiguous(), one, xqt[:, :40].contiguous(), one),
        "T = 0": (out, gqt[:, :0].contiguous(), one, xqt[:, :0].contiguous(), one),
        "shapes disagree": (torch.zeros(32, 32, device=dev), gqt, one, xqt, one),
        "3-D operand": (out, gqt.view(32, 4, 16), one, xqt, one),
        "scale of 2 elements": (out, gqt, torch.ones(2, device=dev), xqt, one),
        "bf16 scale": (out, gqt, one.bfloat16(), xqt, one),
        "strided operand": (out, torch.ones(32, 128, device=dev).to(torch.float8_e5m2)[:, :64], one, xqt, one),
        "operand off 16 bytes": (out, off16((32, 64), torch.float8_e5m2), one, xqt, one),
        # 4 bytes past a 16-byte boundary: cuBLASLt crashed on it (csrc/fp8_gemm.cpp)
        "out off 16 bytes": (torch.zeros(32 * 48 + 4, device=dev)[1:32 * 48 + 1].view(32, 48), gqt, one, xqt, one),
        "CPU scale": (out, gqt, torch.ones(1), xqt, one),
    }


class _Ext:
    """A stand-in extension: records calls, raises what it is told to."""

    def __init__(self, error=None):
        self.calls, self.error = 0, error

    def fp8_gemm(self, *args):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return True


def _patched(monkeypatch, ext):
    monkeypatch.setattr(W, "cuda_extension", lambda: ext)
    monkeypatch.setattr(W._Refused, "keys", set())


def test_a_refused_problem_falls_back_for_the_rest_of_the_run(monkeypatch):
    """cuBLASLt refusing one problem (no algorithm) must not fail training, nor turn the extension off for
    the others: one warning, then that problem alone runs the fallback."""
    ext = _Ext(RuntimeError("megacoat fp8_gemm: cuBLASLt has no FP8 GEMM ..."))
    _patched(monkeypatch, ext)
    gqt, sg = _codes((16, 32), "e5m2", 6)
    xqt, sx = _codes((16, 32), "e4m3", 7)
    out = torch.zeros(16, 16)
    with pytest.warns(UserWarning, match="rest of this run"):
        assert W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate=True) is False
    assert W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate=True) is False
    assert ext.calls == 1 and torch.count_nonzero(out) == 0
    ext.error = None  # another problem (the overwrite of the step's first micro-batch) still uses it
    assert W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate=False) is True
    assert ext.calls == 2


def test_out_of_memory_is_raised_not_remembered(monkeypatch):
    ext = _Ext(torch.OutOfMemoryError("CUDA out of memory (workspace)"))
    _patched(monkeypatch, ext)
    gqt, sg = _codes((16, 32), "e5m2", 8)
    xqt, sx = _codes((16, 32), "e4m3", 9)
    out = torch.zeros(16, 16)
    with pytest.raises(torch.OutOfMemoryError):
        W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate=True)
    assert not W._Refused.keys


def test_fp8_wgrad_op_cpu_overwrites_then_adds():
    """The op's fallback path (no FP8 GEMM hardware): first micro-batch overwrites stale values, later add."""
    n, k, t = 32, 16, 48
    mg = torch.full((n, k), float("nan"))
    flag = torch.ones(1, dtype=torch.bool)
    expect = torch.zeros(n, k, dtype=torch.float64)
    for seed in range(3):
        gqt, sg = _codes((n, t), "e5m2", 10 + seed)
        xqt, sx = _codes((k, t), "e4m3", 20 + seed)
        _fp8_wgrad_impl(mg, gqt, sg, xqt, sx, flag, hw=False)
        expect = _exact(expect, gqt, sg, xqt, sx, True)
        assert not flag.item()
    assert torch.allclose(mg.double(), expect, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def _need_extension():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if W.cuda_extension() is None:
        pytest.fail("the fp8_gemm CUDA extension did not build on this GPU machine")


def _abs_product(gqt, sg, xqt, sx):
    """sum |a||b| per element: what accumulation error scales with."""
    return (gqt.double().abs() * sg.double()) @ (xqt.double().abs() * sx.double()).t()


def _assert_close_to(out, expect, bound, what):
    """Per element within 2^-9 of sum |a||b| (the tensor cores' limited accumulation between fp32
    promotions, as test_fp8_gpu bounds `_scaled_mm`) plus fp32 rounding of the result."""
    err = (out.double() - expect).abs()
    excess = err - (2 ** -9 * bound + 2 ** -22 * expect.abs())
    i = int(excess.argmax())
    assert float(excess.max()) <= 0, (
        f"{what}: error {float(err.reshape(-1)[i]):.3e} at {divmod(i, out.shape[1])} over its bound: got "
        f"{float(out.reshape(-1)[i]):.6e}, expected {float(expect.reshape(-1)[i]):.6e} "
        f"(sum |a||b| {float(bound.reshape(-1)[i]):.3e})")


@gpu
@pytest.mark.parametrize("gfmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("shape", [(16, 16, 16), (48, 80, 112), (256, 1024, 2048), (5632, 2048, 64)])
def test_extension_matches_reference_on_gpu(gfmt, shape):
    _need_extension()
    n, k, t = shape
    gqt, sg = _codes((n, t), gfmt, 30, "cuda")
    xqt, sx = _codes((k, t), "e4m3", 31, "cuda")
    # The buffer's old values as large as the products: a dropped or doubled add is far outside the bound.
    bound = _abs_product(gqt, sg, xqt, sx)
    big = float(bound.max())
    start = torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(32)) * big
    for accumulate in (False, True):
        out = start.clone() if accumulate else torch.full_like(start, float("nan"))
        assert W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, accumulate)
        torch.cuda.synchronize()
        _assert_close_to(out, _exact(start, gqt, sg, xqt, sx, accumulate), bound,
                         f"{shape} {gfmt} accumulate={accumulate}")


@gpu
def test_extension_declines_what_it_does_not_take():
    """Declined by the extension (False, nothing written, no warning: nothing is marked refused), for every
    problem outside its rules; the FP8 linear then runs its fallback."""
    _need_extension()
    for what, (out, gqt, sg, xqt, sx) in _declined_problems("cuda").items():
        before = out.clone()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="megacoat")  # megacoat's own (torch's lazy imports warn too)
            assert W.fp8_wgrad_gemm(out, gqt, sg, xqt, sx, True) is False, what
        torch.cuda.synchronize()
        assert torch.equal(out, before), what
    assert not W._Refused.keys


def _three_micro_batches(offset, seed, wgrad_step):
    """Three micro-batches of a weight gradient into a NaN-filled flat bucket, through its [96, 64] view starting
    `offset` floats in: `wgrad_step(main_grad, gqt, sg, xqt, sx, flag)` each (the flag starts set). Returns
    (main_grad, the exact sum, the sum of |a||b|)."""
    n, k, t = 96, 64, 128
    bucket = torch.full((n * k + 4,), float("nan"), device="cuda")
    mg = bucket[offset:offset + n * k].view(n, k)
    flag = torch.ones(1, dtype=torch.bool)
    expect = torch.zeros(n, k, dtype=torch.float64, device="cuda")
    bound = torch.zeros_like(expect)
    for i in range(3):
        gqt, sg = _codes((n, t), "e5m2", seed + i, "cuda")
        xqt, sx = _codes((k, t), "e4m3", seed + 10 + i, "cuda")
        wgrad_step(mg, gqt, sg, xqt, sx, flag)
        expect = _exact(expect, gqt, sg, xqt, sx, True)
        bound += _abs_product(gqt, sg, xqt, sx)
    torch.cuda.synchronize()
    return mg, expect, bound


@gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_fp8_wgrad_op_accumulates_micro_batches_on_gpu(offset, monkeypatch):
    """Three micro-batches through the FP8 linear's wgrad op on the H200 path: stale NaNs overwritten by
    the first, the others added in the GEMM's epilogue. offset 1: the gradient view starts 4 bytes past a
    16-byte boundary, as a bucket view may: the fallback runs (cuBLASLt crashed on it), the result must be right."""
    _need_extension()
    used = []
    real = L.fp8_wgrad_gemm
    monkeypatch.setattr(L, "fp8_wgrad_gemm", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    mg, expect, bound = _three_micro_batches(
        offset, 50, lambda mg, gqt, sg, xqt, sx, flag: _fp8_wgrad_impl(mg, gqt, sg, xqt, sx, flag, hw=True))
    _assert_close_to(mg, expect, bound, f"three micro-batches, offset {offset}")
    assert len(used) == 3
    if offset == 0:
        assert all(used), f"the extension did not run every micro-batch: {used}"
    else:
        assert not any(used), f"the extension ran on a gradient view 4 bytes off 16: {used}"


@gpu
@pytest.mark.parametrize("candidates", [1, 8])
@pytest.mark.parametrize("accumulate", [False, True])
def test_bf16_output_and_tuned_algorithms_on_gpu(candidates, accumulate):
    """The extension's general form out[M, N] (+)= a[M, K] b[N, K]^T with a bf16 output (the FP8 linear's
    forward and dgrad), from the heuristic's first algorithm or the fastest of 8 timed ones: within the
    accumulation bound plus one bf16 rounding of the exact product, and added exactly once (tuning runs on a
    scratch copy, never on the caller's output)."""
    _need_extension()
    m, n, k = 272, 208, 4096  # odd multiples of 16; long K (split-K candidates)
    a, sa = _codes((m, k), "e5m2", 70, "cuda")
    b, sb = _codes((n, k), "e4m3", 71, "cuda")
    bound = _abs_product(a, sa, b, sb)
    start = (torch.randn(m, n, device="cuda", generator=torch.Generator("cuda").manual_seed(72))
             * float(bound.max())).to(torch.bfloat16)
    out = start.clone() if accumulate else torch.full_like(start, float("nan"))
    ext = W.cuda_extension()
    assert ext.fp8_gemm(out, a, sa, b, sb, accumulate, False, candidates)
    torch.cuda.synchronize()
    expect = _exact(start.double(), a, sa, b, sb, accumulate)
    err = (out.double() - expect).abs()
    # bf16 output: its own rounding (2^-8 of the result), plus the summed input's where accumulating
    allowed = 2 ** -9 * bound + 2 ** -8 * expect.abs() + (2 ** -8 * start.double().abs() if accumulate else 0)
    assert bool((err <= allowed).all()), f"max error {float(err.max()):.3e} (candidates={candidates})"
    if candidates > 1:
        tuned = [r for r in ext.tuning_report() if r[:3] == (m, n, k) and r[6] == accumulate]
        assert tuned, "a tuned problem is missing from the tuning report"
        ms, chosen = tuned[-1][8], tuned[-1][7]
        ran = [x for x in ms if x >= 0]
        assert ms[chosen] >= 0
        if chosen == 0:  # the heuristic's first stays unless another is more than 2% faster
            assert all(x >= 0.98 * ms[0] for x in ran)
        else:
            assert ms[chosen] == min(ran) and (ms[0] < 0 or ms[chosen] < 0.98 * ms[0])


@gpu
@pytest.mark.parametrize("candidates", [1, 8])
def test_lt_fp8_mm_compiles_whole_and_matches_scaled_mm_on_gpu(candidates):
    """The FP8 linear's forward/dgrad GEMM through the extension's C++ op (`megacoat_lt::fp8_mm`) inside
    torch.compile with fullgraph (no graph break), heuristic or tuned: within the accumulation bound of
    torch._scaled_mm's result, bf16 out; an odd shape takes the emulation."""
    _need_extension()
    assert W.lt_gemm_ops() is not None
    m, n, k = 512, 384, 1024
    a, sa = _codes((m, k), "e4m3", 80, "cuda")
    b, sb = _codes((n, k), "e5m2", 81, "cuda")
    fn = torch.compile(lambda a, sa, b, sb: L.fp8_gemm(a, sa, b, sb, torch.bfloat16, False, True, candidates, True),
                       fullgraph=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="megacoat")  # a refusal (the op's fallback to _scaled_mm) warns: it must not happen here
        got = fn(a, sa, b, sb)
    ref = torch._scaled_mm(a, b.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()), out_dtype=torch.float32)
    bound = _abs_product(a, sa, b, sb)
    err = (got.double() - ref.double()).abs()
    assert got.dtype == torch.bfloat16 and bool((err <= 2 ** -8 * bound + 2 ** -8 * ref.double().abs()).all())
    odd = L.fp8_gemm(a[:, :1000].contiguous(), sa, b[:, :1000].contiguous(), sb, torch.bfloat16, False, True,
                     candidates, True)
    assert odd.shape == (m, n)


@gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_lt_fp8_wgrad_op_accumulates_micro_batches_on_gpu(offset):
    """The weight gradient through the extension's C++ op (`megacoat_lt::fp8_wgrad`, via the FP8 linear's
    `fp8_wgrad`) over three micro-batches, eager and compiled: stale NaNs overwritten by the first, the others
    added; the flag cleared; offset 1 (a view 4 bytes off 16) through the op's temporary-and-add path, eager only:
    a compiled graph copies an input that is not 16-byte aligned, and the op's undeclared write would go to that
    copy (the gradient buffers start every view 16-element aligned: test_grad_accumulation_fusion.py)."""
    _need_extension()
    compiled = torch.compile(lambda *a: L.fp8_wgrad(*a), fullgraph=True)
    for run in (L.fp8_wgrad, compiled) if offset == 0 else (L.fp8_wgrad,):
        def step(mg, gqt, sg, xqt, sx, flag):
            dw = run(mg, gqt, sg, xqt, sx, flag, True, torch.bfloat16, 1, True)
            assert dw.shape == mg.shape and dw.dtype == torch.bfloat16 and not flag.item()

        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="megacoat")  # no refusal: the extension's GEMM itself ran
            mg, expect, bound = _three_micro_batches(offset, 90, step)
        _assert_close_to(mg, expect, bound, f"three micro-batches, offset {offset}, {run}")
