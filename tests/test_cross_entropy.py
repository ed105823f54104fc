"""The vocabulary-parallel cross entropy's two passes (parallel/cross_entropy.py): the torch references
against float64, the Triton kernels against the references (CPU: under the interpreter, in a fresh
process; GPU: tests marked gpu), and the whole loss against torch's cross entropy. The TP=2/4 cases
over gloo are in tests/test_parallel_units.py."""
import pytest
import torch
import torch.nn.functional as F
from interp_runner import assert_interpreted_cases_pass

from megacoat.kernels import cross_entropy as ce_kernels

from megacoat.parallel.cross_entropy import (row_stats, row_stats_reference, softmax_grad, softmax_grad_reference,
                                             vocab_parallel_cross_entropy)
from megacoat.parallel.context import ParallelContext


def case(rows, vocab, valid, seed, dtype=torch.float32, device="cpu"):
    """Logits with outliers and a row of equal values; targets inside, outside (another rank's slice,
    negative) and in the padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    x.view(-1)[::37] *= 20.0
    x[0] = 1.5
    target = torch.randint(0, max(valid, 1), (rows,), generator=g)
    if rows > 3:
        target[1], target[2], target[3] = -5, vocab + 3, min(valid, vocab - 1)  # the last: padding or inside
    return x.to(dtype).to(device), target.to(device)


def nonfinite_case(vocab=300, dtype=torch.float32, device="cpu"):
    """Rows with a NaN in the first column, a NaN after a -inf in the same lane (any tile), a NaN late
    in the row, +inf, all -inf, and a clean row. Expected loss: NaN, NaN, NaN, NaN, inf or NaN, finite."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, vocab, generator=g)
    x[0, 0] = float("nan")
    x[1, 5] = float("-inf")
    for col in (5 + 64, 5 + 1024, 5 + 2048):  # the lane of the -inf in tiles of 64, 1024, 2048 columns
        if col < vocab:
            x[1, col] = float("nan")
    x[2, vocab - 2] = float("nan")
    x[3, 7] = float("inf")
    x[4] = float("-inf")
    target = torch.tensor([1, 2, 3, 4, 5, 6])
    return x.to(dtype).to(device), target.to(device)


def check_nonfinite(loss):
    assert torch.isnan(loss[:4]).all(), loss
    assert not torch.isfinite(loss[4]), loss
    assert torch.isfinite(loss[5]), loss


def stats_f64(x, target, valid):
    xd = x[:, :valid].double()
    m = xd.max(-1).values
    s = torch.exp(xd - m[:, None]).sum(-1)
    inside = (target >= 0) & (target < valid)
    t = torch.where(inside, xd.gather(-1, target.clamp(0, valid - 1)[:, None]).squeeze(-1), torch.zeros_like(m))
    return m, s, t


@pytest.mark.parametrize("rows,vocab,valid", [(7, 50, 50), (9, 129, 100), (4, 3000, 2999), (5, 17, 1)])
def test_reference_stats_and_gradient_against_float64(rows, vocab, valid):
    x, target = case(rows, vocab, valid, seed=rows + vocab)
    m, s, t = row_stats_reference(x, target, valid)
    md, sd, td = stats_f64(x, target, valid)
    torch.testing.assert_close(m.double(), md)
    torch.testing.assert_close(s.double(), sd, rtol=1e-5, atol=0)
    torch.testing.assert_close(t.double(), td)
    lse = m + s.log()
    gl = torch.rand(rows, generator=torch.Generator().manual_seed(3), dtype=torch.float32) + 0.5
    g = softmax_grad_reference(x, lse, target, valid, gl)
    xd = x.double().clone().requires_grad_(True)
    lsed = torch.logsumexp(xd[:, :valid], -1)
    inside = (target >= 0) & (target < valid)
    loss = lsed - torch.where(inside, xd.gather(-1, target.clamp(0, valid - 1)[:, None]).squeeze(-1), 0.0)
    (loss * gl.double()).sum().backward()
    torch.testing.assert_close(g.double(), xd.grad, rtol=1e-5, atol=1e-7)
    assert torch.all(g[:, valid:] == 0)


def test_no_columns_on_this_rank():
    """A TP rank whose slice is all padding: m = -inf, s = 0, t = 0, a zero gradient."""
    x, target = case(4, 8, 8, seed=1)
    m, s, t = row_stats_reference(x, target, 0)
    assert torch.all(m == float("-inf")) and torch.all(s == 0) and torch.all(t == 0)
    g = softmax_grad_reference(x, torch.full((4,), 3.0), target, 0, torch.ones(4))
    assert torch.all(g == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_equal_torch_cross_entropy(dtype):
    ctx = ParallelContext.single()
    x, target = case(12, 70, 70, seed=5, dtype=dtype)
    logits = x.view(3, 4, 70).clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, target.view(3, 4), ctx.tp_group, 64)  # 6 padded columns
    ref_in = x.view(3, 4, 70)[..., :64].float().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, 64), target.clamp(0, 63), reduction="none").view(3, 4)
    keep = ((target >= 0) & (target < 64)).view(3, 4)
    torch.testing.assert_close(loss[keep], ref[keep], rtol=1e-5, atol=1e-5)
    (loss[keep].sum()).backward()
    ref[keep].sum().backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad[..., :64].float(), ref_in.grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert torch.all(logits.grad[..., 64:] == 0)
    assert torch.equal(logits.detach(), x.view(3, 4, 70)), "the logits must not be modified"


def test_nonfinite_logits_give_a_nonfinite_loss():
    x, target = nonfinite_case()
    ctx = ParallelContext.single()
    check_nonfinite(vocab_parallel_cross_entropy(x, target, ctx.tp_group))


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU hosts test the real kernels (the gpu-marked tests below)")
def test_kernels_interpreted_match_references():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("ce_interp_cases.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,vocab,valid,dtype", [(8192, 32000, 32000, torch.bfloat16), (257, 50304, 50257, torch.bfloat16),
                                                    (33, 3001, 2999, torch.float32), (5, 16000, 0, torch.bfloat16)])
def test_kernels_match_references_on_gpu(rows, vocab, valid, dtype):
    assert ce_kernels.available(), "Triton should run here: the dispatch would fall back to the references"
    x, target = case(rows, vocab, valid, seed=7, dtype=dtype, device="cuda")
    m, s, t = row_stats(x, target, valid)
    rm, rs, rt = row_stats_reference(x, target, valid)
    torch.testing.assert_close(m, rm)
    torch.testing.assert_close(s, rs, rtol=2e-5, atol=0)
    torch.testing.assert_close(t, rt)
    lse = rm + rs.log() if valid else torch.zeros_like(rm)
    gl = torch.rand(rows, device="cuda") + 0.5
    g = softmax_grad(x, lse, target, valid, gl)
    rg = softmax_grad_reference(x, lse, target, valid, gl)
    assert g.dtype == dtype
    tol = dict(rtol=1.6e-2, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g.float(), rg.float(), **tol)
    assert torch.all(g[:, valid:] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [300, 5000])
def test_kernels_nonfinite_logits_on_gpu(vocab):
    assert ce_kernels.available()
    x, target = nonfinite_case(vocab, torch.bfloat16, "cuda")
    check_nonfinite(vocab_parallel_cross_entropy(x, target, ParallelContext.single().tp_group))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_with_64_bit_offsets_on_gpu():
    """10,000 x 256,000 bf16 logits: offsets past 2^31 elements (the last rows). Made on the GPU (2.6e9 normals)."""
    assert ce_kernels.available()
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(10000, 256000, generator=gen, device="cuda", dtype=torch.bfloat16) * 4)
    target = torch.randint(0, 256000, (10000,), generator=gen, device="cuda")
    m, s, t = row_stats(x, target, 256000)
    rm, rs, rt = row_stats_reference(x[-4:], target[-4:], 256000)
    torch.testing.assert_close(m[-4:], rm)
    torch.testing.assert_close(s[-4:], rs, rtol=2e-5, atol=0)
    torch.testing.assert_close(t[-4:], rt)
    lse = m + s.log()
    gl = torch.ones(10000, device="cuda")
    g = softmax_grad(x, lse, target, 256000, gl)
    torch.testing.assert_close(g[-4:].float(), softmax_grad_reference(x[-4:], lse[-4:], target[-4:], 256000, gl[-4:]).float(),
                               rtol=1.6e-2, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_and_eager_loss_agree_on_gpu():
    """vocab_parallel_cross_entropy with fused=True (kernels) and fused=False (references, the path of
    --no-cross-entropy-loss-fusion) on the same bf16 logits: losses and gradients agree."""
    assert ce_kernels.available()
    x, target = case(2048, 32000, 31990, seed=9, dtype=torch.bfloat16, device="cuda")
    group = ParallelContext.single().tp_group
    out = []
    for fused in (True, False):
        logits = x.view(512, 4, 32000).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(logits, target.view(512, 4), group, 31990, fused=fused)
        loss.sum().backward()
        out.append((loss.detach(), logits.grad))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0][1].float(), out[1][1].float(), rtol=1.6e-2, atol=1e-6)
