"""Triton FP8 kernels against their torch references under TRITON_INTERPRET=1 (CPU), small odd shapes.

Run by tests/test_fp8_triton_interp.py in a fresh process: Triton decides at import whether kernels are
interpreted, so these cases cannot share a process with tests that compile the same kernels.

The interpreter (triton 3.9 here) has two rounding defects, so its casts are not asserted bit-exact
(hardware casts are right): fp8 casts round ties away from even and mis-round across a power of two (checked with
`assert_interpreted_fp8_close`), and fp32 -> bf16 casts truncate (so bf16 outputs are compared within
one bf16 ulp). Everything without a cast (amax, group scales, fp32 outputs) is compared exactly or to
fp32 round-off. Bit-exactness on hardware: tests/test_fp8_gpu.py.
"""
import pytest
import torch

from interp_runner import skip_unless_interpreted

skip_unless_interpreted("tests/test_fp8_triton_interp.py")

from fp8_oracle import assert_interpreted_fp8_close  # noqa: E402
from megacoat.kernels import fp8 as K  # noqa: E402
from megacoat.kernels import fp8_act as KA  # noqa: E402
from megacoat.precision import activations as A  # noqa: E402
from megacoat.precision import fp8  # noqa: E402

BF16_ULP = 2 ** -7


def _data(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x.view(-1)[:: 41] *= 60.0  # outliers
    return x.to(torch.bfloat16)


def _bf16_close(a, b, extra=0.0):
    a, b = a.double(), b.double()
    tol = BF16_ULP * 1.01 * b.abs() + extra
    assert ((a - b).abs() <= tol).all(), f"max diff {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("shape", [(37, 50), (19, 16), (3, 5, 33)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantizers(shape, fmt):
    x = _data(shape, 1)
    amax = K.amax(x)
    assert amax.item() == fp8.amax_reference(x).item()
    x2 = x.reshape(-1, shape[-1])
    q, qt, scale = K.cast_tensorwise(x2, amax, fmt, True)
    q_ref, _, scale_ref = fp8.cast_tensorwise_reference(x2, amax, fmt, False)
    assert torch.equal(scale, scale_ref)  # IEEE division in both
    assert_interpreted_fp8_close(q, q_ref)
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))  # one cast, two layouts
    e, qt2, s2 = K.cast_tensorwise(x2, amax, fmt, True, rowwise=False)  # the transposed copy only
    assert e.numel() == 0 and torch.equal(qt2.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s2, scale)
    out = (torch.empty_like(q), torch.empty_like(qt), torch.empty_like(scale))  # into given buffers
    K.cast_tensorwise(x2, amax, fmt, True, out=out)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out[:2], (q, qt)))
    with pytest.raises(ValueError, match="expected a contiguous"):
        K.cast_tensorwise(x2, amax, fmt, True, out=(out[0], out[0], out[2]))
    g, s = K.quantize_1x16(x, fmt)
    g_ref, s_ref = fp8.quantize_1x16_reference(x, fmt)
    assert s.dtype == torch.bfloat16 and torch.equal(s, s_ref)  # amax, IEEE division, bit round-up: exact
    assert_interpreted_fp8_close(g, g_ref)
    assert torch.equal(K.dequantize_1x16(g, s, torch.float32), fp8.dequantize_1x16_reference(g, s, torch.float32))


def test_amax_many_programs():
    block, iters, _ = K.TILES["amax"]
    per_prog = block * iters
    x = _data((2 * per_prog + block + 17,), 2)  # 3 programs, the last one partial
    x[per_prog + 2 * block + 5] = -992.0  # exact in bf16; in the middle program's third block
    assert K.amax(x).item() == 992.0
    out = torch.full((), 2000.0)  # accumulates into the given scalar (atomic max): it keeps the larger value
    assert K.amax_into(x, out).item() == 2000.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_many_tensors_in_two_launches_equal_one_at_a_time(fmt):
    """The weight refresh's multi-tensor amax and cast: the same amax, scales and codes (both layouts) as the
    one-tensor kernels, for odd shapes, a tensor larger than one amax program, and a tiny one."""
    odd = [(37, 50), (19, 16), (130, 7), (1, 1), (K.AMAX_BLOCK * K.AMAX_ITERS // 64 + 3, 64)]
    _many_equal_one_at_a_time(odd, fmt)
    _many_equal_one_at_a_time([(32, 48), (16, 16), (K.AMAX_BLOCK * K.AMAX_ITERS // 64 + 16, 64)], fmt, aligned=True)


def _many_equal_one_at_a_time(shapes, fmt, aligned=False):
    xs = [_data(sh, 20 + i, scale=10.0 ** (i - 2)) for i, sh in enumerate(shapes)]
    dt = fp8.get_format(fmt).dtype
    qs = [torch.empty(x.shape, dtype=dt) for x in xs]
    qts = [torch.empty(x.shape[::-1], dtype=dt) for x in xs]
    scales = [torch.empty(()) for _ in xs]
    plan = K.MultiCastPlan(xs, qs, qts, scales, fmt)
    assert plan.aligned == aligned
    K.quantize_tensorwise_many(plan)
    for i, x in enumerate(xs):
        amax = K.amax(x)
        assert plan.amax[i].item() == amax.item() == x.float().abs().max().item()
        q, qt, s = K.cast_tensorwise(x, amax, fmt, True)
        assert torch.equal(scales[i], s)
        assert torch.equal(qs[i].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(qts[i].view(torch.uint8), qt.view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        K.MultiCastPlan([xs[0].t()], qs[:1], qts[:1], scales[:1], fmt)


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(19, 72), (2, 9, 40)])
def test_norm_kernels(rms, with_residual, shape):
    k = shape[-1]
    x, r = _data(shape, 3), _data(shape, 4)
    w, b = _data((k,), 5), (None if rms else _data((k,), 6))
    res = r if with_residual else None
    stream, y, amax, xq, xs, rstd, mean = KA.norm_fwd(x, res, w, b, 1e-5, rms)
    ref = A.norm_fwd_reference(x, res, w, b, 1e-5, rms)
    s_used = stream if with_residual else x
    if with_residual:
        _bf16_close(stream, ref[0])
    # statistics and output from the stream the kernel produced
    ref_k = A.norm_fwd_reference(s_used, None, w, b, 1e-5, rms)
    assert torch.allclose(rstd, ref_k[5], rtol=1e-5)
    if not rms:
        assert torch.allclose(mean, ref_k[6], rtol=1e-5, atol=1e-6)
    _bf16_close(y, ref_k[1], extra=1e-4 * ref_k[1].abs().max().item())
    assert amax.item() == y.float().abs().max().item()
    q_ref, s_ref = fp8.quantize_1x16_reference(s_used, "e4m3")
    assert torch.equal(xs, s_ref)
    assert_interpreted_fp8_close(xq, q_ref)
    # backward from identical saved tensors
    dy = _data(shape, 7)
    dx, dw, db, none = KA.norm_bwd(dy, xq, xs, rstd, mean, w, b is not None, rms)
    dx_r, dw_r, db_r, _ = A.norm_bwd_reference(dy, xq, xs, rstd, mean, w, b is not None, rms)
    assert none.numel() == 0  # no amax unless asked
    _bf16_close(dx, dx_r, extra=1e-3 * dx_r.abs().max().item())
    _bf16_close(dw, dw_r, extra=1e-3 * dw_r.abs().max().item())
    if b is not None:
        _bf16_close(db, db_r, extra=1e-3 * db_r.abs().max().item())
    if with_residual:  # the residual stream's gradient added inside the kernel
        dres = _data(shape, 9)
        dx, _, _, amax = KA.norm_bwd(dy, xq, xs, rstd, mean, w, b is not None, rms, dres, want_amax=True)
        dx_r, _, _, _ = A.norm_bwd_reference(dy, xq, xs, rstd, mean, w, b is not None, rms, dres)
        _bf16_close(dx, dx_r, extra=1e-3 * dx_r.abs().max().item())
        # the amax of dx as the kernel wrote it (masked lanes excluded: LayerNorm's dx is not 0 there)
        assert amax.item() == dx.float().abs().max().item()


@pytest.mark.parametrize("shape", [(37, 80), (2, 3, 2 * 24)])
def test_swiglu_kernels(shape):
    h = _data(shape, 8, scale=2.0)
    p, amax, hq, hs = KA.swiglu_fwd(h)
    p_r, _, hq_r, hs_r = A.swiglu_fwd_reference(h)
    _bf16_close(p, p_r, extra=1e-5 * p_r.abs().max().item())
    assert amax.item() == p.float().abs().max().item()
    assert torch.equal(hs, hs_r)
    assert_interpreted_fp8_close(hq, hq_r)
    dp = _data(p.shape, 9)
    dh, dh_amax = KA.swiglu_bwd(dp, hq_r, hs_r)
    dh_r = A.swiglu_bwd_reference(dp, hq_r, hs_r)[0]
    _bf16_close(dh, dh_r, extra=1e-5 * dh_r.abs().max().item())
    assert dh_amax.item() == dh.float().abs().max().item()


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("shape,tile", [((37, 2 * 72), (16, 32, 4)), ((2, 3, 2 * 24), (128, 64, 8)),
                                        ((40, 2 * 16), (16, 16, 4))])
def test_swiglu_bwd_quantized_kernels(shape, tile, fmt, monkeypatch):
    """The SwiGLU backward straight to per-tensor codes: the same bytes as the interpreted two-kernel path (the
    bf16 dh, then the cast with its amax), both layouts; close to the reference (the interpreter's roundings)."""
    monkeypatch.setitem(KA.TILES, "swiglu_bwd_cast", tile)
    h = _data(shape, 16, scale=2.0)
    _, _, hq, hs = A.swiglu_fwd_reference(h)
    dp = _data((*shape[:-1], shape[-1] // 2), 17)
    gq, gqt, scale, amax = KA.swiglu_bwd_quantized(dp, hq, hs, fmt)
    dh, dh_amax = KA.swiglu_bwd(dp, hq, hs)
    q2, qt2, s2 = K.cast_tensorwise(dh.reshape(-1, shape[-1]), dh_amax, fmt, True)
    assert amax.item() == dh_amax.item() and scale.item() == s2.item()
    assert torch.equal(gq.view(torch.uint8), q2.view(torch.uint8)), "row-major codes"
    assert torch.equal(gqt.view(torch.uint8), qt2.view(torch.uint8)), "transposed codes"
    assert torch.equal(gqt.view(torch.uint8), gq.view(torch.uint8).t())
    rq, _, rs, ra = A.swiglu_bwd_quantized_reference(dp, hq, hs, fmt)
    assert abs(amax.item() - ra.item()) <= BF16_ULP * ra.item()
    if scale.item() == rs.item():  # (the interpreter's bf16 truncation can lower the amax by one ulp)
        assert_interpreted_fp8_close(gq, rq, max_mismatch=0.3)  # neighbours: bf16 dh truncated here
    got, want = gq.float() * scale, rq.float() * rs
    assert (got - want).abs().max().item() <= 0.26 * want.abs().max().item()  # one E5M2 step near the top


@pytest.mark.parametrize("kind", ["silu", "gelu"])
@pytest.mark.parametrize("shape", [(21, 33), (4, 64)])
def test_activation_kernels(kind, shape):
    h = _data(shape, 10, scale=3.0)
    y, amax, hq, hs = KA.act_fwd(h, kind)
    y_r, _, hq_r, hs_r = A.act_fwd_reference(h, kind)
    _bf16_close(y, y_r, extra=1e-5 * y_r.abs().max().item())
    assert amax.item() == y.float().abs().max().item()
    assert torch.equal(hs, hs_r)
    assert_interpreted_fp8_close(hq, hq_r)
    dy = _data(shape, 11)
    ref = A.act_bwd_reference(dy, hq_r, hs_r, kind)
    _bf16_close(KA.act_bwd(dy, hq_r, hs_r, kind), ref, extra=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("tile", [(16, 16, 4, 1), (16, 16, 4, 2), (4, 32, 4, 2), (2, 4, 1, 1), (8, 2, 2, 2)])
def test_1x16_tiles_agree(tile, monkeypatch):
    """Every tile and split (threads per group) gives the same bytes as the defaults on odd shapes (masked
    row and group edges; several programs per row): the benchmark's tile sweep picks among them."""
    x = _data((37, 200), 12, scale=2.0)
    h = _data((37, 2 * 72), 13, scale=2.0)
    dy = _data((37, 200), 14)
    dp = _data((37, 72), 15)

    def run():
        q, s = K.quantize_1x16(x, "e4m3")
        a = KA.act_fwd(x, "silu")
        sw = KA.swiglu_fwd(h)
        return (q.view(torch.uint8), s, K.dequantize_1x16(q, s, torch.bfloat16), a[0], a[1], a[2].view(torch.uint8),
                a[3], KA.act_bwd(dy, a[2], a[3], "silu"), sw[0], sw[1], sw[2].view(torch.uint8), sw[3],
                *KA.swiglu_bwd(dp, sw[2], sw[3]))

    want = run()
    for table, names in ((K.TILES, ("quantize_1x16", "dequantize_1x16")),
                         (KA.TILES, ("act_fwd", "act_bwd", "swiglu_fwd", "swiglu_bwd"))):
        for name in names:
            monkeypatch.setitem(table, name, tile)
    for i, (a, b) in enumerate(zip(run(), want)):
        assert torch.equal(a, b), f"output {i} differs under tile {tile}"
