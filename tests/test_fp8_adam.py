"""COAT FP8 optimizer states (megacoat.optim.fp8_adam): the reference against COAT's own kernel
outputs (tests/data, see tests/data/README.md), edge-case groups against a float64 computation of COAT's
group statistics (scale s, exponent k, centre c), the flat codec (chunks, bf16 gradients, weight writing, clip,
skip)."""
import math

import pytest
import torch
from coat_golden import golden_grad, load_coat_golden

from megacoat.config import OptimizerConfig, round_to_fp32
from megacoat.optim.fp8_adam import (FP8_MAX, GROUP, K16, K_MAX, TINY, AdamHyper, Chunk, MomentState,
                                     PrecisionAwareAdamW, decay_table, dequantize_groups, group_stats,
                                     quantize_groups, reference_step)



@pytest.mark.parametrize("variant", ["expand", "plain"])
def test_reference_reproduces_coat_golden(variant):
    gold = load_coat_golden()
    h = gold["hyper"]
    assert h["group"] == GROUP and h["expand_min"] == 16
    hp = AdamHyper(h["beta1"], h["beta2"], h["eps"], h["wd"])
    expand = variant == "expand"
    for i, shape in enumerate(gold["shapes"]):
        n = math.prod(shape)
        size = -(-n // GROUP) * GROUP  # the last group of a tensor is partial: zero padding
        master = torch.zeros(size)
        master[:n] = gold["init"][i].reshape(-1)
        nk, gk = gold["kept"][i], -(-gold["kept"][i] // GROUP)  # compared: the kept prefix
        grad = torch.zeros(size)
        m, v = MomentState("fp8", size, "cpu", expand), MomentState("fp8", size, "cpu", expand)
        step = torch.zeros(())
        decay = torch.ones(size // GROUP, dtype=torch.bool)
        for t in range(1, 21):
            grad[:n] = golden_grad(t, i, shape).reshape(-1)
            reference_step(master, [Chunk(0, size, grad)], m, v, decay, hp, h["lr"], torch.ones(()), step)
            step += 1
            if t not in (1, 10, 20):
                continue
            want = gold[variant][t][i]
            codes_equal = torch.cat([m.data[:nk] == want["m"], v.data[:nk] == want["v"]])
            ref_p = want["param"]
            # relative L2 error (a code that flips at an unchecked step moves one element by ~1e-5)
            rel = ((master[:nk] - ref_p).norm() / ref_p.norm()).item()
            if expand:  # tests/data/README.md: identical codes and k at steps 1, 10, 20; parameters within 2e-5
                assert bool(codes_equal.all()), (i, t, int((~codes_equal).sum()))
                assert torch.equal(m.k[:gk], want["km"]) and torch.equal(v.k[:gk], want["kv"]), (i, t)
                assert rel <= 2e-5, (i, t, rel)
            else:  # tests/data/README.md: >= 99.99% identical codes (1e-20 vs 1e-30 offset), parameters within 4e-5
                assert codes_equal.float().mean().item() >= 0.9999, (i, t)
                assert rel <= 4e-5, (i, t, rel)
            assert padding_is_zero(master, m, v, n)


def padding_is_zero(master, m, v, n) -> bool:
    return bool((master[n:] == 0).all() and (m.data[n:] == 0).all() and (v.data[n:] == 0).all())


# ---------------------------------------------------------------------------------- edge groups
def _stats64(x: torch.Tensor):
    """COAT's group statistics in float64 (one group per row), with the cap on k: mx and mn (the nonzero
    min) plus TINY, c = sqrt(mx * mn), k = floor(16 log2(448^2 / 2) / log2(mx / mn)) / 16, s = (mx / c)^k / 448."""
    a = x.double().abs()
    mx = a.amax(1) + TINY
    nz = torch.where(a > 0, a, math.inf).amin(1)
    mn = torch.where(torch.isinf(nz), 0.0, nz) + TINY
    c = mx.sqrt() * mn.sqrt()
    exact_k = 16 * math.log2(FP8_MAX ** 2 / 2) / torch.log2(mx / mn)   # inf for R = 1
    k = torch.clamp(torch.floor(exact_k) / 16, max=K_MAX)
    s = (mx / c) ** k / FP8_MAX
    return s, k, c, exact_k


def _edge_groups():
    g = torch.Generator().manual_seed(3)
    rows = {
        "all_zero": torch.zeros(GROUP),
        "constant": torch.full((GROUP,), 0.37),
        "constant_negative_with_zeros": torch.where(torch.arange(GROUP) % 3 == 0, 0.0, -2.5e-4),
        "zeros_inside": torch.randn(GROUP, generator=g) * (torch.rand(GROUP, generator=g) > 0.5),
        "zero_at_lane_0_of_every_warp_quarter": torch.randn(GROUP, generator=g).index_fill(0, torch.arange(0, GROUP, 4), 0),
        "tiny_range": 1 + torch.rand(GROUP, generator=g) * 1e-6,
        "huge_range": torch.exp(torch.rand(GROUP, generator=g) * 120 - 70),   # 1e-30 .. 1e22
        "tiny_values": torch.randn(GROUP, generator=g) * 1e-20,
        "single_element": torch.zeros(GROUP).index_fill(0, torch.tensor([0]), 3.0),
        "partial_group_7": torch.cat([torch.randn(7, generator=g), torch.zeros(GROUP - 7)]),
        "normal": torch.randn(GROUP, generator=g) * torch.exp(torch.randn(1, generator=g)),
        "second_moment_like": torch.randn(GROUP, generator=g) ** 2 * 1e-8,
    }
    return list(rows), torch.stack(list(rows.values()))


def test_group_statistics_match_float64():
    names, x = _edge_groups()
    s, k, c = group_stats(x, expand=True)
    s64, k64, c64, exact_k = _stats64(x)
    for i, name in enumerate(names):
        frac = exact_k[i] - torch.floor(exact_k[i])
        if math.isfinite(exact_k[i]) and min(frac, 1 - frac) < 1e-3:
            continue  # a floor boundary: fp32 and float64 may round to either side
        assert k[i].item() == k64[i].item(), (name, k[i].item(), k64[i].item())
        assert abs(c[i].item() - c64[i].item()) <= 1e-6 * c64[i].item(), name
        # s = (mx / c)^k / 448: fp32 rounding of mx / c (a few ulps) is amplified k times
        rtol = 1e-6 + 4 * k64[i].item() * 2.0 ** -23
        assert abs(s[i].item() - s64[i].item()) <= rtol * s64[i].item(), (name, s[i].item(), s64[i].item())
    assert k[names.index("all_zero")] == K_MAX and k[names.index("constant")] == K_MAX
    assert k[names.index("single_element")] == K_MAX
    assert k[names.index("huge_range")] < 0.2    # a huge range is compressed (k = 1/16 .. 2/16)


def test_true_nonzero_minimum_sets_k():
    """COAT's kernel loses lanes after a zero in its min reduction; the true nonzero min decides k."""
    x = torch.full((1, GROUP), 1.0)
    x[0, 0] = 0.0
    x[0, 77] = 2.0 ** -10   # the nonzero minimum sits far from lane 0
    _, k, _ = group_stats(x, expand=True)
    assert k.item() == math.floor(K16 / 10) / 16  # log2(R) = 10


def test_round_trip_against_float64():
    names, x = _edge_groups()
    s, k, c = group_stats(x, expand=True)
    q = quantize_groups(x, s, k, c, expand=True)
    back = dequantize_groups(q, s, k, c, expand=True)
    # float64 pipeline: expand, scale, E4M3 round, dequantize
    s64, k64, c64, _ = _stats64(x)
    xe = torch.sign(x.double()) * (x.double().abs() / c64[:, None]) ** k64[:, None]
    q64 = (xe / s64[:, None]).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn)
    y = q64.double() * s64[:, None]
    back64 = torch.sign(y) * y.abs() ** (1 / k64[:, None]) * c64[:, None]
    for i, name in enumerate(names):
        same = q[i] == q64[i].view(torch.uint8)
        assert same.float().mean() >= 0.95, (name, same.float().mean())
        err = (back[i].double() - back64[i]).abs()[same]
        assert (err <= 1e-5 * back64[i].abs()[same] + 1e-37).all(), name
        zero = x[i] == 0
        assert (back[i][zero] == 0).all(), name   # exact zeros stay exact
    for name in ("constant", "tiny_range", "constant_negative_with_zeros", "single_element"):
        i = names.index(name)
        torch.testing.assert_close(back[i], x[i], rtol=2e-6, atol=0)
    i = names.index("all_zero")
    assert (q[i] == 0).all() and (back[i] == 0).all()


def test_expansion_beats_absmax_on_wide_groups():
    """What expansion is for: smaller relative error on groups spanning many orders of magnitude."""
    g = torch.Generator().manual_seed(5)
    x = torch.exp(torch.randn(64, GROUP, generator=g) * 3) * torch.sign(torch.randn(64, GROUP, generator=g))
    errs = []
    for expand in (False, True):
        s, k, c = group_stats(x, expand)
        back = dequantize_groups(quantize_groups(x, s, k, c, expand), s, k, c, expand)
        errs.append(((back - x).abs() / x.abs()).mean().item())
    assert errs[1] < 0.5 * errs[0], errs


# ---------------------------------------------------------------------------------- the codec
def _cfg(**kw):
    base = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
    base.update(kw)
    return OptimizerConfig(**base)


def _chunked_setup(grad_dtype, seed=0, fmt=("fp8", "fp8")):
    """Three parameters of odd sizes (partial last groups), bf16 weights, grads in one buffer."""
    g = torch.Generator().manual_seed(seed)
    sizes = [300, 128, 77]
    offsets, n = [], 0
    for s in sizes:
        offsets.append(n)
        n += -(-s // GROUP) * GROUP
    master = torch.zeros(n)
    grad_buf = torch.zeros(sum(sizes), dtype=grad_dtype)
    weights = [torch.zeros(s, dtype=torch.bfloat16) for s in sizes]
    chunks, pos = [], 0
    for s, off, w in zip(sizes, offsets, weights):
        master[off: off + s] = torch.randn(s, generator=g) * 0.02
        chunks.append(Chunk(off, off + -(-s // GROUP) * GROUP, grad_buf[pos: pos + s], w))
        pos += s
    decay = decay_table([(off, s, i != 1) for i, (off, s) in enumerate(zip(offsets, sizes))], n, "cpu")
    codec = PrecisionAwareAdamW(master, chunks, decay, _cfg(), *fmt, expand=True)
    return codec, grad_buf, g, sizes, offsets


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_codec_chunks_equal_flat_reference(grad_dtype):
    """Per-parameter chunks with partial groups and bf16 gradients == one flat reference step."""
    codec, grad_buf, g, sizes, offsets = _chunked_setup(grad_dtype)
    n = codec.master.numel()
    master = codec.master.clone()
    m, v = MomentState("fp8", n, "cpu", True, codec.m.fast), MomentState("fp8", n, "cpu", True, codec.v.fast)
    step = torch.zeros(())
    for t in range(5):
        grad_buf.copy_(torch.randn(grad_buf.numel(), generator=g) * 10 ** (-t))
        flat = torch.zeros(n)
        pos = 0
        for s, off in zip(sizes, offsets):
            flat[off: off + s] = grad_buf[pos: pos + s].float()
            pos += s
        norm = flat.norm()
        coeff = torch.clamp(1.0 / (norm + 1e-6), max=1.0)   # clip_grad = 1
        assert bool(codec.step(1e-3, norm))
        reference_step(master, [Chunk(0, n, flat)], m, v, codec.group_decay, codec.hp, 1e-3, coeff, step)
        step += 1
        assert torch.equal(codec.master, master) and torch.equal(codec.m.data, m.data) and torch.equal(codec.v.k, v.k)
        for w, s, off in zip(codec.chunks, sizes, offsets):
            assert torch.equal(w.weight, master[off: off + s].to(torch.bfloat16))
    assert codec.step_count.item() == 5
    for s, off in zip(sizes, offsets):  # padding of every parameter's last group stays zero
        end = off + -(-s // GROUP) * GROUP
        assert (codec.master[off + s: end] == 0).all() and (codec.m.data[off + s: end] == 0).all()


def test_weight_decay_per_parameter():
    codec, grad_buf, _, sizes, offsets = _chunked_setup(torch.float32)
    before = codec.master.clone()
    codec.step(1.0, torch.zeros(()))  # zero gradient: only weight decay moves the weights
    for i, (s, off) in enumerate(zip(sizes, offsets)):
        moved = not torch.equal(codec.master[off: off + s], before[off: off + s])
        assert moved == (i != 1), i   # parameter 1 has no weight decay


def test_skipped_step_leaves_every_state_untouched():
    codec, grad_buf, g, _, _ = _chunked_setup(torch.bfloat16)
    grad_buf.copy_(torch.randn(grad_buf.numel(), generator=g))
    codec.step(1e-3, grad_buf.float().norm())
    state = [t.clone() for t in [codec.master, codec.step_count] + codec.m.tensors() + codec.v.tensors()
             + [c.weight for c in codec.chunks]]
    grad_buf[3] = float("nan")
    ok = codec.step(1e-3, torch.tensor(float("inf")))
    assert not bool(ok)
    after = [codec.master, codec.step_count] + codec.m.tensors() + codec.v.tensors() + [c.weight for c in codec.chunks]
    for a, b in zip(state, after):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp8"), ("fp8", "fp32")])
def test_mixed_formats_track_fp32(fmt):
    """Every combination runs through one codec; states track fp32 states closely."""
    runs = {}
    for f in (("fp32", "fp32"), fmt):
        codec, grad_buf, g, _, _ = _chunked_setup(torch.float32, seed=1, fmt=f)
        for t in range(10):
            grad_buf.copy_(torch.randn(grad_buf.numel(), generator=g) * 1e-2)
            codec.step(1e-3, grad_buf.norm())
        runs[f] = codec.master.clone()
    ref, got = runs[("fp32", "fp32")], runs[fmt]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 5e-2
    if fmt == ("fp32", "fp32"):
        return
    codec, *_ = _chunked_setup(torch.float32, fmt=fmt)
    per = {"fp32": 4, "bf16": 2, "fp8": 1 + 12 / 128}
    assert codec.bytes_per_element == per[fmt[0]] + per[fmt[1]]


def test_fp8_states_bytes_per_param():
    codec, *_ = _chunked_setup(torch.float32)
    assert codec.bytes_per_element == 2 + 24 / 128 <= 2.2


def _round_fp32(x):
    """The fp32 nearest to the exact rational x (ties to even; normal range)."""
    from fractions import Fraction
    if x == 0:
        return Fraction(0)
    sign, x = (1 if x > 0 else -1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    e += 1 if Fraction(2) ** e <= x / 2 else 0
    e -= 1 if Fraction(2) ** e > x else 0
    m = x * Fraction(2) ** (23 - e)
    q, rem = divmod(m.numerator, m.denominator)
    if 2 * rem > m.denominator or (2 * rem == m.denominator and q % 2):
        q += 1
    return sign * Fraction(q) / Fraction(2) ** (23 - e)


def test_markstein_division_equals_correctly_rounded_quotient():
    """The kernel computes sqrt(v) / bc2 as q0 = a * r, q = fma(fma(-q0, bc2, a), r, q0) with r the rounded
    reciprocal (csrc/fused_adamw.cu): the same bits as IEEE division, checked here in exact rationals over
    the bias corrections of steps 1..10^6 and numerators over 80 decades, with mantissas near 1 and 2."""
    import random
    from fractions import Fraction
    rnd = random.Random(7)
    f32 = lambda v: Fraction(round_to_fp32(v))  # noqa: E731
    for n in range(3000):
        t = rnd.choice([1, 2, 3, 10, 1000, rnd.randint(1, 10 ** 6)])
        d = f32(math.sqrt(1 - rnd.choice([0.95, 0.999, 0.9999]) ** t))
        a = f32(math.exp(rnd.uniform(-60, 60)))  # residuals stay normal (what _round_fp32 models)
        if n % 5 == 0:
            a = f32(float(Fraction(2) ** rnd.randint(-60, 60) * (2 - Fraction(rnd.randint(0, 7), 2 ** 23))))
        r = _round_fp32(1 / d)
        q0 = _round_fp32(a * r)
        q = _round_fp32(q0 + _round_fp32(a - q0 * d) * r)
        assert q == _round_fp32(a / d), (float(a), float(d))

