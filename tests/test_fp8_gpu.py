"""FP8 kernels on the GPU (H200).

What is asserted bit-exact, and why:
- every quantizer (amax, per-tensor scale and codes, the transposed copy, 1x16 codes and bf16 group
  scales, dequantization) and the saved FP8 copies of the fused ops: kernel and reference do the same
  IEEE operations (max, div.rn for the scale and its reciprocal, one fp32 multiply, RNE saturating
  cast), so any difference is a bug. The reference's scale is also checked against the CPU's (CUDA
  torch divides by a Python number as a multiply by its reciprocal, which once made them differ);
- the bf16 residual stream of the fused add (one fp32 add, one rounding, as torch's add).
What is compared within a tolerance, and why:
- norm outputs/gradients (the row sums are reduced in a different order), SiLU/GELU/SwiGLU outputs and
  gradients (the kernels' exp/sigmoid are not torch's): within 1 bf16 ulp (2 ulps for sums over rows)
  plus a small absolute term for values that cancel;
- `_scaled_mm` vs the float64 product of the same FP8 codes: the tensor cores accumulate with limited
  precision (fast accumulation: no fp32 promotion), so an element may be off by a small fraction of
  sum |a||b|; a wrong scale, layout or operand is off by ~100%.
Every failing comparison names the largest error, where it is and both values, so that a run killed
by a timeout after `-x` still says what went wrong. All sizes are small (each test well under 20 s).
"""
import pytest
import torch

from fp8_oracle import round_fp8_oracle
from megacoat.kernels import fp8 as K
from megacoat.kernels import fp8_act as KA
from megacoat.precision import activations as A
from megacoat.precision import fp8
from megacoat.precision.linear import Fp8WeightCache, fp8_gemm, fp8_linear
from megacoat.precision.recipe import Fp8Recipe

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPES = [(1, 16), (37, 50), (129, 4096), (1000, 72), (3, 77, 200)]
BF16_ULP = 2 ** -7  # relative spacing of bf16 at the bottom of a binade


def _data(shape, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEV) * scale
    x.view(-1)[:: 97] *= 300.0  # outliers
    return x.to(torch.bfloat16)


def _index(flat: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape))) if len(shape) else ()


def assert_same(got: torch.Tensor, exp: torch.Tensor, what: str) -> None:
    """Bit-exact (fp8 codes compared as bytes); the message names count, first place and values."""
    assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = got.view(torch.uint8), exp.view(torch.uint8)
    else:
        a, b = got, exp
    bad = a != b
    if got.is_floating_point():
        bad &= ~(torch.isnan(got.float()) & torch.isnan(exp.float()))
    if bad.any():
        i = _index(int(bad.reshape(-1).nonzero()[0].item()), got.shape)
        diff = (got.float() - exp.float()).abs().nan_to_num(0.0)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ; first at {i}: kernel "
                             f"{got[i].float().item()!r} vs reference {exp[i].float().item()!r}; "
                             f"max |diff| {diff.max().item():.4g}")


def assert_close(got: torch.Tensor, exp: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """|got - exp| <= tol element-wise; the message names the worst element."""
    assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    a, b = got.double(), exp.double()
    err = (a - b).abs()
    excess = err - tol.double()
    if (excess > 0).any() or torch.isnan(err).any():
        excess = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), excess)
        i = _index(int(excess.reshape(-1).argmax()), got.shape)
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {err.numel()} beyond tolerance; worst at {i}: "
                             f"kernel {a[i].item():.6g} vs reference {b[i].item():.6g} (|diff| {err[i].item():.3g}, "
                             f"tol {tol.double().expand_as(err)[i].item():.3g}); max |diff| {err.max().item():.3g}")


def assert_ulps(got, exp, ulps=1.0, extra=0.0, what=""):
    """Within `ulps` bf16 ulps of the reference (plus `extra` absolute for values that cancel)."""
    b = exp.double()
    assert_close(got, exp, ulps * BF16_ULP * b.abs() + extra, what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantizers_bit_exact(shape, fmt):
    x = _data(shape, 1)
    amax = K.amax(x)
    assert_same(amax, fp8.amax_reference(x), "amax")
    x2 = x.reshape(-1, shape[-1])
    q, qt, scale = K.cast_tensorwise(x2, amax, fmt, True)
    q_ref, qt_ref, scale_ref = fp8.cast_tensorwise_reference(x2, amax, fmt, True)
    assert_same(scale, scale_ref, "per-tensor scale")
    assert_same(scale.cpu(), fp8.scale_from_amax(amax.cpu(), fmt), "per-tensor scale vs the CPU reference")
    assert_same(q, q_ref, "per-tensor codes")
    assert_same(qt, qt_ref, "transposed codes")
    # hardware cast = the float64 nearest-even oracle of x * fp32(1 / scale)
    r = torch.tensor(1.0 / scale.item(), dtype=torch.float64).float().double()
    v = (x2.double().cpu() * r).float().double()
    assert_same(q.double().cpu(), round_fp8_oracle(v, fmt), "per-tensor codes vs the float64 oracle")
    g, s = K.quantize_1x16(x, fmt)
    g_ref, s_ref = fp8.quantize_1x16_reference(x, fmt)
    assert_same(s, s_ref, "1x16 bf16 scales")
    assert_same(s.cpu(), fp8.quantize_1x16_reference(x.cpu(), fmt)[1], "1x16 scales vs the CPU reference")
    assert_same(g, g_ref, "1x16 codes")
    for dt in (torch.float32, torch.bfloat16):
        assert_same(K.dequantize_1x16(g, s, dt), fp8.dequantize_1x16_reference(g, s, dt), f"dequantize -> {dt}")
    # transposed copy only (the backward's casts): the same transposed codes, no row-wise ones
    e, qt_only, s_only = K.cast_tensorwise(x2, amax, fmt, True, rowwise=False)
    assert e.numel() == 0
    assert_same(qt_only, qt_ref, "transposed-only codes")
    assert_same(s_only, scale_ref, "transposed-only scale")
    # into existing buffers (the weight cache), filled with garbage first
    bufs = (torch.full_like(q, 3.0), torch.full_like(qt, -5.0), torch.full_like(scale, 7.0),
            torch.full_like(amax, 1e30))
    fp8.quantize_tensorwise_into(x2, fmt, *bufs)
    for got, want, what in zip(bufs, (q_ref, qt_ref, scale_ref, amax), ("q", "qt", "scale", "amax")):
        assert_same(got, want, f"quantize_tensorwise_into {what}")
    # the public (dispatching) entry points pick the kernel on CUDA and agree
    pq, _, ps = fp8.quantize_tensorwise(x2, fmt)
    assert_same(pq, q_ref, "public quantize_tensorwise codes")
    assert_same(ps, scale_ref, "public quantize_tensorwise scale")


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_many_weights_in_two_launches_bit_exact(fmt, aligned):
    """The weight refresh's multi-tensor amax and cast (kernels.fp8.quantize_tensorwise_many) against the
    reference per tensor: odd shapes (scalar accesses) or only multiples of 16 (the vectorized variant: the
    1.36B model's weight shapes), an all-zero weight, mixed magnitudes; garbage in the buffers first; a second
    call reuses the plan and sees new values."""
    shapes = ([(6144, 2048), (16, 32), (11264, 2048), (2048, 5632), (48, 16)] if aligned else
              [(37, 50), (6144, 2048), (1, 16), (11264, 2048), (2048, 5632), (130, 7), (40, 3)])
    xs = [(_data(sh, 30 + i) * 10.0 ** (i % 3 - 1)).contiguous() for i, sh in enumerate(shapes)]
    xs[-1].zero_()
    dt = fp8.get_format(fmt).dtype
    qs = [torch.full(x.shape, 3.0, device=DEV).to(dt) for x in xs]
    qts = [torch.full(x.shape[::-1], -5.0, device=DEV).to(dt) for x in xs]
    scales = [torch.full((), 7.0, device=DEV) for _ in xs]
    plan = fp8.quantize_tensorwise_many(xs, fmt, qs, qts, scales)
    assert plan is not None and plan.aligned == aligned  # the kernels ran, the variant asked for
    for step in range(2):
        for i, x in enumerate(xs):
            q_ref, qt_ref, s_ref = fp8.cast_tensorwise_reference(x, fp8.amax_reference(x), fmt, True)
            assert_same(scales[i], s_ref, f"tensor {i} scale (call {step})")
            assert_same(qs[i], q_ref, f"tensor {i} codes (call {step})")
            assert_same(qts[i], qt_ref, f"tensor {i} transposed codes (call {step})")
        for x in xs:
            x.mul_(1.5)
        again = fp8.quantize_tensorwise_many(xs, fmt, qs, qts, scales, plan)
        assert again is plan  # same tensors and buffers: the tables are reused


def test_weight_refresher_equals_one_cache_at_a_time():
    """Fp8WeightRefresher (the trainer's, after each step) leaves every cache as cache.refresh would."""
    from megacoat.config import ModelConfig
    from megacoat.model.transformer import LayerContext, TransformerLayer
    from megacoat.precision.linear import Fp8WeightRefresher, _fp8_caches
    m = ModelConfig(hidden_size=256, num_attention_heads=4, ffn_hidden_size=704, num_query_groups=4, kv_channels=64)
    lc = LayerContext(None, False, None, torch.bfloat16, torch.device(DEV), 3, fp8=Fp8Recipe())
    layers = torch.nn.ModuleList(TransformerLayer(m, lc, i) for i in range(2))
    refresher = Fp8WeightRefresher(layers)
    refresher()
    for mod, c in _fp8_caches(layers):
        assert not c.needs_refresh(mod.weight)
        ref = Fp8WeightCache(c.fmt)
        ref.refresh(mod.weight)
        for got, want, what in ((c.wq, ref.wq, "W"), (c.wqt, ref.wqt, "W^T"), (c.scale, ref.scale, "scale")):
            assert_same(got, want, f"refreshed {what}")


def test_quantizer_edges():
    """Zeros (scale EPS / max, codes 0), an exact power of two, values that saturate with a stale amax."""
    z = torch.zeros(3, 40, device=DEV, dtype=torch.bfloat16)
    q, qt, s = fp8.quantize_tensorwise(z, "e4m3", transpose=True)
    assert_same(q, torch.zeros_like(q), "codes of zeros")
    assert_same(s, fp8.scale_from_amax(torch.zeros((), device=DEV), "e4m3"), "scale of zeros")
    g, gs = fp8.quantize_1x16(z, "e4m3")
    assert_same(gs, fp8.quantize_1x16_reference(z, "e4m3")[1], "1x16 scales of zeros")
    x = _data((64, 96), 3)
    stale = (x.float().abs().amax() / 8).reshape(())
    q, _, _ = K.cast_tensorwise(x, stale, "e5m2", False)
    q_ref, _, _ = fp8.cast_tensorwise_reference(x, stale, "e5m2", False)
    assert_same(q, q_ref, "saturated codes")
    assert q.float().abs().max().item() == 57344.0 and torch.isfinite(q.float()).all()


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(37, 72), (2, 129, 2048), (5, 4096)])
def test_norm_kernels(rms, with_residual, shape):
    k = shape[-1]
    x, r = _data(shape, 2, 0.1), _data(shape, 3, 0.1)
    w, b = _data((k,), 4), (None if rms else _data((k,), 5))
    res = r if with_residual else None
    out = KA.norm_fwd(x, res, w, b, 1e-5, rms)
    ref = A.norm_fwd_reference(x, res, w, b, 1e-5, rms)
    if with_residual:
        assert_same(out[0], ref[0], "bf16 residual stream")
    assert_same(out[4], ref[4], "1x16 scales of the saved stream")
    assert_same(out[3], ref[3], "saved E4M3 1x16 copy of the stream")
    assert_close(out[5], ref[5], 1e-5 * ref[5].double().abs(), "rstd")
    if not rms:
        assert_close(out[6], ref[6], 1e-5 * ref[6].double().abs() + 1e-6, "mean")
    assert_ulps(out[1], ref[1], extra=1e-3 * ref[1].float().abs().max().item(), what="normalized output")
    assert_same(out[2], out[1].float().abs().amax(), "amax of the emitted output")
    dy = _data(shape, 6)
    got = KA.norm_bwd(dy, ref[3], ref[4], ref[5], ref[6], w, b is not None, rms)
    exp = A.norm_bwd_reference(dy, ref[3], ref[4], ref[5], ref[6], w, b is not None, rms)
    assert_ulps(got[0], exp[0], extra=1e-3 * exp[0].float().abs().max().item(), what="dx")
    assert_ulps(got[1], exp[1], ulps=2, extra=1e-3 * exp[1].float().abs().max().item(), what="dweight")
    if b is not None:
        assert_ulps(got[2], exp[2], ulps=2, extra=1e-3 * exp[2].float().abs().max().item(), what="dbias")
    if with_residual:  # the residual stream's gradient added inside the kernel
        dres = _data(shape, 8)
        got = KA.norm_bwd(dy, ref[3], ref[4], ref[5], ref[6], w, b is not None, rms, dres, want_amax=True)
        exp = A.norm_bwd_reference(dy, ref[3], ref[4], ref[5], ref[6], w, b is not None, rms, dres)
        assert_ulps(got[0], exp[0], extra=1e-3 * exp[0].float().abs().max().item(), what="dx with the residual's gradient")
        assert_same(got[3], got[0].float().abs().amax(), "amax of the emitted dx")


@pytest.mark.parametrize("shape", [(37, 2 * 40), (256, 2 * 5632), (3, 7, 2 * 24)])
def test_swiglu_kernels(shape):
    h = _data(shape, 7)
    p, amax, hq, hs = KA.swiglu_fwd(h)
    p_r, _, hq_r, hs_r = A.swiglu_fwd_reference(h)
    assert_same(hs, hs_r, "1x16 scales of gate/up")
    assert_same(hq, hq_r, "saved E4M3 codes of gate/up")
    assert_ulps(p, p_r, extra=1e-6, what="silu(gate) * up")
    assert_same(amax, p.float().abs().amax(), "amax of the emitted product")
    dp = _data(p.shape, 8)
    exp = A.swiglu_bwd_reference(dp, hq_r, hs_r)[0]
    got, got_amax = KA.swiglu_bwd(dp, hq_r, hs_r)
    assert_ulps(got, exp, extra=1e-5 * exp.float().abs().max().item(), what="dh")
    assert_same(got_amax, got.float().abs().amax(), "amax of the emitted dh")


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("shape,tile", [((37, 2 * 40), None), ((8192, 2 * 5632), None), ((3, 7, 2 * 24), None),
                                        ((130, 2 * 200), (64, 128, 8)), ((130, 2 * 200), (32, 32, 4))])
def test_swiglu_bwd_quantized_kernel(shape, tile, fmt, monkeypatch):
    """The SwiGLU backward straight to per-tensor codes (both layouts, no bf16 dh written): bit for bit the
    codes of the bf16 dh kernel followed by the cast with its amax, and the reference's up to its rounding."""
    if tile is not None:
        monkeypatch.setitem(KA.TILES, "swiglu_bwd_cast", tile)
    h = _data(shape, 7)
    _, _, hq, hs = KA.swiglu_fwd(h)
    dp = _data((*shape[:-1], shape[-1] // 2), 8)
    gq, gqt, scale, amax = KA.swiglu_bwd_quantized(dp, hq, hs, fmt)
    dh, dh_amax = KA.swiglu_bwd(dp, hq, hs)
    q2, qt2, s2 = K.cast_tensorwise(dh.reshape(-1, shape[-1]), dh_amax, fmt, True)
    assert_same(amax, dh_amax, "amax of dh")
    assert_same(scale, s2, "scale")
    assert_same(gq, q2, "row-major codes")
    assert_same(gqt, qt2, "transposed codes")
    rq, _, rs, _ = A.swiglu_bwd_quantized_reference(dp, hq, hs, fmt)
    # the reference's dh differs by bf16 rounding (FMA contraction), so a code may be its neighbour
    step = 2.0 ** -(2 if fmt == "e5m2" else 3)
    got, want = gq.float() * scale, rq.float() * rs
    assert_close(got, want, step * want.abs() + 2 * rs.float(), "dequantized codes vs the reference")


@pytest.mark.parametrize("kind", ["silu", "gelu"])
@pytest.mark.parametrize("shape", [(21, 33), (512, 4096)])
def test_activation_kernels(kind, shape):
    h = _data(shape, 9)
    y, amax, hq, hs = KA.act_fwd(h, kind)
    y_r, _, hq_r, hs_r = A.act_fwd_reference(h, kind)
    assert_same(hs, hs_r, "1x16 scales of h")
    assert_same(hq, hq_r, "saved E4M3 codes of h")
    # 1e-6 absolute: GELU's reference computes 1 + tanh(z), which cancels for x << 0 (the kernel does not)
    assert_ulps(y, y_r, extra=1e-6, what=f"{kind}(h)")
    assert_same(amax, y.float().abs().amax(), "amax of the emitted output")
    dy = _data(shape, 10)
    exp = A.act_bwd_reference(dy, hq_r, hs_r, kind)
    assert_ulps(KA.act_bwd(dy, hq_r, hs_r, kind), exp, extra=1e-5 * exp.float().abs().max().item(), what="dh")


@pytest.mark.parametrize("m,k,n", [(256, 512, 768), (1024, 2048, 1536)])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_scaled_mm_matches_float64_product(m, k, n, fast_accum):
    a, bt = _data((m, k), 11, 0.5), _data((n, k), 12, 0.05)
    qa, _, sa = fp8.quantize_tensorwise(a, "e5m2")
    qb, _, sb = fp8.quantize_tensorwise(bt, "e4m3")
    a64, b64 = qa.double() * sa.double(), qb.double() * sb.double()
    exact = a64 @ b64.t()
    bound = a64.abs() @ b64.abs().t()  # sum |a||b|: what accumulation error scales with
    for out_dtype, out_ulp in ((torch.bfloat16, 2 ** -8), (torch.float32, 2 ** -24)):
        got = fp8_gemm(qa, sa, qb, sb, out_dtype, fast_accum=fast_accum, hw=True)
        assert got.dtype == out_dtype
        # Fast accumulation keeps a reduced-precision accumulator (no periodic promotion to fp32): on the
        # H200 a few elements in 10^5 exceed 2^-9 sum|a||b| by up to 1.3x, so 4x looser.
        rel_bound = 2 ** -7 if fast_accum else 2 ** -9
        assert_close(got, exact, rel_bound * bound + out_ulp * exact.abs(), f"_scaled_mm -> {out_dtype}")
        rel = ((got.double() - exact).norm() / exact.norm()).item()
        assert rel < (3e-2 if fast_accum else 1e-2), (out_dtype, fast_accum, rel)


@pytest.mark.parametrize("shape", [(1024, 2, 2048, 5632), (7, 3, 40, 24)])  # _scaled_mm path; odd: emulation
def test_fp8_linear_on_gpu(shape):
    s, b, k, n = shape
    x = _data((s, b, k), 13).requires_grad_(True)
    w = _data((n, k), 14, 0.02).requires_grad_(True)
    w.main_grad = torch.full((n, k), float("nan"), device=DEV)  # overwritten: the step's first gradient
    w.main_grad_overwrite = torch.ones(1, dtype=torch.bool)
    y = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), Fp8Recipe(), fuse_wgrad=True)
    g = _data(y.shape, 15)
    y.backward(g)
    xr, wr = x.detach().double(), w.detach().double()
    yr = xr @ wr.t()
    assert ((y.double() - yr).norm() / yr.norm()).item() < 0.06
    dx = g.double() @ wr
    assert ((x.grad.double() - dx).norm() / dx.norm()).item() < 0.1
    dw = g.double().reshape(-1, n).t() @ xr.reshape(-1, k)
    assert ((w.main_grad.double() - dw).norm() / dw.norm()).item() < 0.1


@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe(fp8_activations=False), Fp8Recipe(cache_weights=False)],
                         ids=["coat", "tensorwise", "no_weight_cache"])
def test_fp8_path_has_no_host_sync(recipe):
    """Forward + backward of an FP8 linear and of the fused ops never synchronize with the host
    (torch raises on any synchronizing call in sync-debug mode 'error')."""
    x = _data((256, 2, 512), 16).requires_grad_(True)
    w = _data((768, 512), 17, 0.02).requires_grad_(True)
    w.main_grad = torch.zeros(768, 512, device=DEV)
    w.main_grad_overwrite = torch.ones(1, dtype=torch.bool)
    nw = _data((512,), 18)
    cache = Fp8WeightCache("e4m3", persistent=recipe.cache_weights)
    for step in range(2):  # the first call compiles the kernels (outside the checked region)
        if step:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            _, y, amax = A.fp8_norm(x, nw, None, 1e-5, True)
            out = fp8_linear(y, w, None, cache, recipe, x_amax=amax, fuse_wgrad=True)
            p, p_amax = A.fp8_swiglu(out)
            p.float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.main_grad).all() and torch.isfinite(x.grad).all()


def _layer(fp8_recipe, compile_layer):
    from megacoat.model.transformer import LayerContext, TransformerLayer
    from megacoat.parallel.random import seed_everything
    from parallel_harness import small_model_config

    m = small_model_config(hidden_size=512, num_attention_heads=8, seq_length=256, num_layers=2,
                           ffn_hidden_size=1376)
    rng = seed_everything(3, 0, torch.device(DEV))
    lc = LayerContext(None, False, rng, torch.bfloat16, torch.device(DEV), 3, fp8=fp8_recipe)
    layer = TransformerLayer(m, lc, 0)
    if compile_layer:
        layer.compile()
    return layer


def test_compiled_coat_layer_no_graph_breaks_and_matches_eager():
    import torch._dynamo as dynamo
    from megacoat.precision.linear import refresh_fp8_weights

    dynamo.reset()
    dynamo.utils.counters.clear()
    recipe = Fp8Recipe()
    eager, compiled = _layer(recipe, False), _layer(recipe, True)
    compiled.load_state_dict(eager.state_dict())
    x = _data((256, 2, 512), 16, 0.5)
    outs = []
    for layer in (eager, compiled):
        refresh_fp8_weights(layer)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.float().pow(2).mean().backward()
        outs.append((y.detach(), xi.grad))
    assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])
    for name, a, b in zip(("output", "input gradient"), *outs):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, f"compiled vs eager {name}: relative error {rel:.3g}"


def _train_small_gpt(dtype, recipe, steps=20):
    """A 2-layer GPT (hidden 256, seq 64) trained eagerly for `steps` steps of 2 micro-batches:
    -> (losses, the first step's gradients by parameter name, fp32)."""
    from megacoat.config import OptimizerConfig
    from megacoat.model.gpt import GPTModel, padded_vocab_size
    from megacoat.model.transformer import LayerContext
    from megacoat.optim.optimizer import MixedPrecisionAdamW
    from megacoat.parallel.context import ParallelContext
    from megacoat.parallel.random import seed_everything
    from megacoat.precision.linear import invalidate_fp8_weights
    from parallel_harness import VOCAB, batches, run_step, small_model_config

    m = small_model_config(hidden_size=256, num_attention_heads=4, seq_length=64, num_layers=2, ffn_hidden_size=704)
    ctx = ParallelContext.build(1, 1, torch.device(DEV))
    rng = seed_everything(5, 0, ctx.device)
    model = GPTModel(m, LayerContext(None, False, rng, dtype, ctx.device, 5, fp8=recipe), VOCAB,
                     padded_vocab_size(VOCAB, 8, 1))  # eager: the compiled path is the test above
    opt = MixedPrecisionAdamW(model, OptimizerConfig(lr=3e-3, clip_grad=1.0), ctx)
    losses, first_grads = [], {}
    for s in range(steps):
        losses.append(run_step(model, opt, batches(s % 4, 2, 4, 64), 2))
        if s == 0:
            for n, p in model.named_parameters():
                g = getattr(p, "main_grad", None)
                first_grads[n] = (g if g is not None else p.grad).detach().float().clone()
        opt.step(3e-3)
        invalidate_fp8_weights(model)
    return losses, first_grads


@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe(fp8_activations=False)], ids=["coat", "tensorwise"])
def test_small_gpt_triton_kernels_match_references(recipe, monkeypatch):
    """The same model, data and recipe with the Triton kernels and with the torch references, on the GPU.
    The kernels are bit-exact or within an ulp of their references one by one (tests above); this checks
    their composition in the model (saved tensors, emitted amax values, fused residual gradients): the
    first step's gradients agree to a few FP8 code flips, the losses of 20 steps stay together."""
    got_losses, got = _train_small_gpt(torch.bfloat16, recipe)
    monkeypatch.setattr(A, "_kernel_ok", lambda *t: False)
    monkeypatch.setattr(fp8, "_kernel_ok", lambda *t: False)
    exp_losses, exp = _train_small_gpt(torch.bfloat16, recipe)
    rel = {n: ((got[n] - exp[n]).norm() / exp[n].norm().clamp_min(1e-30)).item() for n in exp}
    bad = {n: f"{r:.3g}" for n, r in rel.items() if r > 2e-2}
    assert not bad, f"first-step gradients, kernels vs references (relative): {bad}; all: {rel}"
    # Single steps late in a run at lr 3e-3 are chaotic (see the next test): 0.057 apart at step 18 of 20 on an
    # H200 with the first 10 steps within 0.004. So: the early steps closely, the end as a mean.
    early = max(abs(a - b) for a, b in zip(got_losses[:10], exp_losses[:10]))
    end = abs(sum(got_losses[-5:]) - sum(exp_losses[-5:])) / 5
    assert early < 0.02 and end < 0.05, f"losses, kernels {got_losses} vs references {exp_losses}"


def test_small_gpt_coat_on_gpu_tracks_fp32():
    """bf16, coat and tensorwise each against an fp32 run of the same model and data. The allowed gap is
    bf16's own gap plus a fixed FP8 margin: on a GPU the bf16 attention/GEMM noise alone moves a
    20-step run by a few hundredths, so a fixed threshold against bf16 would test noise.
    The gap is taken where the runs end (mean of the last 5 losses), not at the worst single step: at
    lr 3e-3 single steps are chaotic (on an H200 coat's worst step was 0.157 off fp32, its last-5 mean
    0.029; tensorwise 0.083 and 0.015; bf16 0.031 and 0.007), and a rounding change anywhere moves
    them. Kernel bugs are caught by the kernels-vs-references test above, which compares gradients.
    The first step (no update yet) isolates the forward error: a broken quantizer moves it by > 0.05."""
    losses = {}
    runs = (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("coat", torch.bfloat16, Fp8Recipe()),
            ("tensorwise", torch.bfloat16, Fp8Recipe(fp8_activations=False)))
    for name, dtype, recipe in runs:
        losses[name] = _train_small_gpt(dtype, recipe)[0]
    ref = losses["fp32"]
    assert ref[-1] < ref[0] - 0.5, ref  # the fp32 run learns (on the H200: 5.41 -> 4.69 in 20 steps)

    def gap(name):  # where the run ends: the mean of the last 5 losses against fp32's
        return abs(sum(losses[name][-5:]) - sum(ref[-5:])) / 5

    bf16_gap = gap("bf16")
    for name in ("coat", "tensorwise"):
        first = abs(losses[name][0] - ref[0])
        assert first < 0.05, f"{name}: first-step loss {losses[name][0]:.4f} vs fp32 {ref[0]:.4f}"
        assert gap(name) < 2 * bf16_gap + 0.04, \
            f"{name}: gap to fp32 {gap(name):.4f} (bf16's {bf16_gap:.4f}); losses {losses}"
