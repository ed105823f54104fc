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


@pytest.mark.parametrize("s,b,g,qpg,d", [(5, 3, 2, 1, 8), (7, 2, 3, 2, 6), (4, 1, 1, 4, 10), (6, 2, 2, 3, 4)])
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


def test_rope_fusion_is_on_by_default_where_its_kernels_run(monkeypatch):
    from megacoat.training import trainer as T
    for kernels in (False, True):
        monkeypatch.setattr(T, "triton_available", lambda: kernels)
        tr = T.Trainer(parse_args(TINY + ["--fp32", "--num-workers", "0", "--train-iters", "1"]))
        # CPU here: off either way (the kernels are CUDA's); on a GPU host: on with Triton
        assert tr.model.layers[0].attention.lc.rope_fusion == (kernels and torch.cuda.is_available())
        tr.close()


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
@pytest.mark.slow
def test_a_model_trains_the_same_with_fused_rope(compiled):
    flags = ["--torch-compile" if compiled else "--no-torch-compile"]
    plain, fused = _losses(flags + ["--no-rope-fusion"]), _losses(flags + ["--rope-fusion"])
    assert len(set(plain)) == len(plain)  # the updates moved the model: equal losses mean equal gradients
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_compiled_bf16_model_on_gpu_trains_the_same_with_fused_rope():
    """The kernels inside compiled layers (triton_ops launched by Inductor): the losses of the torch operations,
    up to bf16 rounding."""
    plain = _losses(["--torch-compile", "--no-rope-fusion"], ("--bf16",))
    fused = _losses(["--torch-compile", "--rope-fusion"], ("--bf16",))
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=2e-3, atol=2e-3)


def test_the_rope_backward_hands_the_fp8_qkv_linear_its_gradient_amax():
    """The FP8 QKV linear's token through the fused RoPE: its backward returns max |dqkv| (of the values it
    returns) as the token's gradient, and the linear casts dqkv with it instead of its own amax pass: the same
    outputs and gradients as without the token (max is exact, so the E5M2 codes are the same)."""
    from megacoat.precision.handoff import Handoff
    from megacoat.precision.linear import Fp8WeightCache, fp8_linear
    from megacoat.precision.recipe import Fp8Recipe
    coat = Fp8Recipe("e4m3", "e5m2", True)
    s, b, g, qpg, d, k = 6, 2, 2, 2, 8, 24
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(s, b, k, generator=gen).to(torch.bfloat16)
    w0 = (0.2 * torch.randn(g * (qpg + 2) * d, k, generator=gen)).to(torch.bfloat16)
    cos, sin = RotaryEmbedding(d, 16, 10000.0)(torch.randint(0, 16, (b, s), generator=gen), torch.bfloat16)
    grads = [torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in
             ((s, b, g * qpg, d), (s, b, g, d), (s, b, g, d))]
    runs = []
    for with_token in (False, True):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), coat, grad_amax_token=with_token)
        qkv, token = out if with_token else (out, None)
        view = qkv.view(s, b, g, qpg + 2, d)
        q, kk, v = rope_qkv(Handoff(view, token=token) if with_token else view, cos, sin)
        if with_token:  # the token's gradient is max |dqkv| of the gradient the linear casts
            dqkv, amax = torch.autograd.grad((q, kk, v), (qkv, token), grads, retain_graph=True)
            assert amax.shape == () and amax == dqkv.abs().amax().float() and amax > 0
        torch.autograd.backward((q, kk, v), grads)
        runs.append((q.detach(), kk.detach(), v.detach(), x.grad, w.grad))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


def _coat_losses(extra, drop_qkv_token=False, monkeypatch=None):
    if drop_qkv_token:  # the QKV linear hands the RoPE no token: it makes its own amax pass
        from megacoat.precision.layer_ops import RESIDUAL, CoatLayerOps
        monkeypatch.setattr(CoatLayerOps, "_token_consumers", (RESIDUAL,))
    return _losses(extra + ["--fp8-format", "hybrid", "--fp8-recipe", "coat"], ("--bf16",))


@pytest.mark.slow
def test_a_coat_model_trains_the_same_with_the_qkv_token(monkeypatch):
    """Eager: with the token (the fused RoPE hands the QKV linear max |dqkv|) exactly the losses of the linear's
    own amax pass. Compiled: those losses too, up to compiled rounding (a token whose gradient arrived as zeros
    would saturate every QKV gradient and show as far larger differences)."""
    token = _coat_losses(["--no-torch-compile", "--rope-fusion"])
    compiled = _coat_losses(["--torch-compile", "--rope-fusion"])
    no_token = _coat_losses(["--no-torch-compile", "--rope-fusion"], drop_qkv_token=True, monkeypatch=monkeypatch)
    assert len(set(token)) == len(token)
    assert token == no_token
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(token), rtol=1e-2, atol=1e-2)


def test_rope_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU hosts run the interpreter; GPU hosts the real kernels (below)")
    assert_interpreted_cases_pass("rope_interp_cases.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("s,b,g,qpg,d", [(2048, 4, 16, 1, 128), (37, 3, 4, 2, 64), (5, 2, 2, 4, 72),
                                         (33, 2, 2, 5, 128), (64, 2, 1, 32, 128)])
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
    got, amax = K.rope_qkv_backward(dq, dk, dv, cos, sin, True)
    close(got, rope_qkv_backward_reference(dq, dk, dv, cos, sin)[0])
    assert amax == got.abs().amax().float()
