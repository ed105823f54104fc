"""Fused RoPE over the QKV output (--rope-fusion): its references against the unfused torch operations (float64,
exact), every layout (MHA, GQA, odd head dims); a tiny model trains the same with and without it; the Triton
kernels under the interpreter (CPU) and on the GPU."""
import pytest
import torch

from interp_runner import assert_interpreted_cases_pass
from megacoat.config import parse_args
from megacoat.model.rope import RotaryEmbedding, apply_rotary, rope_qkv
from test_cli import TINY


def _unfused(qkv, cos, sin):
    s, b, g, slots, d = qkv.shape
    q = apply_rotary(qkv[:, :, :, : slots - 2].reshape(s, b, g * (slots - 2), d), cos, sin)
    return q, apply_rotary(qkv[:, :, :, slots - 2], cos, sin), qkv[:, :, :, slots - 1]


@pytest.mark.parametrize("s,b,g,qpg,d", [(5, 3, 2, 1, 8), (7, 2, 3, 2, 6), (4, 1, 1, 4, 10)])
def test_fused_rope_equals_the_torch_operations_in_float64(s, b, g, qpg, d):
    gen = torch.Generator().manual_seed(s + d)
    qkv = torch.randn(s, b, g, qpg + 2, d, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = RotaryEmbedding(d, 32, 10000.0)(torch.randint(0, 32, (b, s), generator=gen), torch.float64)
    fused, plain = rope_qkv(qkv, cos, sin), _unfused(qkv, cos, sin)
    grads = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in plain]
    for a, c in zip(fused, plain):
        assert torch.equal(a, c)
    ga, = torch.autograd.grad(sum((t * w).sum() for t, w in zip(fused, grads)), qkv)
    gc, = torch.autograd.grad(sum((t * w).sum() for t, w in zip(plain, grads)), qkv)
    assert torch.equal(ga, gc)
    # an output without a gradient (v unused) counts as zeros
    ga, = torch.autograd.grad(sum((t * w).sum() for t, w in zip(rope_qkv(qkv, cos, sin)[:2], grads)), qkv)
    gc, = torch.autograd.grad(sum((t * w).sum() for t, w in zip(_unfused(qkv, cos, sin)[:2], grads)), qkv)
    assert torch.equal(ga, gc)


def test_fused_rope_refuses_other_layouts():
    with pytest.raises(ValueError, match="heads per group"):
        rope_qkv(torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))


def test_rope_fusion_flag():
    assert parse_args(TINY).precision.rope_fusion is None
    assert parse_args(TINY + ["--rope-fusion"]).precision.rope_fusion is True
    assert parse_args(TINY + ["--no-rope-fusion"]).precision.rope_fusion is False


def _losses(extra, precision=("--fp32",)):
    from megacoat.training.trainer import Trainer
    tr = Trainer(parse_args(TINY + [*precision, "--num-workers", "0", "--train-iters", "6", "--global-batch-size", "4",
                                    "--lr", "3e-3", "--group-query-attention", "--num-query-groups", "2", *extra]))
    assert tr.model.layers[0].attention.lc.rope_fusion == ("--rope-fusion" in extra)
    it = tr.data_iterators().train
    out = [float(tr.train_step(tr._next_micro_batches(it)).loss_t) for _ in range(6)]
    tr.close()
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_trains_the_same_with_fused_rope(compiled):
    flags = ["--torch-compile" if compiled else "--no-torch-compile"]
    plain, fused = _losses(flags), _losses(flags + ["--rope-fusion"])
    assert len(set(plain)) == len(plain)  # the updates moved the model: equal losses mean equal gradients
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_compiled_bf16_model_on_gpu_trains_the_same_with_fused_rope():
    """The kernels inside compiled layers (triton_ops launched by Inductor): the losses of the torch operations,
    up to bf16 rounding."""
    plain, fused = _losses(["--torch-compile"], ("--bf16",)), _losses(["--torch-compile", "--rope-fusion"], ("--bf16",))
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=2e-3, atol=2e-3)


def test_rope_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU hosts run the interpreter; GPU hosts the real kernels (below)")
    assert_interpreted_cases_pass("rope_interp_cases.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("s,b,g,qpg,d", [(2048, 4, 16, 1, 128), (37, 3, 4, 2, 64), (5, 2, 2, 4, 72)])
def test_rope_kernels_on_gpu(s, b, g, qpg, d):
    from megacoat.kernels import rope as K
    from megacoat.model.rope import rope_qkv_backward_reference, rope_qkv_reference
    gen = torch.Generator(device="cuda").manual_seed(s)
    qkv = torch.randn(s, b, g, qpg + 2, d, generator=gen, device="cuda").to(torch.bfloat16)
    cos, sin = RotaryEmbedding(d, s + 8, 10000.0, device="cuda")(
        torch.randint(0, s + 8, (b, s), generator=gen, device="cuda"), torch.bfloat16)

    def close(a, c):  # one bf16 ulp: the kernel may contract a multiply-add into an FMA
        assert a.shape == c.shape and ((a.float() - c.float()).abs() <= 2 ** -7 * c.float().abs() + 1e-6).all()
    for a, c in zip(K.rope_qkv(qkv, cos, sin), rope_qkv_reference(qkv, cos, sin)):
        close(a, c)
    dq = torch.randn(b, g * qpg, s, d, generator=gen, device="cuda").to(torch.bfloat16).permute(2, 0, 1, 3)
    dk = torch.randn(b, g, s, d, generator=gen, device="cuda").to(torch.bfloat16).permute(2, 0, 1, 3)
    dv = torch.randn(b, g, s, d, generator=gen, device="cuda").to(torch.bfloat16).permute(2, 0, 1, 3)
    close(K.rope_qkv_backward(dq, dk, dv, cos, sin), rope_qkv_backward_reference(dq, dk, dv, cos, sin))
