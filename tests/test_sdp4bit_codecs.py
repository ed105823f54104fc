"""SDP4Bit codecs: quantizer bounds and unbiasedness, Hadamard vs float64, message layout, fused
references vs an independent float64 computation, Triton kernels vs references (interpreter on
CPU in a subprocess; bit-exact on GPU)."""
import os
import subprocess
import sys

import pytest
import torch

from megacoat.comm import codecs as C
from megacoat.config import round_to_fp32


def _hadamard_matrix64():
    i = torch.arange(32)
    bits = (i[:, None] & i[None, :])
    parity = torch.zeros_like(bits)
    for k in range(5):
        parity ^= (bits >> k) & 1
    return (1 - 2 * parity).double()


def test_hadamard_matches_float64_matrix_and_round_trips():
    x = torch.randn(7, 96) * torch.logspace(-3, 3, 96)
    h = C.hadamard32(x)
    want = (x.double().view(-1, 32) @ _hadamard_matrix64()).view(7, 96)
    assert torch.allclose(h.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    back = C.inverse_hadamard32(h)
    torch.testing.assert_close(back, x, rtol=0, atol=4e-6 * x.abs().max().item())
    with pytest.raises(ValueError, match="blocks of 32"):
        C.hadamard32(torch.zeros(40))


@pytest.mark.parametrize("bits,group", [(4, 2048), (8, 128), (4, 128)])
def test_quantizer_error_bound_and_codes(bits, group):
    qmax = 2 ** (bits - 1) - 1
    x = torch.randn(5, group) * torch.tensor([1e-3, 1.0, 30.0, 1e-20, 5.0])[:, None]
    x[3] = 0.0  # an all-zero group: scale 1, zero codes
    idx = torch.arange(x.numel()).view(5, group)
    q, s = C.quantize_groups(x, idx, C.derive_key(1, 2), bits)
    assert q.dtype == torch.int32 and int(q.abs().max()) <= qmax
    assert s[3] == 1.0 and (q[3] == 0).all()
    amax = x.abs().amax(1)
    torch.testing.assert_close(s[[0, 1, 2, 4]], amax[[0, 1, 2, 4]] / qmax)
    err = (C.dequantize_groups(q, s[:, None], group) - x).abs()
    assert (err <= s[:, None] * (1 + 1e-6)).all()  # stochastic rounding: within one step
    # codes survive packing into one message and back
    msg = torch.empty(5, C.message_bytes(group, bits, group), dtype=torch.uint8)
    C.write_messages(msg, q, s.view(5, 1), bits)
    q2, s2 = C.read_messages(msg, group, bits, group)
    assert torch.equal(q2, q) and torch.equal(s2.view(-1), s)


def test_quantizer_unbiased_over_seeds():
    torch.manual_seed(0)
    x = torch.randn(4, 128)
    idx = torch.arange(x.numel()).view(4, 128)
    mean = torch.zeros_like(x)
    n = 3000
    for seed in range(n):
        q, s = C.quantize_groups(x, idx, C.derive_key(seed), 4)
        mean += C.dequantize_groups(q, s[:, None], 128)
    mean /= n
    step = x.abs().amax(1, keepdim=True) / 7
    # each element: variance <= step^2 / 4 -> standard error of the mean <= step / (2 sqrt(n))
    z = (mean - x).abs() / (step / (2 * n ** 0.5))
    assert z.max() < 5.0, z.max()
    assert (mean - x).abs().mean() < 0.02 * step.mean()


def test_codes_need_no_clamp():
    """The kernels skip the clamp: for qmax = 7 and 127, floor(x * inv + u) stays in [-qmax, qmax] for
    every fp32 amax, at x = +-amax with the extreme offsets u = 2^-17 and 1 - 2^-17 (exact arithmetic).
    Without the half-step margin in u (u = 0 allowed) it would not."""
    g = torch.Generator().manual_seed(0)
    mant = torch.randint(0, 1 << 23, (1 << 20,), generator=g, dtype=torch.int32)
    expo = torch.randint(1, 254, (1 << 20,), generator=g, dtype=torch.int32)
    amax = ((expo << 23) | mant).view(torch.float32)
    amax = amax[amax >= C.MIN_AMAX]
    for qmax in (7, 127):
        inv = torch.full_like(amax, float(qmax)) / amax
        for sign in (1.0, -1.0):
            for u in (2.0 ** -17, 1 - 2.0 ** -17):
                q = C.floor_of_fma(sign * amax, inv, torch.full_like(amax, 1 + u)) - 1
                assert int(q.min()) >= -qmax and int(q.max()) <= qmax, (qmax, sign, u)
        q0 = C.floor_of_fma(-amax, inv, torch.ones_like(amax)) - 1  # u = 0: below -qmax for some amax
        assert int(q0.min()) == -qmax - 1, qmax


def test_floor_of_fma_is_exact():
    """Against Python's exact rationals, on sums placed on and around integers (where a rounded sum
    would floor wrongly) and on tiny products."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4000, generator=g) * torch.logspace(-30, 1, 4000)
    y = torch.randn(4000, generator=g).abs() + 0.5
    z = torch.floor(torch.rand(4000, generator=g) * 6) + 1.0 + torch.randint(0, 2, (4000,), generator=g) * 2.0 ** -17
    z = z - (x.double() * y.double()).float() * (torch.rand(4000, generator=g) < 0.5)  # sums at integers
    got = C.floor_of_fma(x, y, z)
    for a, b, c, q in zip(x.tolist(), y.tolist(), z.tolist(), got.tolist()):
        exact = Fraction(a) * Fraction(b) + Fraction(c)
        assert q == exact.numerator // exact.denominator, (a, b, c)


def test_nonfinite_group_dequantizes_to_nan():
    x = torch.randn(3, 64)
    x[1, 5] = float("inf")
    q, s = C.quantize_groups(x, torch.arange(192).view(3, 64), C.derive_key(3), 8)
    deq = C.dequantize_groups(q, s[:, None], 64)
    assert torch.isnan(deq[1]).all() and torch.isfinite(deq[[0, 2]]).all()


def test_message_bytes_and_bits_per_element():
    assert C.message_bytes(4096, 4, 2048) == 2048 + 8
    assert abs(C.bits_per_element(4, 2048) - 4.015625) < 1e-12
    assert C.bits_per_element(8, 128) == 8.25 and C.bits_per_element(4, 128) == 4.25
    with pytest.raises(ValueError, match="whole groups"):
        C.message_bytes(100, 4, 64)


def test_random_stream_depends_on_every_id():
    idx = torch.arange(1 << 16)
    base = C.rounding_offsets(idx, C.derive_key(1, 2, 3, 4))
    for other in [(2, 2, 3, 4), (1, 3, 3, 4), (1, 2, 4, 4), (1, 2, 3, 5)]:
        r = C.rounding_offsets(idx, C.derive_key(*other))
        assert (r == base).float().mean() < 0.01
    # f = 1 + u, u = (k + 1/2) / 2^16 inside (0, 1), all 2^16 values about equally often
    base = base - 1.5  # exact: centred offsets in (-1/2, 1/2)
    k = ((base.double() + 0.5) * 65536 - 0.5)
    assert torch.equal(k, k.round()) and k.min() >= 0 and k.max() <= 65535
    assert abs(base.double().mean().item()) < 0.005 and base.min() > -0.5 and base.max() < 0.5
    # the two halves of one hash (elements 2p, 2p+1) are not correlated
    ev, od = base[0::2].double(), base[1::2].double()
    assert abs(torch.corrcoef(torch.stack([ev, od]))[0, 1].item()) < 0.02
    # histogram over 16 bins: chi-square far below a failure threshold for 15 dof
    hist = torch.histc(base.double(), bins=16, min=-0.5, max=0.5)
    chi2 = ((hist - idx.numel() / 16) ** 2 / (idx.numel() / 16)).sum().item()
    assert chi2 < 40, chi2


def test_rounding_is_floor_of_y_plus_offset():
    """Independent check of the quantizer's integer step: float64 floor(x * inv + u) with u = f - 1."""
    torch.manual_seed(3)
    x = torch.randn(6, 256) * torch.tensor([1e-3, 1.0, 30.0, 7.0, 1e5, 2.0])[:, None]
    idx = torch.arange(x.numel()).view(6, 256) + 1000
    key = C.derive_key(9)
    for bits in (4, 8):
        qmax = 2 ** (bits - 1) - 1
        q, s = C.quantize_groups(x, idx, key, bits)
        inv = (torch.full((6,), float(qmax)) / x.abs().amax(1))
        y = x.double() * inv.double()[:, None] + (C.rounding_offsets(idx, key).double() - 1)
        assert torch.equal(q.double(), torch.floor(y))


def test_hash_input_blocks_of_16_pairs():
    """Pairs 16b .. 16b + 15 share the hash input's upper 28 bits (the kernels compute them once per
    lane) and differ from other blocks'; the mapping wraps mod 2^32 like the kernels' uint32 math."""
    key = C.derive_key(4, 5)
    p = torch.arange(1 << 12, dtype=torch.int64) + (1 << 32) - 2048  # crosses the 2^32 wrap of p
    x = C.hash_inputs(p & C.M32, key)
    assert int(x.max()) <= C.M32 and torch.equal(x & 15, p & 15)
    hi = (x >> 4).view(-1, 16)
    assert (hi == hi[:, :1]).all() and hi[:, 0].unique().numel() == hi.shape[0]


def test_partitioned_encode_decode_matches_float64():
    """encode_partitioned_reference puts shard b * ndest + d of the slice into message d; the
    decoded sum equals the float64 sum within the quantization bound."""
    torch.manual_seed(1)
    ndest, nblocks, S, off, sl, G = 3, 2, 512, 128, 256, 128
    srcs = [torch.randn(ndest * nblocks * S) for _ in range(4)]
    for had in (False, True):
        outs = []
        for i, src in enumerate(srcs):
            out = torch.empty(ndest, C.message_bytes(nblocks * sl, 8, G), dtype=torch.uint8)
            C.encode_partitioned_reference(src, out, S, off, sl, ndest, nblocks, 8, G, had, C.derive_key(i))
            outs.append(out)
        for d in range(ndest):
            msgs = torch.stack([o[d] for o in outs])
            got = torch.empty(nblocks * sl)
            scale = round_to_fp32(1 / (4 * (32 if had else 1)))
            C.reduce_decode_reference(msgs, got, nblocks * sl, 8, G, had, scale)
            want = sum(s.double().view(nblocks, ndest, S)[:, d, off:off + sl].reshape(-1) for s in srcs) / 4
            # bound: 4 sources x half... one quantization step of each (Hadamard spreads it over 32)
            step = max(s.abs().max().item() for s in srcs) * (32 ** 0.5 if had else 1) / 127
            assert (got.double() - want).abs().max() < step, (had, d)


_INTERPRET_SCRIPT = r"""
import torch
from megacoat.comm import codecs as C
from megacoat.config import round_to_fp32
from megacoat.kernels import sdp4bit as K
torch.manual_seed(0)
checked = 0
for bits in (4, 8):
    for had in (False, True):
        for (S, off, sl, nd, nb, G) in [(256, 64, 128, 2, 3, 64), (384, 0, 384, 3, 1, 128), (96, 32, 64, 1, 2, 32)]:
            src = torch.randn(nd * nb * S) * torch.rand(nd * nb * S) ** 4 * 10
            key = C.derive_key(bits, S, off)
            o1 = torch.zeros(nd, C.message_bytes(nb * sl, bits, G), dtype=torch.uint8); o2 = o1.clone()
            C.encode_partitioned_reference(src, o1, S, off, sl, nd, nb, bits, G, had, key)
            K.encode_partitioned(src, o2, S, off, sl, nd, nb, bits, G, had, key)
            assert torch.equal(o1, o2), ("encode", bits, had, S)
            b1 = o1.clone(); b2 = o1.clone()  # bf16 buckets: 4-bit codes move as int32 words of 8
            C.encode_partitioned_reference(src.bfloat16(), b1, S, off, sl, nd, nb, bits, G, had, key)
            K.encode_partitioned(src.bfloat16(), b2, S, off, sl, nd, nb, bits, G, had, key)
            assert torch.equal(b1, b2), ("encode bf16", bits, had, S)
            n = nb * sl
            for bo, go in ((4, 32), (8, 64)):
                if (n // nb) % go:
                    continue
                r1 = torch.zeros(nb, C.message_bytes(n // nb, bo, go), dtype=torch.uint8); r2 = r1.clone()
                C.reduce_requantize_reference(o1, r1, n, bits, G, bo, go, nb, key)
                K.reduce_requantize(o1, r2, n, bits, G, bo, go, nb, key)
                assert torch.equal(r1, r2), ("requant", bits, bo)
            for dt in (torch.float32, torch.bfloat16):
                d1 = torch.zeros(n, dtype=dt); d2 = d1.clone()
                C.reduce_decode_reference(o1, d1, n, bits, G, had, round_to_fp32(1 / 96))
                K.reduce_decode(o1, d2, n, bits, G, had, round_to_fp32(1 / 96))
                assert torch.equal(d1, d2), ("decode", bits, had, dt)
            checked += 1
    for direct in (False, True):
        for wdt in (torch.bfloat16, torch.float32):
            m = torch.randn(3 * 2048) * 0.02
            w = (m + 1e-3 * torch.randn(3 * 2048)).to(wdt)
            o1 = torch.zeros(C.message_bytes(m.numel(), bits, 2048), dtype=torch.uint8); o2 = o1.clone()
            key = C.derive_key(7, bits)
            C.encode_delta_reference(m, w, o1, bits, 2048, key, direct)
            K.encode_delta(m, w, o2, bits, 2048, key, direct)
            assert torch.equal(o1, o2), ("delta", bits, direct, wdt)
            msgs = torch.stack([o1, o1.roll(3)]); msgs[1, -8:] = o1[-8:]  # two sources, finite scales
            w1 = torch.cat([w, w]); w2 = w1.clone()
            C.apply_delta_reference(msgs, w1, bits, 2048, direct)
            K.apply_delta(msgs, w2, bits, 2048, direct)
            assert torch.equal(w1, w2), ("apply", bits, direct, wdt)
print("OK", checked)
"""


def test_triton_kernels_equal_references_interpreted():
    """Codes are integers and every fp32 operation is ordered identically: bit-exact here."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", MEGACOAT_NO_TRITON="0")
    r = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("bits,had", [(8, True), (4, True), (8, False), (4, False)])
def test_kernels_bit_exact_on_gpu(bits, had):
    from megacoat.kernels import sdp4bit as K
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(bits)
    L, N, S = 2, 2, 1 << 20
    src = torch.randn(L * N * S, device=dev, generator=g) * 3
    src[12345] = 1e4  # an outlier
    key = C.derive_key(5, bits)
    off, sl = 4096, S - 8192
    o1 = torch.empty(L, C.message_bytes(N * sl, bits, 128), dtype=torch.uint8, device=dev)
    o2 = torch.empty_like(o1)
    C.encode_partitioned_reference(src, o1, S, off, sl, L, N, bits, 128, had, key)
    K.encode_partitioned(src, o2, S, off, sl, L, N, bits, 128, had, key)
    assert torch.equal(o1, o2)
    r1 = torch.empty(N, C.message_bytes(sl, 4, 128), dtype=torch.uint8, device=dev)
    r2 = torch.empty_like(r1)
    C.reduce_requantize_reference(o1, r1, N * sl, bits, 128, 4, 128, N, key)
    K.reduce_requantize(o1, r2, N * sl, bits, 128, 4, 128, N, key)
    assert torch.equal(r1, r2)
    for dt in (torch.float32, torch.bfloat16):  # bf16: the GPU's cvt.rn path of the kernels
        d1 = torch.empty(sl, device=dev, dtype=dt)
        d2 = torch.empty_like(d1)
        C.reduce_decode_reference(r1, d1, sl, 4, 128, had, round_to_fp32(1 / 128))
        K.reduce_decode(r1, d2, sl, 4, 128, had, round_to_fp32(1 / 128))
        assert torch.equal(d1, d2)
    b1 = torch.empty_like(o1)  # bf16 bucket: 4-bit codes as int32 words of 8 elements
    b2 = torch.empty_like(o1)
    C.encode_partitioned_reference(src.bfloat16(), b1, S, off, sl, L, N, bits, 128, had, key)
    K.encode_partitioned(src.bfloat16(), b2, S, off, sl, L, N, bits, 128, had, key)
    assert torch.equal(b1, b2)
    m = torch.randn(S, device=dev, generator=g) * 0.02
    for wdt, direct in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
        w = (m + 1e-3 * torch.randn(S, device=dev, generator=g)).to(wdt)
        q1 = torch.empty(C.message_bytes(S, bits, 2048), dtype=torch.uint8, device=dev)
        q2 = torch.empty_like(q1)
        C.encode_delta_reference(m, w, q1, bits, 2048, key, direct)
        K.encode_delta(m, w, q2, bits, 2048, key, direct)
        assert torch.equal(q1, q2)
        msgs = torch.stack([q1, q1])
        w1 = torch.cat([w, w])
        w2 = w1.clone()
        C.apply_delta_reference(msgs, w1, bits, 2048, direct)
        K.apply_delta(msgs, w2, bits, 2048, direct)
        assert torch.equal(w1, w2)


@pytest.mark.gpu
def test_dispatch_uses_kernels_on_gpu():
    assert C.use_kernels(torch.zeros(1, device="cuda"))
