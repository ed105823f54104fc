"""The cross-entropy Triton kernels against their torch references under TRITON_INTERPRET=1 (CPU), run by
tests/test_cross_entropy.py in a fresh process (Triton decides at import whether kernels are interpreted).
fp32 logits are compared to fp32 round-off; bf16 gradients within one bf16 ulp (the interpreter truncates
fp32 -> bf16 casts instead of rounding them)."""
import pytest
import torch

from interp_runner import skip_unless_interpreted

skip_unless_interpreted("tests/test_cross_entropy.py")

from megacoat.kernels import cross_entropy as K  # noqa: E402
from megacoat.parallel.cross_entropy import row_stats_reference, softmax_grad_reference  # noqa: E402
from test_cross_entropy import case, check_nonfinite, nonfinite_case  # noqa: E402


@pytest.mark.parametrize("rows,vocab,valid,dtype", [(6, 5000, 5000, torch.float32), (5, 4100, 4097, torch.float32),
                                                    (4, 300, 0, torch.float32), (5, 2500, 2400, torch.bfloat16)])
def test_kernels_match_references(rows, vocab, valid, dtype):
    K.TILES["row_stats"] = K.TILES["softmax_grad"] = (1024, 4)  # several column blocks per row
    x, target = case(rows, vocab, valid, seed=vocab, dtype=dtype)
    m, s, t = K.row_stats(x, target, valid)
    rm, rs, rt = row_stats_reference(x, target, valid)
    torch.testing.assert_close(m, rm)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    torch.testing.assert_close(t, rt)
    lse = rm + rs.log() if valid else torch.zeros_like(rm)
    gl = torch.rand(rows, generator=torch.Generator().manual_seed(2)) + 0.5
    g = K.softmax_grad(x, lse, target, valid, gl)
    rg = softmax_grad_reference(x, lse, target, valid, gl)
    assert g.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(g.float(), rg.float(), rtol=2 ** -7, atol=1e-7)
    else:
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-8)
    assert torch.all(g[:, valid:] == 0)


@pytest.mark.parametrize("vocab,block", [(300, 64), (2100, 1024), (2100, 2048)])
def test_kernels_nonfinite_logits(vocab, block):
    K.TILES["row_stats"] = K.TILES["softmax_grad"] = (block, 4)
    x, target = nonfinite_case(vocab)
    m, s, t = K.row_stats(x, target, vocab)
    check_nonfinite(s.log() + (m - t))
