"""The fast (exp2/log2) form of COAT's dynamic range expansion against the exact (powf) form.

The fast form (the one PrecisionAwareAdamW runs; fp8_adam.quantize_groups) computes the same group
statistics (s, k, c: the same function) and evaluates (|x|/c)^k / s as exp2(k log2|x| - (k log2 c
+ log2 s)) and the inverse as exp2((log2|q| + log2 s) / k + log2 c). Both are the same real
function; only fp32 rounding differs. The exponent is at most ~|k log2|x|| in magnitude, so its
rounding error is ~1e-5 relative in the expanded value, far below half an E4M3 step (>= 1/16
relative): a code can differ only for values within that error of a rounding boundary, and then by
one step. What is guaranteed and asserted: identical k, c, s for the same input, codes within one
E4M3 step, almost all identical, dequantized values within the rounding bound, and Adam
trajectories that stay close to the exact form's. Also: the reference traces under torch.compile
with fullgraph=True (no graph break: the GPU fallback compiles it)."""
import math

import torch

from megacoat.config import OptimizerConfig
from megacoat.optim.fp8_adam import (GROUP, AdamHyper, Chunk, MomentState, PrecisionAwareAdamW, dequantize_groups,
                                     group_stats, quantize_groups, reference_step)
from megacoat.optim.fp8_adam import _reference_with_skip


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as signed integers ordered like their values (the magnitude bits are monotone)."""
    q = q.to(torch.int32)
    return torch.where(q >= 128, -(q - 128), q)


def _groups(seed=0, n=2048):
    """Groups of many kinds: normal at random scales, log-uniform over 1..40 decades, squares
    (second moments), zeros inside, constant and near-constant groups (k at the cap)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, 1, generator=g) * 4)
    x = torch.randn(n, GROUP, generator=g) * scale
    q = n // 8
    decades = torch.rand(q, 1, generator=g) * 40 + 1
    x[:q] = torch.exp((torch.rand(q, GROUP, generator=g) - 0.5) * decades * math.log(10)) * \
        torch.sign(torch.randn(q, GROUP, generator=g))
    x[q:2 * q] = x[q:2 * q] ** 2
    x[2 * q:3 * q] *= torch.rand(q, GROUP, generator=g) > 0.3
    x[3 * q] = 0.37
    x[3 * q + 1] = 1 + torch.rand(GROUP, generator=g) * 1e-6
    return x


def test_fast_codes_within_one_step_of_exact():
    x = _groups()
    s, k, c = group_stats(x, expand=True)          # one function for both forms
    exact = quantize_groups(x, s, k, c, expand=True, fast=False)
    fast = quantize_groups(x, s, k, c, expand=True, fast=True)
    dist = (_ordinal(exact) - _ordinal(fast)).abs()
    same = (dist == 0).float().mean().item()
    print(f"fast vs exact codes: identical {same:.6f}, max distance {int(dist.max())}")
    assert int(dist.max()) <= 1
    assert same >= 0.999, same                     # boundary cases only (~1e-4 expected)
    assert torch.equal(fast[x == 0], torch.zeros_like(fast[x == 0]))   # zeros stay exact zeros
    # the group's largest element maps to +-448 in both forms (k is chosen so that it does)
    top = x.abs().argmax(1, keepdim=True)
    assert torch.equal(_ordinal(fast.gather(1, top)).abs(), _ordinal(exact.gather(1, top)).abs())


def test_fast_dequantization_within_rounding_bound():
    x = _groups(seed=1)
    s, k, c = group_stats(x, expand=True)
    q = quantize_groups(x, s, k, c, expand=True)
    exact = dequantize_groups(q, s, k, c, expand=True, fast=False).double()
    fast = dequantize_groups(q, s, k, c, expand=True, fast=True).double()
    # The fast exponent (log2|q| + log2 s) / k + log2 c: |log2|q| + log2 s| <= ~18 (|q| s lies in
    # [2^-9 s, 448 s], s in [1/448, 1]), so its rounding error is <= ~3 ulp(16) / k = 3 * 2^-19 / k,
    # plus an ulp of log2 c (|log2 c| < 128: 2^-17) and exp2's 2 ulp; relative error = ln 2 * that.
    bound = math.log(2) * (3 * 2.0 ** -19 / k[:, None].double() + 2.0 ** -17) + 4 * 2.0 ** -23
    rel = (fast - exact).abs() / exact.abs().clamp_min(1e-300)
    nz = exact != 0
    print(f"fast vs exact dequantization: max relative {rel[nz].max().item():.3g}")
    assert torch.equal(fast == 0, exact == 0)
    assert bool((rel[nz] <= bound.expand_as(rel)[nz]).all()), (rel / bound)[nz].max().item()
    assert torch.equal(torch.sign(fast), torch.sign(exact))


def test_fast_statistics_identical_for_the_same_input():
    """One Adam step from the same stored state: both forms load values within the bound above,
    so the new group statistics differ only where a k sits on a floor boundary (measured: none)."""
    x = _groups(seed=2, n=512)
    hp = AdamHyper(0.9, 0.95, 1e-8, 0.1)
    n = x.numel()
    outs, codes = [], None
    for fast in (False, True):
        m, v = MomentState("fp8", n, "cpu", True, fast), MomentState("fp8", n, "cpu", True, fast)
        m.store(0, n // GROUP, x * 1e-3)
        v.store(0, n // GROUP, (x * 1e-3) ** 2)
        if codes is None:
            codes = (m.data.clone(), v.data.clone())
        m.data.copy_(codes[0])                       # the same stored codes for both forms
        v.data.copy_(codes[1])
        master = torch.zeros(n)
        grad = _groups(seed=3, n=512).reshape(-1) * 1e-3
        reference_step(master, [Chunk(0, n, grad)], m, v, torch.ones(n // GROUP, dtype=torch.bool), hp, 1e-3,
                       torch.ones(()), torch.zeros(()))
        outs.append((m, v, master))
    (m0, v0, p0), (m1, v1, p1) = outs
    for a, b in ((m0, m1), (v0, v1)):
        k_same = (a.k == b.k).float().mean().item()
        dist = (_ordinal(a.data) - _ordinal(b.data)).abs()
        print(f"one step: k identical {k_same:.5f}, codes identical {(dist == 0).float().mean().item():.6f}")
        assert k_same >= 0.995, k_same
        assert (dist == 0).float().mean().item() >= 0.995
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-9)


def _exact_form_codec(init, grad, cfg):
    """The CPU codec with its moments in COAT's powf form (the reference's fast=False; the library runs the
    fast form only): its step is the reference step on them."""
    codec = PrecisionAwareAdamW(init.clone(), [Chunk(0, init.numel(), grad)],
                                torch.ones(init.numel() // GROUP, dtype=torch.bool), cfg, "fp8", "fp8", True)
    codec.m = MomentState("fp8", init.numel(), "cpu", True, fast=False)
    codec.v = MomentState("fp8", init.numel(), "cpu", True, fast=False)
    return codec


def test_fast_adam_trajectory_tracks_exact():
    """30 Adam steps, exact vs fast form vs fp32 states (the CPU codec's step). The states are lossy
    either way; the two forms differ by occasional one-step code flips (the loaded values differ by
    ~1e-5, which moves some values across a rounding boundary; the moments' decay then carries the
    difference for a while). Asserted: the distance between the two forms' parameters is a small
    fraction of what FP8 states themselves cost (distance of either to fp32 states)."""
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0)
    n = 64 * GROUP
    g0 = torch.Generator().manual_seed(7)
    init = torch.randn(n, generator=g0) * 0.02
    codecs = []
    for fmt in ("fp32", "fp8 exact", "fp8"):
        grad = torch.zeros(n)
        if fmt == "fp8 exact":
            codec = _exact_form_codec(init, grad, cfg)
        else:
            codec = PrecisionAwareAdamW(init.clone(), [Chunk(0, n, grad)], torch.ones(n // GROUP, dtype=torch.bool),
                                        cfg, fmt, fmt, True)
        codecs.append((codec, grad))
    assert not codecs[1][0].m.fast and codecs[2][0].m.fast
    same_codes, same_k = [], []
    for t in range(30):
        scale = torch.exp(torch.randn(n // GROUP, 1, generator=g0) * 1.5).repeat(1, GROUP).view(-1)
        gg = torch.randn(n, generator=g0) * scale * 1e-3
        for codec, grad in codecs:
            grad.copy_(gg)
            codec.step(1e-3, torch.zeros(()))
        a, b = codecs[1][0], codecs[2][0]
        dist = (_ordinal(a.m.data) - _ordinal(b.m.data)).abs()
        same_codes.append((dist == 0).float().mean().item())
        same_k.append((a.v.k == b.v.k).float().mean().item())
    ref, exact, fast = (c.master - init for c, _ in codecs)      # the parameters' movement
    d_forms = ((fast - exact).norm() / exact.norm()).item()
    d_fp8 = ((exact - ref).norm() / ref.norm()).item()
    print(f"30 steps, update relative L2: fast vs exact {d_forms:.3g}, exact vs fp32 states {d_fp8:.3g}; "
          f"m codes identical >= {min(same_codes):.5f}, v's k identical >= {min(same_k):.5f}")
    assert d_forms <= 0.1 * d_fp8, (d_forms, d_fp8)   # measured: 2e-4 vs 2.4e-2
    assert ((fast - ref).norm() / ref.norm()).item() <= 1.25 * d_fp8
    assert min(same_codes) >= 0.95 and min(same_k) >= 0.9


def test_reference_traces_without_graph_breaks():
    """torch.compile(fullgraph=True) of the GPU fallback's function: a graph break raises here."""
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
    n = 3 * GROUP
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(200, generator=g), torch.randn(100, generator=g)]
    chunks = [Chunk(0, 2 * GROUP, grads[0], torch.zeros(200, dtype=torch.bfloat16)), Chunk(2 * GROUP, n, grads[1])]
    a = PrecisionAwareAdamW(torch.randn(n, generator=g) * 0.02, chunks, torch.ones(3, dtype=torch.bool), cfg,
                            "fp8", "fp8", True)
    b = PrecisionAwareAdamW(a.master.clone(), chunks, a.group_decay, cfg, "fp8", "fp8", True)
    compiled = torch.compile(_reference_with_skip, fullgraph=True, dynamic=False, backend="eager")
    for t in range(3):
        lr = torch.tensor(1e-3 * (t + 1))             # the fallback passes lr as a tensor
        compiled(a, lr, torch.tensor(0.5), torch.tensor(float(t == 1)))   # step 1 is skipped
        _reference_with_skip(b, lr, torch.tensor(0.5), torch.tensor(float(t == 1)))
    assert torch.equal(a.master, b.master) and torch.equal(a.m.data, b.m.data) and torch.equal(a.v.k, b.v.k)


def test_log2_lut_accuracy_and_edges():
    """The fast quantizer's log2|x| (fp8_adam.log2_lut: exponent + 1024-segment linear interpolation, the
    table passed to the kernel as data) is within 5e-6 of float64 log2 over 60 decades (interpolation
    <= 1.8e-7, plus the fp32 rounding of results up to |126|), and within 6e-7 (about an ulp) for |x| in [2^-8, 2^8);
    exact at powers of two, -inf for zeros and denormals, and sign-blind."""
    from megacoat.optim.fp8_adam import log2_lut
    g = torch.Generator().manual_seed(11)
    x = torch.exp(torch.randn(1 << 18, generator=g) * 20).float()
    x = x[(x > 1.2e-38) & torch.isfinite(x)]
    err = (log2_lut(x).double() - torch.log2(x.double())).abs()
    assert err.max().item() < 5e-6, err.max().item()
    near = (x >= 2 ** -8) & (x < 2 ** 8)
    assert err[near].max().item() < 6e-7, err[near].max().item()
    p2 = torch.tensor([2.0 ** e for e in range(-126, 127, 7)])
    assert torch.equal(log2_lut(p2), torch.log2(p2))
    assert torch.equal(log2_lut(-x[:100]), log2_lut(x[:100]))
    edge = log2_lut(torch.tensor([0.0, -0.0, 1e-40, -1e-39]))
    assert torch.isinf(edge).all() and (edge < 0).all()


def test_fast_dequantization_flushes_results_below_fp32_normals():
    """The fast form's exp2 has no denormal path (the kernel's MUFU.EX2): values below 2^-126 dequantize
    to 0 (a moment decaying under zero gradients reaches them); the exact form keeps them."""
    q = torch.arange(256, dtype=torch.uint8).view(2, 128)
    s = torch.tensor([2.0 ** -135, 2.0 ** -100])
    k = torch.ones(2)
    c = torch.ones(2)
    fast = dequantize_groups(q, s, k, c, expand=True, fast=True)
    exact = dequantize_groups(q, s, k, c, expand=True, fast=False)
    tiny = (exact.abs() < 2.0 ** -126) & (exact != 0)
    assert tiny[0].sum() > 100 and not tiny[1].any()      # group 0: all but the largest codes are denormal
    assert torch.all(fast[tiny] == 0)
    torch.testing.assert_close(fast[~tiny], exact[~tiny], rtol=1e-5, atol=0, equal_nan=True)  # 0x7f, 0xff: NaN
