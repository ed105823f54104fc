"""FP8 linear (megacoat/precision/linear.py): exact emulation, error against bf16 within what
E4M3/E5M2 imply, main_grad accumulation, the weight cache, what is saved."""
import pytest
import torch
import torch.nn.functional as F

from megacoat.precision import fp8
from megacoat.precision.activations import fp8_swiglu
from megacoat.precision.linear import Fp8WeightCache, fp8_gemm, fp8_gemm_reference, fp8_linear
from megacoat.precision.recipe import Fp8Recipe

COAT = Fp8Recipe("e4m3", "e5m2", True)
TENSORWISE = Fp8Recipe("e4m3", "e5m2", False)


def _data(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_gemm_emulation_is_the_dequantized_product():
    a, bt = _data((24, 48), 1), _data((40, 48), 2)
    qa, _, sa = fp8.quantize_tensorwise(a, "e5m2")
    qb, _, sb = fp8.quantize_tensorwise(bt, "e4m3")
    out = fp8_gemm(qa, sa, qb, sb, torch.float32)
    exact = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert torch.equal(fp8_gemm_reference(qa, sa, qb, sb, torch.bfloat16), out.to(torch.bfloat16))


@pytest.mark.parametrize("recipe", [COAT, TENSORWISE], ids=["coat", "tensorwise"])
@pytest.mark.parametrize("shape", [(4, 8, 64, 96), (7, 1, 24, 40)])  # (s, b, in, out); odd: not multiples of 16
def test_forward_backward_within_fp8_error(recipe, shape):
    s, b, k, n = shape
    x = _data((s, b, k), 3).requires_grad_(True)
    w = _data((n, k), 4, scale=0.05).requires_grad_(True)
    bias = _data((n,), 5).requires_grad_(True)
    g = _data((s, b, n), 6)
    y = fp8_linear(x, w, bias, Fp8WeightCache("e4m3"), recipe)
    y.backward(g)
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, w, bias))
    yr = F.linear(xr.double(), wr.double(), br.double())
    yr.backward(g.double())
    # E4M3 x E4M3 (3 mantissa bits each, rounding error <= 2^-4 relative per operand): the random-sign
    # errors add in quadrature; 0.06 is about 1.5x the observed value and far below any real defect.
    assert y.dtype == torch.bfloat16 and _rel(y, yr) < 0.06
    assert _rel(x.grad, xr.grad) < 0.1   # E5M2 gradient (2 mantissa bits) x E4M3 weight
    assert _rel(w.grad, wr.grad) < 0.1   # E5M2 gradient x E4M3 input
    assert torch.allclose(bias.grad.double(), br.grad.double(), rtol=1e-2, atol=1e-2)
    # exactly the emulated quantized product (forward)
    qx, _, sx = fp8.quantize_tensorwise(x.detach().reshape(-1, k), "e4m3")
    qw, _, sw = fp8.quantize_tensorwise(w.detach(), "e4m3")
    exact = (qx.double() * sx.double()) @ (qw.double() * sw.double()).t()
    # two bf16 roundings: the GEMM output, then the bias add
    err = (y.detach().reshape(-1, n).double() - (exact + bias.detach().double())).abs()
    assert (err <= 2 ** -8 * (2 * exact.abs() + bias.detach().double().abs()) + 1e-6).all()


def test_coat_and_tensorwise_give_identical_numbers_but_save_different_tensors():
    x = _data((16, 2, 32), 7)
    w = _data((48, 32), 8, scale=0.1)
    g = _data((16, 2, 48), 9)
    outs = {}
    for name, recipe in (("coat", COAT), ("tensorwise", TENSORWISE)):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fp8_linear(xx, ww, None, Fp8WeightCache("e4m3"), recipe)
        y.backward(g)
        outs[name] = (y, xx.grad, ww.grad)
        act = [t for t in saved if t.numel() == x.numel()]
        if name == "coat":
            assert [(t.dtype, tuple(t.shape)) for t in act] == [(torch.float8_e4m3fn, (32, 32))]  # x^T in FP8
        else:
            assert [t.dtype for t in act] == [torch.bfloat16]
    for a, b in zip(outs["coat"], outs["tensorwise"]):
        assert torch.equal(a, b)


def test_wgrad_writes_then_accumulates_into_main_grad():
    """The optimizer's flag marks the step's first gradient: that GEMM overwrites main_grad (stale values
    are never read), the next micro-batches add; the flag is cleared."""
    x1, x2 = _data((8, 32), 10), _data((8, 32), 11)
    w = _data((16, 32), 12).requires_grad_(True)
    g1, g2 = _data((8, 16), 13), _data((8, 16), 14)
    w.main_grad = torch.full((16, 32), float("nan"))  # stale garbage from the previous step
    w.main_grad_overwrite = torch.ones(1, dtype=torch.bool)
    cache = Fp8WeightCache("e4m3")
    for x, g in ((x1, g1), (x2, g2)):
        fp8_linear(x, w, None, cache, COAT, fuse_wgrad=True).backward(g)
        assert not w.main_grad_overwrite.item()
    expect = 0
    for x, g in ((x1, g1), (x2, g2)):
        qg, _, sg = fp8.quantize_tensorwise(g, "e5m2")
        qx, _, sx = fp8.quantize_tensorwise(x, "e4m3")
        expect = expect + (qg.double() * sg.double()).t() @ (qx.double() * sx.double())
    assert w.main_grad.dtype == torch.float32
    assert torch.allclose(w.main_grad.double(), expect, rtol=1e-5, atol=1e-5)
    assert w.grad is not None  # a placeholder: the optimizer's hook still fires (and ignores it)
    w.main_grad_overwrite.fill_(True)  # next step
    fp8_linear(x1, w, None, cache, COAT, fuse_wgrad=True).backward(g1)
    qg, _, sg = fp8.quantize_tensorwise(g1, "e5m2")
    qx, _, sx = fp8.quantize_tensorwise(x1, "e4m3")
    assert torch.allclose(w.main_grad.double(), (qg.double() * sg.double()).t() @ (qx.double() * sx.double()),
                          rtol=1e-5, atol=1e-5)


def test_weight_cache_made_once_and_refreshed_when_the_weight_changes():
    w = _data((16, 32), 15)
    cache = Fp8WeightCache("e4m3")
    x = _data((4, 32), 16)
    fp8_linear(x, w, None, cache, COAT)
    first = cache.wq
    calls = []
    orig = cache.refresh
    cache.refresh = lambda weight: calls.append(1) or orig(weight)
    fp8_linear(x, w, None, cache, COAT)
    assert calls == [] and cache.wq is first  # reused by the next micro-batch
    with torch.no_grad():
        w.mul_(2.0)  # an in-place update (version counter moves)
    fp8_linear(x, w, None, cache, COAT)
    assert calls == [1] and cache.wq is first  # refreshed in place (compiled graphs keep their inputs)
    assert cache.scale.item() == pytest.approx((w.float().abs().max().item() + 1e-12) / 448, rel=1e-6)
    cache.invalidate()  # what the trainer does after an optimizer step (writes through .data are invisible)
    fp8_linear(x, w, None, cache, COAT)
    assert calls == [1, 1]


def test_output_without_main_grad_is_weight_dtype():
    w = _data((16, 32), 17).requires_grad_(True)
    fp8_linear(_data((4, 32), 18), w, None, Fp8WeightCache("e4m3"), TENSORWISE).sum().backward()
    assert w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad.float()).all()


def test_e4m3_format_uses_e4m3_gradients():
    x = _data((8, 32), 19).requires_grad_(True)
    w = _data((16, 32), 20).requires_grad_(True)
    fp8_linear(x, w, None, Fp8WeightCache("e4m3"), Fp8Recipe("e4m3", "e4m3", True)).backward(_data((8, 16), 21))
    assert _rel(x.grad, (_data((8, 16), 21).double() @ w.detach().double())) < 0.08


def test_transient_weights_give_the_same_numbers_and_keep_nothing():
    """One micro-batch per step: no FP8 weight copy is kept (W cast in forward, W^T in backward)."""
    x = _data((8, 2, 32), 22)
    w = _data((48, 32), 23, scale=0.1)
    g = _data((8, 2, 48), 24)
    outs = []
    for persistent in (True, False):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        cache = Fp8WeightCache("e4m3", persistent=persistent)
        y = fp8_linear(xx, ww, None, cache, COAT)
        y.backward(g)
        outs.append((y, xx.grad, ww.grad))
        assert (cache.wq is None) == (not persistent)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_recipe_keeps_weight_copies_unless_one_micro_batch_waits_for_overlapped_gathers():
    from megacoat.config import PrecisionConfig, TrainingConfig
    from megacoat.precision.recipe import resolve_precision

    pr = PrecisionConfig(fp8_format="hybrid", fp8_recipe="coat")

    def keeps(n, overlap, choice="auto"):
        p = PrecisionConfig(fp8_format="hybrid", fp8_recipe="coat", fp8_weight_cache=choice)
        return resolve_precision(TrainingConfig(), torch.device("cpu"), precision=p, num_microbatches=n,
                                 overlap_param_gather=overlap).fp8.cache_weights

    assert keeps(1, False) and keeps(4, False) and keeps(4, True) and not keeps(1, True)
    assert all(keeps(n, o, "step") for n in (1, 4) for o in (False, True))
    assert not any(keeps(n, o, "none") for n in (1, 4) for o in (False, True))
    with pytest.raises(ValueError, match="--fp8-weight-cache 'always'"):
        keeps(1, False, "always")
    one = resolve_precision(TrainingConfig(), torch.device("cpu"), precision=pr, num_microbatches=1)
    assert one.params_dtype == torch.bfloat16 and one.name == "fp8"  # FP8 makes bf16 the default on CPU
    assert one.fp8.grad_format == "e5m2" and one.fp8.fp8_activations
    e4 = resolve_precision(TrainingConfig(), torch.device("cpu"),
                           precision=PrecisionConfig(fp8_format="e4m3", fp8_recipe="tensorwise"))
    assert e4.fp8.grad_format == "e4m3" and not e4.fp8.fp8_activations and e4.log_name == "fp8 (e4m3, tensorwise)"
    with pytest.raises(ValueError, match="needs bf16"):
        resolve_precision(TrainingConfig(fp32=True), torch.device("cpu"), precision=pr)


def test_fp8_gemm_candidates_flag_reaches_the_linear_and_is_checked():
    """--fp8-gemm-candidates goes to the recipe and every FP8 GEMM's options; off the GPU the GEMMs still run the
    emulation (the same result as without it); out of range is a config error naming the range."""
    from dataclasses import replace

    from megacoat.config import ConfigError, parse_args, validate_config
    from megacoat.precision.recipe import resolve_precision

    cfg = parse_args(["--fp8-format", "hybrid", "--fp8-gemm-candidates", "8"])
    recipe = resolve_precision(cfg.train, torch.device("cpu"), precision=cfg.precision).fp8
    assert recipe.gemm_candidates == 8
    x0, w0 = _data((4, 2, 64), 40), _data((48, 64), 41, scale=0.05)
    outs = []
    for r in (recipe, replace(recipe, gemm_candidates=1)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), r)
        y.float().square().sum().backward()
        outs.append((y, x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="--fp8-gemm-candidates 0"):
        validate_config(parse_args(["--fp8-format", "hybrid", "--fp8-gemm-candidates", "0"]), 1)


@pytest.mark.parametrize("shape", [(4, 8, 64, 2 * 48), (7, 1, 24, 2 * 40)])  # (s, b, in, 2 * ffn); odd shapes too
def test_fused_swiglu_equals_linear_then_swiglu(shape):
    """fc1 with activation="swiglu" is the same computation as fc1 followed by fp8_swiglu: identical
    outputs, amax and gradients (the fused node only hands the linear's backward the amax of its
    output gradient instead of reducing it again: max is exact, so the codes are the same)."""
    s, b, k, n = shape
    x0 = _data((s, b, k), 30)
    w0 = _data((n, k), 31, scale=0.05)
    bias0 = _data((n,), 32)
    gp = _data((s, b, n // 2), 33)
    runs = []
    for fused in (False, True):
        x, w, bias = (t.clone().requires_grad_(True) for t in (x0, w0, bias0))
        if fused:
            p, amax = fp8_linear(x, w, bias, Fp8WeightCache("e4m3"), COAT, activation="swiglu")
        else:
            p, amax = fp8_swiglu(fp8_linear(x, w, bias, Fp8WeightCache("e4m3"), COAT))
        p.backward(gp)
        runs.append((p.detach(), amax, x.grad, w.grad, bias.grad))
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)
    with pytest.raises(ValueError, match="coat recipe"):
        fp8_linear(x0, w0, None, Fp8WeightCache("e4m3"), TENSORWISE, activation="swiglu")
    with pytest.raises(ValueError, match="unknown fused activation"):
        fp8_linear(x0, w0, None, Fp8WeightCache("e4m3"), COAT, activation="gelu")


@pytest.mark.parametrize("rms", [True, False])
def test_grad_amax_token_gives_the_same_numbers_as_the_amax_pass(rms):
    """A row-parallel-style FP8 linear whose output goes into a norm with the fused residual: with the token,
    the norm's backward hands the linear max |dy| (its kernel's amax of the dx it wrote) instead of the linear
    reducing dy again. Identical outputs and gradients (max is exact, so the E5M2 codes are the same); an
    unused token's gradient never comes and the linear falls back to its own amax pass."""
    from megacoat.precision.activations import fp8_norm
    s, b, k, n = 5, 3, 48, 40
    x0, r0 = _data((s, b, k), 40), _data((s, b, n), 41, scale=4.0)
    w0, nw0 = _data((n, k), 42, scale=0.05), 1 + 0.1 * _data((n,), 43)
    nb0 = None if rms else _data((n,), 44)
    gs, gy = _data((s, b, n), 45), _data((s, b, n), 46)
    runs = []
    for mode in ("pass", "token", "unused token"):
        x, r, w, nw = (t.clone().requires_grad_(True) for t in (x0, r0, w0, nw0))
        if mode == "pass":
            h, token = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), COAT), None
        else:
            h, token = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), COAT, grad_amax_token=True)
            assert token.shape == () and token.dtype == torch.float32
        stream, y, _ = fp8_norm(h, nw, nb0, 1e-5, rms, residual=r,
                                grad_amax_token=token if mode == "token" else None)
        torch.autograd.backward((stream, y), (gs, gy))
        runs.append((stream.detach(), y.detach(), x.grad, w.grad, r.grad, nw.grad))
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            assert torch.equal(a, b_)
    with pytest.raises(ValueError, match="fused residual"):
        fp8_norm(x0[..., :n].clone(), nw0, None, 1e-5, True, grad_amax_token=torch.zeros(()))
    with pytest.raises(ValueError, match="grad_amax_token"):
        fp8_linear(x0, torch.cat([w0, w0]), None, Fp8WeightCache("e4m3"), COAT, activation="swiglu",
                   grad_amax_token=True)


def test_grad_amax_token_amax_is_the_one_the_cast_uses():
    """The token's gradient is exactly max |dy| of the gradient the linear casts: a wrong one would saturate
    (too small) or waste range (too large). Checked by handing the linear a hand-made token gradient."""
    x = _data((6, 32), 50).requires_grad_(True)
    w = _data((16, 32), 51, scale=0.05).requires_grad_(True)
    g = _data((6, 16), 52)
    y, token = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), COAT, grad_amax_token=True)
    dx_tok, = torch.autograd.grad((y, token), (x,), (g, g.float().abs().amax() / 64), retain_graph=True)
    dx_ref, = torch.autograd.grad(y, x, g, retain_graph=True)
    assert not torch.equal(dx_tok, dx_ref)  # the handed amax is used: 1/64 of the true one saturates
    dx_same, = torch.autograd.grad((y, token), (x,), (g, g.float().abs().amax()))
    assert torch.equal(dx_same, dx_ref)
