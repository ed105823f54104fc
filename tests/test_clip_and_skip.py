"""Gradient clipping and the non-finite skip, checked against torch itself (not against our own
code): the norm and the clip factor against `torch.nn.utils.clip_grad_norm_`, the update against
`torch.optim.AdamW` on the clipped gradients; a non-finite norm leaves weights, moments and the
step count untouched. Both codec paths: the host path (foreach, CPU) and the fused one (torch's
fused AdamW with grad_scale / found_inf, the GPU path; torch also runs it on CPU), plus the whole
optimizer on a GPU (bf16 weights, fp32 masters)."""
import copy

import pytest
import torch

from megacoat.config import OptimizerConfig
from megacoat.model.gpt import GPTModel, padded_vocab_size
from megacoat.model.transformer import LayerContext
from megacoat.optim.adamw import Fp32AdamW
from megacoat.optim.optimizer import MixedPrecisionAdamW
from megacoat.parallel.context import ParallelContext
from megacoat.parallel.random import seed_everything
from parallel_harness import VOCAB, batches, run_step, small_model_config

# Adam is nearly invariant to the gradient's scale (m / sqrt(v)) unless eps is comparable to the
# gradients: with eps = 1e-2 the update depends on the clip factor, so a wrong factor shows.
LR, WD, EPS = 1e-2, 0.1, 1e-2


def reference_step(masters, grads, no_decay, clip, lr=LR):
    """torch's own clip_grad_norm_ + AdamW (float64 copies): (new weights, norm, clip factor)."""
    params = [torch.nn.Parameter(m.detach().double().clone()) for m in masters]
    for p, g in zip(params, grads):
        p.grad = g.detach().double().clone()
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    factor = min(1.0, clip / (norm.item() + 1e-6)) if clip > 0 else 1.0  # what clip_grad_norm_ applied
    groups = [{"params": [p for p, nd in zip(params, no_decay) if not nd], "weight_decay": WD},
              {"params": [p for p, nd in zip(params, no_decay) if nd], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.999), eps=EPS, foreach=False)
    opt.step()
    return [p.detach() for p in params], norm.item(), factor


def random_masters(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (5,), (16, 16), (3,), (129,)]  # odd sizes, 1-d tensors without weight decay
    masters = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) * (i + 1) for i, s in enumerate(shapes)]
    return masters, grads, [len(s) == 1 for s in shapes]


def max_diff(a, b):
    return max((x.detach().double() - y.double()).abs().max().item() for x, y in zip(a, b))


def total_norm(grads):
    return torch.stack([g.double().norm() for g in grads]).norm().float()


@pytest.mark.parametrize("fused", [False, True], ids=["host-path", "fused-path"])
@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6], ids=["no-clip", "clipped", "clip-inactive"])
def test_codec_clip_matches_torch_clip_grad_norm(fused, clip, device="cpu"):
    masters, grads, no_decay = random_masters(device)
    before = [m.detach().clone() for m in masters]
    ref, ref_norm, ref_factor = reference_step(masters, grads, no_decay, clip)
    cfg = OptimizerConfig(lr=LR, clip_grad=clip, weight_decay=WD, adam_eps=EPS)
    codec = Fp32AdamW(masters, no_decay, cfg, fused=fused)
    for m, g in zip(masters, grads):
        m.grad = g.clone()
    norm = total_norm(grads)
    assert norm.item() == pytest.approx(ref_norm, rel=1e-6)
    if clip == 0.5:
        assert ref_factor < 0.2  # the case really clips
    success = codec.step(LR, norm, lambda c: [m.grad.mul_(c) for m in masters])
    assert bool(success)
    if fused and clip > 0:  # the fused kernel divides by grad_scale: 1 / (Megatron's and torch's factor)
        assert 1.0 / codec.opt.grad_scale.item() == pytest.approx(ref_factor, rel=1e-6)
    for m, r in zip(masters, ref):
        torch.testing.assert_close(m.detach().double(), r, rtol=1e-6, atol=1e-7)
    if ref_factor < 1.0:  # the comparison can fail: unclipped, the weights would be far outside the tolerance
        unclipped, _, _ = reference_step(before, grads, no_decay, 0.0)
        assert max_diff(masters, unclipped) > 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["host-path", "fused-path"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_codec_skips_non_finite_norm(fused, bad, device="cpu"):
    masters, grads, no_decay = random_masters(device, seed=1)
    codec = Fp32AdamW(masters, no_decay, OptimizerConfig(lr=LR, clip_grad=1.0, weight_decay=WD, adam_eps=EPS),
                      fused=fused)
    for m, g in zip(masters, grads):
        m.grad = g.clone()
    assert bool(codec.step(LR, total_norm(grads), lambda c: [m.grad.mul_(c) for m in masters]))  # one good step
    before = [m.detach().clone() for m in masters]
    states = [{k: v.clone() for k, v in codec.opt.state[m].items()} for m in masters]
    grads[2].view(-1)[7] = bad
    for m, g in zip(masters, grads):
        m.grad = g.clone()
    success = codec.step(LR, total_norm(grads), lambda c: [m.grad.mul_(c) for m in masters])
    assert not bool(success)
    for m, b, st in zip(masters, before, states):
        assert torch.equal(m.detach(), b)
        for k, v in codec.opt.state[m].items():
            assert torch.equal(v, st[k]), k
    assert codec.scalar_state()["adam_step"] == 1.0
    # ... and the next finite step is an ordinary second step.
    grads[2].view(-1)[7] = 0.0
    for m, g in zip(masters, grads):
        m.grad = g.clone()
    assert bool(codec.step(LR, total_norm(grads), lambda c: [m.grad.mul_(c) for m in masters]))
    assert codec.scalar_state()["adam_step"] == 2.0
    assert any(not torch.equal(m.detach(), b) for m, b in zip(masters, before))


def _model(device, dtype):
    m = small_model_config()
    rng = seed_everything(11, 0, device)
    lc = LayerContext(None, False, rng, dtype, device, 11)
    return GPTModel(m, lc, VOCAB, padded_vocab_size(VOCAB, m.make_vocab_size_divisible_by, 1)), m


def _optimizer_vs_torch(device, dtype, clip):
    """The whole optimizer (grad buffer, global norm, clip, AdamW, weight copy) against torch."""
    model, m = _model(device, dtype)
    opt = MixedPrecisionAdamW(model, OptimizerConfig(lr=LR, clip_grad=clip, weight_decay=WD, adam_eps=EPS),
                              ParallelContext.single(device))
    run_step(model, opt, batches(0, 2, 2, m.seq_length), 2)
    params = list(model.parameters())
    grads = [p.main_grad.detach().float().clone() for p in params]
    masters = [mm.detach().clone() for mm in opt.masters]
    ref, ref_norm, ref_factor = reference_step(masters, grads, [p.ndim <= 1 for p in params], clip)
    result = opt.step(LR)
    assert bool(result.success)
    assert result.grad_norm.item() == pytest.approx(ref_norm, rel=1e-5)
    if clip:
        assert ref_factor < 0.5  # the case really clips
    for mm, r in zip(opt.masters, ref):
        torch.testing.assert_close(mm.detach().double(), r, rtol=1e-5, atol=1e-6)
    if clip:  # a wrong clip factor would be visible: unclipped, the weights land far outside the tolerance
        unclipped, _, _ = reference_step(masters, grads, [p.ndim <= 1 for p in params], 0.0)
        assert max_diff(opt.masters, unclipped) > 1e-4
    for p, mm in zip(params, opt.masters):  # the compute weights are the masters, rounded
        assert torch.equal(p.detach(), mm.detach().to(p.dtype))
    return model, opt, m


def test_optimizer_norm_and_clip_match_torch_cpu():
    _optimizer_vs_torch(torch.device("cpu"), torch.float32, clip=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fused_optimizer_norm_and_clip_match_torch_gpu(clip):
    _optimizer_vs_torch(torch.device("cuda"), torch.bfloat16, clip)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True], ids=["fused-path"])
@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6], ids=["no-clip", "clipped", "clip-inactive"])
def test_fused_codec_clip_gpu(fused, clip):
    test_codec_clip_matches_torch_clip_grad_norm(fused, clip, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_fused_codec_skip_gpu(bad):
    test_codec_skips_non_finite_norm(True, bad, device="cuda")


@pytest.mark.gpu
def test_fused_optimizer_skips_non_finite_step_gpu():
    """bf16 weights on the GPU: a NaN gradient skips the step without the host reading the norm."""
    device = torch.device("cuda")
    # clip 0.5: the bf16 model's gradient norm on the H200 is ~1.7, so the setup step clips (factor ~0.29);
    # with 1.0 the set-up's own "really clips" check failed there (factor 0.58).
    model, opt, m = _optimizer_vs_torch(device, torch.bfloat16, clip=0.5)
    run_step(model, opt, batches(1, 2, 2, m.seq_length), 2)
    opt.norm_overlap = None  # the NaN is written after the backward, where the overlapped norm already read
    next(model.parameters()).main_grad.view(-1)[3] = float("nan")
    weights = [p.detach().clone() for p in model.parameters()]
    # Every optimizer state (master, moments, a codec's own tensors) through the checkpoint interface,
    # whichever codec the GPU build picked (torch's AdamW or the fused flat-shard kernel).
    states = [{k: v.clone() for k, v in r.tensors.items()} for r in opt.state_ranges()]
    result = opt.step(LR)
    assert not bool(result.success) and torch.isnan(result.grad_norm).item()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
    for r, st in zip(opt.state_ranges(), states):
        assert all(torch.equal(v, st[k]) for k, v in r.tensors.items())
    assert opt.scalar_state()["adam_step"] == 1.0
