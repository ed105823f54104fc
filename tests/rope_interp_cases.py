"""The fused RoPE Triton kernels against their references under TRITON_INTERPRET=1 (CPU), odd shapes.

Run by tests/test_rope_fusion.py in a fresh process (Triton decides at import whether kernels are interpreted).
The interpreter truncates fp32 -> bf16 casts, so bf16 outputs are compared within one bf16 ulp; fp32 runs compare
to fp32 round-off. On hardware: tests/test_rope_fusion.py's GPU test."""
import pytest
import torch

from interp_runner import skip_unless_interpreted

skip_unless_interpreted("tests/test_rope_fusion.py")

from megacoat.kernels import rope as K  # noqa: E402
from megacoat.model.rope import RotaryEmbedding, rope_qkv_backward_reference, rope_qkv_reference  # noqa: E402


def _tables(s, b, d, dtype, seed):
    pos = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(seed))
    return RotaryEmbedding(d, 64, 10000.0)(pos, dtype)  # [s, b, 1, d], not contiguous in (s, b)


def _close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:  # one bf16 ulp (the interpreter truncates)
        assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs() + 1e-6).all()


@pytest.mark.parametrize("tile", [(16, 1, 4), (8, 2, 4)])  # (rows, groups, warps): rows and groups masked at edges
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,b,g,qpg,d", [(5, 3, 2, 1, 8), (17, 2, 3, 2, 6), (33, 1, 1, 4, 20), (7, 3, 3, 3, 10),
                                         (9, 2, 2, 16, 8)])
def test_rope_qkv_kernels(s, b, g, qpg, d, dtype, tile, monkeypatch):
    monkeypatch.setitem(K.TILES, "rope_fwd", tile)
    monkeypatch.setitem(K.TILES, "rope_bwd", tile)
    gen = torch.Generator().manual_seed(s * 7 + d)
    qkv = torch.randn(s, b, g, qpg + 2, d, generator=gen).to(dtype)
    cos, sin = _tables(s, b, d, dtype, s)
    for got, want in zip(K.rope_qkv(qkv, cos, sin), rope_qkv_reference(qkv, cos, sin)):
        assert got.shape == want.shape and got.is_contiguous()
        _close(got, want, dtype)
    # gradients in SDPA's [b, heads, s, d] layout, handed back as [s, b, heads, d] views (strided)
    dq = torch.randn(b, g * qpg, s, d, generator=gen).to(dtype).permute(2, 0, 1, 3)
    dk = torch.randn(b, g, s, d, generator=gen).to(dtype).permute(2, 0, 1, 3)
    dv = torch.randn(s, b, g, d, generator=gen).to(dtype)
    got, amax = K.rope_qkv_backward(dq, dk, dv, cos, sin, True)
    want, _ = rope_qkv_backward_reference(dq, dk, dv, cos, sin)
    assert amax == got.abs().amax().float()  # of the stored values (the FP8 QKV linear's cast scale)
    assert K.rope_qkv_backward(dq, dk, dv, cos, sin)[1].numel() == 0
    assert got.shape == (s, b, g, qpg + 2, d)
    _close(got, want, dtype)
    assert torch.equal(got[:, :, :, qpg + 1], dv)  # v's gradient passes through unchanged
