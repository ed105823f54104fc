"""Fused FP8 activation ops (megacoat/precision/activations.py): references against float64, the
autograd wrappers, what is saved for backward, and torch.compile without graph breaks."""
import math

import pytest
import torch
import torch.nn.functional as F

from megacoat.precision import activations as A
from megacoat.precision import fp8


def _data(shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x.view(-1)[:: 53] *= 40.0  # outliers
    return x.to(dtype)


def _bf16_close(a, b64, rel=2 ** -7, abs_=1e-6):
    """a (bf16-rounded) against an exact float64 value: within one bf16 rounding (+ fp32 noise)."""
    d = (a.double() - b64).abs()
    assert (d <= rel * b64.abs() + abs_).all(), f"max error {d.max().item():.3g}"


def _norm64(s64, w, b, eps, rms):
    if rms:
        c = s64
    else:
        c = s64 - s64.mean(-1, keepdim=True)
    y = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(19, 72), (3, 5, 40)])
def test_norm_forward_reference_vs_float64(rms, with_residual, shape):
    k = shape[-1]
    x, r = _data(shape, 1), _data(shape, 2)
    w, b = _data((k,), 3), (None if rms else _data((k,), 4))
    res = r if with_residual else None
    stream, y, amax, xq, xs, rstd, mean = A.norm_fwd_reference(x, res, w, b, 1e-5, rms)
    s64 = (x.double() + r.double()).to(torch.bfloat16).double() if with_residual else x.double()
    if with_residual:
        assert torch.equal(stream.double(), s64)  # the bf16 stream, rounded once like torch's add
    else:
        assert stream.numel() == 0
    _bf16_close(y, _norm64(s64, w, b, 1e-5, rms), abs_=1e-4)
    assert amax.item() == y.double().abs().max().item()
    ex_rstd = 1 / torch.sqrt((s64 if rms else s64 - s64.mean(-1, keepdim=True)).pow(2).mean(-1) + 1e-5)
    assert torch.allclose(rstd.double(), ex_rstd, rtol=1e-5)
    if not rms:
        assert torch.allclose(mean.double(), s64.mean(-1), rtol=1e-5, atol=1e-6)
    q_ref, s_ref = fp8.quantize_1x16(stream if with_residual else x, "e4m3")
    assert torch.equal(xq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(xs, s_ref)


@pytest.mark.parametrize("rms", [True, False])
def test_norm_backward_reference_vs_float64_autograd(rms):
    shape, k = (23, 48), 48
    x = _data(shape, 5)
    w, b = _data((k,), 6), (None if rms else _data((k,), 7))
    _, y, _, xq, xs, rstd, mean = A.norm_fwd_reference(x, None, w, b, 1e-5, rms)
    dy = _data(shape, 8)
    dx, dw, db, _ = A.norm_bwd_reference(dy, xq, xs, rstd, mean, w, b is not None, rms)
    # float64 autograd on the input the backward sees (the dequantized FP8 copy), with its rstd
    xd = fp8.dequantize_1x16(xq, xs, torch.float64).requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    b64 = b.double().requires_grad_(True) if b is not None else None
    y64 = _norm64(xd, w64, b64, 1e-5, rms)
    y64.backward(dy.double())
    _bf16_close(dx, xd.grad, rel=2 ** -6, abs_=2e-3 * xd.grad.abs().max().item())
    assert torch.allclose(dw.double(), w64.grad, rtol=2 ** -6, atol=1e-2 * w64.grad.abs().max().item())
    if b is not None:
        assert torch.allclose(db.double(), b64.grad, rtol=2 ** -6, atol=1e-3)
    # and against the exact input: FP8 (E4M3, 1x16) error only
    xe = x.double().requires_grad_(True)
    _norm64(xe, w.double(), None if b is None else b.double(), 1e-5, rms).backward(dy.double())
    rel = (dx.double() - xe.grad).norm() / xe.grad.norm()
    assert rel < 0.08


def test_norm_backward_reference_adds_the_residual_gradient_before_rounding():
    shape, k = (23, 48), 48
    x, w = _data(shape, 5), _data((k,), 6)
    _, _, _, xq, xs, rstd, mean = A.norm_fwd_reference(x, None, w, None, 1e-5, True)
    dy, dres = _data(shape, 8), _data(shape, 9)
    alone = A.norm_bwd_reference(dy, xq, xs, rstd, mean, w, False, True)
    fused = A.norm_bwd_reference(dy, xq, xs, rstd, mean, w, False, True, dres=dres, want_amax=True)
    assert alone[3].numel() == 0 and fused[3].item() == fused[0].float().abs().max().item()
    assert torch.equal(fused[1], alone[1])  # the weight gradient does not see the residual's gradient
    # dx: the float64 norm gradient plus dres, rounded once (the unfused form rounds twice)
    xd = fp8.dequantize_1x16(xq, xs, torch.float64).requires_grad_(True)
    _norm64(xd, w.double(), None, 1e-5, True).backward(dy.double())
    _bf16_close(fused[0], xd.grad + dres.double(), rel=2 ** -7, abs_=2e-3 * xd.grad.abs().max().item())
    assert not torch.equal(fused[0], alone[0])


def test_swiglu_reference_vs_float64():
    h = _data((3, 7, 80), 9, scale=2.0)
    p, amax, hq, hs = A.swiglu_fwd_reference(h)
    g64, u64 = h[..., :40].double(), h[..., 40:].double()
    _bf16_close(p, g64 * torch.sigmoid(g64) * u64, abs_=1e-5)
    assert amax.item() == p.double().abs().max().item()
    assert hq.shape == (3, 7, 2, 40) and hs.shape == (3, 7, 2, 3)
    dp = _data((3, 7, 40), 10)
    dh, dh_amax = A.swiglu_bwd_reference(dp, hq, hs)
    assert dh_amax.item() == dh.double().abs().max().item()  # of dh as rounded: what the linear's cast reads
    hd = fp8.dequantize_1x16(hq, hs, torch.float64).reshape(3, 7, 80).requires_grad_(True)
    gg, uu = hd[..., :40], hd[..., 40:]
    (F.silu(gg) * uu).backward(dp.double())
    _bf16_close(dh, hd.grad, rel=2 ** -7, abs_=1e-4 * hd.grad.abs().max().item())


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_swiglu_bwd_quantized_reference_vs_float64(fmt):
    """The SwiGLU gradient as per-tensor FP8 codes in both layouts (what the fused FP8 linear's backward reads)
    against float64 autograd of silu(gate) * up from the dequantized saved codes."""
    h = _data((3, 7, 80), 19, scale=2.0)
    _, _, hq, hs = A.swiglu_fwd_reference(h)
    dp = _data((3, 7, 40), 20)
    gq, gqt, scale, amax = A.swiglu_bwd_quantized_reference(dp, hq, hs, fmt)
    hd = fp8.dequantize_1x16(hq, hs, torch.float64).reshape(3, 7, 80).requires_grad_(True)
    (F.silu(hd[..., :40]) * hd[..., 40:]).backward(dp.double())
    d64 = hd.grad.reshape(21, 80)
    assert gq.shape == (21, 80) and gqt.shape == (80, 21)
    assert torch.equal(gqt.view(torch.uint8), gq.view(torch.uint8).t())
    top = d64.abs().max().item()
    assert abs(amax.item() - top) <= 2 ** -7 * top  # the amax of dh as rounded to bf16
    f = fp8.get_format(fmt)
    assert scale.item() == pytest.approx((amax.item() + fp8.EPS) / f.max, rel=1e-7)
    half_step = 2.0 ** -(3 if fmt == "e5m2" else 4)
    smallest = 2.0 ** -(16 if fmt == "e5m2" else 9)  # subnormal spacing
    err = (gq.double() * scale.item() - d64).abs()
    tol = (half_step + 2 ** -7) * d64.abs() + scale.item() * smallest
    assert (err <= tol).all(), f"worst excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("kind", ["silu", "gelu"])
def test_activation_reference_vs_float64(kind):
    h = _data((5, 33), 11, scale=3.0)
    y, amax, hq, hs = A.act_fwd_reference(h, kind)
    fn = (lambda t: F.silu(t)) if kind == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    _bf16_close(y, fn(h.double()), abs_=1e-5)
    dy = _data((5, 33), 12)
    dh = A.act_bwd_reference(dy, hq, hs, kind)
    hd = fp8.dequantize_1x16(hq, hs, torch.float64).requires_grad_(True)
    fn(hd).backward(dy.double())
    _bf16_close(dh, hd.grad, rel=2 ** -7, abs_=1e-4 * hd.grad.abs().max().item())


def _saved(fn, *args):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_autograd_paths_and_saved_tensors():
    x = _data((6, 4, 48), 13).requires_grad_(True)
    r = _data((6, 4, 48), 14).requires_grad_(True)
    w = _data((48,), 15).requires_grad_(True)
    (stream, y, amax), saved = _saved(lambda: A.fp8_norm(x, w, None, 1e-5, True, residual=r))
    big = [t for t in saved if t.numel() == x.numel()]
    assert [t.dtype for t in big] == [torch.float8_e4m3fn]  # the stream, as E4M3 1x16 only
    assert not amax.requires_grad
    (y.float().pow(2).sum() + stream.float().sum()).backward()
    # same gradients as the reference backward plus the stream's own gradient
    _, _, _, xq, xs, rstd, mean = A.norm_fwd_reference(x.detach(), r.detach(), w.detach(), None, 1e-5, True)
    dx, dw, _, _ = A.norm_bwd_reference((2 * y.float()).to(torch.bfloat16), xq, xs, rstd, mean, w.detach(), False,
                                        True)
    assert torch.allclose(x.grad.float(), (dx.float() + 1).to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(x.grad, r.grad)
    assert torch.allclose(w.grad.float(), dw.float(), rtol=1e-2, atol=1e-2)

    h = _data((6, 4, 64), 16).requires_grad_(True)
    (p, pa), saved = _saved(A.fp8_swiglu, h)
    assert {t.dtype for t in saved if t.numel() >= h.numel()} == {torch.float8_e4m3fn}
    p.float().sum().backward()
    assert h.grad.shape == h.shape and torch.isfinite(h.grad.float()).all()

    h2 = _data((6, 4, 40), 17).requires_grad_(True)
    (yy, _), saved = _saved(A.fp8_activation, h2, "gelu")
    assert [t.dtype for t in saved if t.numel() == h2.numel()] == [torch.float8_e4m3fn]
    yy.float().sum().backward()
    assert torch.isfinite(h2.grad.float()).all()


def test_torch_compile_keeps_ops_whole():
    """fullgraph: no graph break; the custom ops stay opaque calls; same numbers as eager."""
    def block(x, w, h):
        s, y, a = A.fp8_norm(x, w, None, 1e-5, True)
        p, pa = A.fp8_swiglu(h)
        return y.float().sum() * a + p.float().sum() * pa

    x, w, h = _data((8, 32), 18), _data((32,), 19), _data((8, 64), 20)
    args = [t.clone().requires_grad_(True) for t in (x, w, h)]
    eager = block(*args)
    eager.backward()
    grads = [a.grad.clone() for a in args]
    cargs = [t.clone().requires_grad_(True) for t in (x, w, h)]
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(*cargs)
    out.backward()
    assert torch.equal(out, eager)
    for a, g in zip(cargs, grads):
        assert torch.equal(a.grad, g)


def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        A.fp8_swiglu(torch.ones(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unknown FP8 activation"):
        A.fp8_activation(torch.ones(2, 16, dtype=torch.bfloat16), "relu")
    with pytest.raises(ValueError, match="hidden size"):
        A.fp8_norm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), None, 1e-5, True)
    assert math.isfinite(A.fp8_activation(torch.zeros(2, 16, dtype=torch.bfloat16), "silu")[1].item())
