"""The fused AdamW CUDA kernel (csrc/fused_adamw.cu) against its torch reference on the GPU.

DESIGN 5.4: identical FP8 codes and k over 100 consecutive steps on sizes that are not multiples
of 128, masters within 1e-6 relative (the kernel repeats the reference's fp32 operations one for
one, so everything is expected bit-identical; the test reports any difference). Also: every
state format, fp32 and bf16 gradients, the bf16 weights written in the same pass, clip factor and
skip flag on the device, COAT's golden outputs, the fp32 variant against torch's AdamW.
"""
import math
import os

import pytest
import torch

from megacoat.config import OptimizerConfig
from megacoat.optim.fp8_adam import (GROUP, AdamHyper, Chunk, MomentState, PrecisionAwareAdamW, decay_table,
                                     fused_extension, reference_step)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1000, 128, 77, 4099, 3 * 128 + 5]   # partial last groups, one exact group


def _cfg():
    return OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _setup(fmt, grad_dtype, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    offsets, n = [], 0
    for s in SIZES:
        offsets.append(n)
        n += -(-s // GROUP) * GROUP
    master = torch.zeros(n, device=dev)
    grad_buf = torch.zeros(sum(SIZES) + 3, dtype=grad_dtype, device=dev)   # + 3: misaligned chunks too
    chunks, pos = [], 3
    for i, (s, off) in enumerate(zip(SIZES, offsets)):
        master[off: off + s] = torch.randn(s, generator=g, device=dev) * 0.02
        w = torch.zeros(s, dtype=torch.bfloat16, device=dev)
        chunks.append(Chunk(off, off + -(-s // GROUP) * GROUP, grad_buf[pos: pos + s], w))
        pos += s
    decay = decay_table([(off, s, i % 2 == 0) for i, (off, s) in enumerate(zip(offsets, SIZES))], n, dev)
    codec = PrecisionAwareAdamW(master, chunks, decay, _cfg(), fmt[0], fmt[1], expand=fmt[2])
    return codec, grad_buf, g


def test_extension_builds():
    assert fused_extension() is not None, "csrc/fused_adamw.cu did not build (see the warning above)"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [("fp8", "fp8", True), ("fp8", "fp8", False), ("bf16", "bf16", True),
                                 ("fp32", "fp32", True)])
def test_kernel_matches_reference_100_steps(fmt, grad_dtype):
    codec, grad_buf, g = _setup(fmt, grad_dtype)
    assert codec.ext is not None, "the kernel should run for these formats"
    n = codec.master.numel()
    master = codec.master.clone()
    m, v = MomentState(fmt[0], n, "cuda", fmt[2]), MomentState(fmt[1], n, "cuda", fmt[2])
    step = torch.zeros((), device="cuda")
    code_diffs = k_diffs = 0
    for t in range(100):
        scale = 10.0 ** (-(t % 7))   # gradients over seven orders of magnitude; clipping on some steps
        grad_buf.copy_((torch.randn(grad_buf.numel(), generator=g, device="cuda") * scale).to(grad_buf.dtype))
        if t % 13 == 5:
            grad_buf[7:300] = 0      # exact zeros inside groups
        flats = []
        for c in codec.chunks:
            f = torch.zeros(c.end - c.start, device="cuda")
            f[: c.numel] = c.grad.float()
            flats.append(f)
        flat = torch.cat(flats)
        norm = flat.norm()
        coeff = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        assert bool(codec.step(1e-3, norm))
        reference_step(master, [Chunk(0, n, flat)], m, v, codec.group_decay, codec.hp, 1e-3, coeff, step)
        step += 1
        code_diffs += int((codec.m.data != m.data).sum() + (codec.v.data != v.data).sum())
        if fmt[0] == "fp8":
            k_diffs += int((codec.m.k != m.k).sum() + (codec.v.k != v.k).sum())
        rel = ((codec.master - master).abs().max() / master.abs().max()).item()
        assert rel <= 1e-6, (t, rel)
    assert code_diffs == 0 and k_diffs == 0, (code_diffs, k_diffs)
    assert torch.equal(codec.master, master), "masters agree within 1e-6 but not bit for bit"
    for c in codec.chunks:
        assert torch.equal(c.weight, codec.master[c.start: c.start + c.numel].to(torch.bfloat16))
    assert codec.step_count.item() == 100


def test_skip_flag_and_step_count_on_device():
    codec, grad_buf, g = _setup(("fp8", "fp8", True), torch.bfloat16)
    grad_buf.copy_(torch.randn(grad_buf.numel(), generator=g, device="cuda").bfloat16())
    codec.step(1e-3, grad_buf.float().norm())
    before = [t.clone() for t in [codec.master, codec.step_count] + codec.m.tensors() + codec.v.tensors()
              + [c.weight for c in codec.chunks]]
    ok = codec.step(1e-3, torch.tensor(float("nan"), device="cuda"))
    after = [codec.master, codec.step_count] + codec.m.tensors() + codec.v.tensors() + [c.weight for c in codec.chunks]
    assert not bool(ok)
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_kernel_reproduces_coat_golden():
    gold = torch.load(os.path.join(os.path.dirname(__file__), "data", "coat_adamw_golden_nozeros.pt"),
                      weights_only=True)
    h = gold["hyper"]
    from test_fp8_adam import _golden_grad
    cfg = OptimizerConfig(lr=h["lr"], weight_decay=h["wd"], adam_beta1=h["beta1"], adam_beta2=h["beta2"],
                          adam_eps=h["eps"], clip_grad=0.0)
    for i, shape in enumerate(gold["shapes"]):
        n = math.prod(shape)
        size = -(-n // GROUP) * GROUP
        master = torch.zeros(size, device="cuda")
        master[:n] = gold["expand_init"][i].reshape(-1).cuda()
        grad = torch.zeros(n, device="cuda")
        decay = torch.ones(size // GROUP, dtype=torch.bool, device="cuda")
        codec = PrecisionAwareAdamW(master, [Chunk(0, size, grad)], decay, cfg, "fp8", "fp8", True)
        for t in range(1, 21):
            grad.copy_(_golden_grad(t, i, shape).reshape(-1))
            codec.step(h["lr"], torch.zeros((), device="cuda"))
            if t in (1, 10, 20):
                want = gold["expand"][t][i]
                assert torch.equal(codec.m.data[:n].cpu(), want["m"].reshape(-1)), (i, t)
                assert torch.equal(codec.v.data[:n].cpu(), want["v"].reshape(-1)), (i, t)
                assert torch.equal(codec.m.k.cpu(), want["km"]) and torch.equal(codec.v.k.cpu(), want["kv"])


def test_fp32_kernel_close_to_torch_adamw():
    torch.manual_seed(0)
    n = 10_000
    p0 = torch.randn(n, device="cuda") * 0.02
    master = torch.zeros(-(-n // GROUP) * GROUP, device="cuda")
    master[:n] = p0
    grad = torch.zeros(n, device="cuda")
    w = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    decay = torch.ones(master.numel() // GROUP, dtype=torch.bool, device="cuda")
    codec = PrecisionAwareAdamW(master, [Chunk(0, master.numel(), grad, w)], decay, _cfg(), "fp32", "fp32")
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for _ in range(20):
        grad.copy_(torch.randn(n, device="cuda") * 1e-3)
        ref.grad = grad.clone()
        opt.step()
        codec.step(1e-3, torch.zeros((), device="cuda"))   # norm 0: no clipping
    torch.testing.assert_close(master[:n], ref.detach(), rtol=1e-5, atol=1e-7)
    assert torch.equal(w, master[:n].bfloat16())


def test_compiled_reference_fallback_close_to_kernel():
    """Without the kernel the GPU runs the reference under torch.compile (with the device skip)."""
    a, grad_a, g = _setup(("fp8", "fp8", True), torch.float32, seed=3)
    b, grad_b, _ = _setup(("fp8", "fp8", True), torch.float32, seed=3)
    b.ext = None
    for t in range(5):
        x = torch.randn(grad_a.numel(), generator=g, device="cuda") * 1e-2
        grad_a.copy_(x)
        grad_b.copy_(x)
        a.step(1e-3, x.norm())
        b.step(1e-3, x.norm())
    torch.testing.assert_close(a.master, b.master, rtol=1e-4, atol=1e-6)
    assert (a.m.data == b.m.data).float().mean() > 0.99
