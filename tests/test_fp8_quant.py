"""FP8 quantizer references (megacoat/precision/fp8.py) against independent float64 computations."""
import pytest
import torch

from fp8_oracle import FMAX, round_fp8_oracle, scale_oracle
from megacoat.precision import fp8


def _fp32(v: float) -> float:
    """float64 -> the nearest fp32 value (as a Python float)."""
    return torch.tensor(v, dtype=torch.float64).float().item()


def _round_up_bf16_oracle(s: torch.Tensor) -> torch.Tensor:
    """Smallest bf16 value >= s (positive float64), from the exponent: bf16 steps are 2^(e - 8)."""
    _, e = torch.frexp(s)
    step = torch.pow(2.0, (e - 8).double())
    return torch.ceil(s / step) * step


def _data(shape, seed, dtype=torch.bfloat16, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).exp()
    if outliers:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 97),), generator=g)
        flat[idx] *= 300.0  # a few large outliers, as activations have
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(37, 50), (5, 3, 16), (1, 1), (64, 129)])
def test_tensorwise_matches_float64_oracle(fmt, shape):
    x = _data(shape, 1)
    amax = fp8.amax(x)
    assert amax.item() == x.double().abs().max().item()  # max is exact
    q, qt, scale = fp8.quantize_tensorwise(x, fmt)
    assert q.dtype == fp8.get_format(fmt).dtype and qt.numel() == 0
    s64 = scale_oracle(x.double().abs().max().item(), fmt)
    assert scale.item() == _fp32(s64)  # the IEEE fp32 quotient, exactly (no reciprocal shortcut)
    v = (x.double() * _fp32(1.0 / scale.item())).float().double()  # x * fp32(1/scale), rounded to fp32
    expect = round_fp8_oracle(v, fmt)
    assert torch.equal(q.double(), expect)
    # the largest element maps to the top of the range (scale is just-in-time)
    assert q.double().abs().max().item() == pytest.approx(FMAX[fmt], rel=0.07)
    deq = fp8.dequantize_tensorwise(q, scale, torch.float32).double()
    rel = {"e4m3": 2 ** -4, "e5m2": 2 ** -3}[fmt]
    big = x.double().abs() > scale.item() * 2 ** -6 * 8  # normal range of the codes
    assert ((deq - x.double()).abs()[big] <= rel * x.double().abs()[big] + 1e-30).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_transposed_copy_equals_transpose_of_codes(fmt):
    x = _data((33, 70), 2)
    q, qt, scale = fp8.quantize_tensorwise(x, fmt, transpose=True)
    assert qt.shape == (70, 33) and qt.is_contiguous()
    assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_transposed_only_cast_and_cast_into_buffers(fmt):
    x = _data((33, 70), 4)
    q, qt, scale = fp8.quantize_tensorwise(x, fmt, transpose=True)
    e, qt2, s2 = fp8.cast_tensorwise(x, fp8.amax(x), fmt, True, rowwise=False)
    assert e.numel() == 0 and torch.equal(qt2.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s2, scale)
    # into a weight cache's buffers, which hold stale values
    dt = fp8.get_format(fmt).dtype
    bufs = (torch.full((33, 70), 2.0).to(dt), torch.full((70, 33), -3.0).to(dt), torch.tensor(5.0), torch.tensor(9.0))
    fp8.quantize_tensorwise_into(x, fmt, *bufs)
    assert torch.equal(bufs[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(bufs[1].view(torch.uint8), qt.view(torch.uint8))
    assert torch.equal(bufs[2], scale) and bufs[3].item() == x.float().abs().max().item()
    with pytest.raises(ValueError, match="writes nothing"):
        fp8.cast_tensorwise(x, fp8.amax(x), fmt, False, rowwise=False)


def test_given_amax_is_used_and_saturates():
    x = _data((8, 32), 3)
    amax = x.float().abs().amax() / 4  # a stale (too small) amax: values beyond it saturate, never NaN
    q, _, scale = fp8.quantize_tensorwise(x, "e4m3", amax_value=amax)
    assert torch.isfinite(q.float()).all()
    assert q.float().abs().max().item() == 448.0
    assert scale.item() == pytest.approx((amax.item() + 1e-12) / 448.0, rel=1e-7)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(19, 72), (3, 5, 16), (4, 7), (2, 33)])
def test_1x16_matches_float64_oracle(fmt, shape):
    x = _data(shape, 4)
    q, s = fp8.quantize_1x16(x, fmt)
    k = shape[-1]
    g = (k + 15) // 16
    assert q.shape == x.shape and s.shape == (*shape[:-1], g) and s.dtype == torch.bfloat16
    x64 = x.double()
    for j in range(g):  # each group independently, straight from the definition
        blk = x64[..., j * 16:(j + 1) * 16]
        s32 = ((blk.abs().amax(-1) + 1e-12) / FMAX[fmt]).float().double()  # the fp32 scale
        assert torch.equal(s[..., j].double(), _round_up_bf16_oracle(s32))  # rounded up to bf16
        assert (s[..., j].double() >= s32).all()
        r = (1.0 / s[..., j].double()).float().double()  # fp32 reciprocal
        v = (blk * r.unsqueeze(-1)).float().double()
        assert torch.equal(q[..., j * 16:(j + 1) * 16].double(), round_fp8_oracle(v, fmt))
    deq = fp8.dequantize_1x16(q, s, torch.float32).double()
    expect = q.double() * s.double().repeat_interleave(16, -1)[..., :k]
    assert (q.double().abs() <= FMAX[fmt]).all() and not torch.isnan(q.double()).any()
    assert torch.equal(deq, expect.float().double())


def test_1x16_is_finer_than_tensorwise_with_outliers():
    x = _data((64, 256), 5)
    q, s = fp8.quantize_1x16(x, "e4m3")
    qt, _, st = fp8.quantize_tensorwise(x, "e4m3")
    err_g = (fp8.dequantize_1x16(q, s, torch.float32) - x.float()).pow(2).mean()
    err_t = (fp8.dequantize_tensorwise(qt, st, torch.float32) - x.float()).pow(2).mean()
    assert err_g < err_t


def test_zero_and_empty_tensors():
    z = torch.zeros(4, 32, dtype=torch.bfloat16)
    q, s = fp8.quantize_1x16(z, "e4m3")
    assert (q.float() == 0).all() and (s > 0).all()
    q, _, sc = fp8.quantize_tensorwise(z, "e5m2")
    assert (q.float() == 0).all() and sc.item() > 0
    assert fp8.amax(torch.empty(0, 16)).item() == 0.0


def test_bad_input_messages():
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8.quantize_1x16(torch.ones(2, 16), "e3m4")
    with pytest.raises(ValueError, match="2-D"):
        fp8.cast_tensorwise(torch.ones(2, 3, 16), torch.tensor(1.0), "e4m3", True)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8.cast_tensorwise(torch.ones(2, 16), torch.tensor(1.0), "fp8", False)
    q, s = fp8.quantize_1x16(torch.ones(2, 32), "e4m3")
    with pytest.raises(ValueError, match="do not match"):
        fp8.dequantize_1x16(q, s[:, :1], torch.float32)
