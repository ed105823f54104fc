"""The fused AdamW CUDA kernel (csrc/fused_adamw.cu) against its torch reference on the GPU.

What the kernel must meet: identical FP8 codes and k over 100 consecutive steps on sizes that are
not multiples of 128, masters within 1e-6 relative (the kernel repeats the reference's fp32 operations
one for one, including CUDA's powf/log2f/exp2f, which torch's fp32 pow/log2/exp2 call on the GPU). Also:
every state format (FP8 with expansion in the exp2/log2 form, and without), fp32 and bf16 gradients, the
bf16 weights written in the same pass, clip factor and skip flag on the device, agreement with COAT's
golden outputs, the fp32 kernel against torch's AdamW, the compiled-reference fallback. Each format runs
one configuration of the kernel (csrc/fused_adamw.cu ConfigFor): fp32 and bf16 moments the exact update,
so their step equals the reference bit for bit; FP8 moments the update's square root and division
approximated, so their masters need only be within 1e-6 relative, while the moments' codes and s, k, c,
which do not depend on the master, must still be bit for bit.
"""
import math

import pytest
import torch

from megacoat.config import OptimizerConfig
from megacoat.optim.fp8_adam import (GROUP, Chunk, MomentState, PrecisionAwareAdamW, _reference_with_skip, decay_table,
                                     fused_extension, reference_step)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1000, 128, 77, 4099, 3 * 128 + 5]   # partial last groups, one exact group
FORMATS = [("fp8", "fp8", True), ("fp8", "fp8", False), ("bf16", "bf16", True), ("fp32", "fp32", True)]
FORMAT_IDS = ["fp8_expand", "fp8_absmax", "bf16", "fp32"]
EXACT_UPDATE = {"fp32", "bf16"}  # moment formats whose kernel configuration runs the exact update


def _cfg():
    return OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


def _setup(fmt, grad_dtype, seed=0, sizes=SIZES):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    offsets, n = [], 0
    for s in sizes:
        offsets.append(n)
        n += -(-s // GROUP) * GROUP
    master = torch.zeros(n, device=dev)
    grad_buf = torch.zeros(sum(sizes) + 3, dtype=grad_dtype, device=dev)   # + 3: misaligned chunks too
    chunks, pos = [], 3
    for i, (s, off) in enumerate(zip(sizes, offsets)):
        master[off: off + s] = torch.randn(s, generator=g, device=dev) * 0.02
        w = torch.zeros(s, dtype=torch.bfloat16, device=dev)
        chunks.append(Chunk(off, off + -(-s // GROUP) * GROUP, grad_buf[pos: pos + s], w))
        pos += s
    decay = decay_table([(off, s, i % 2 == 0) for i, (off, s) in enumerate(zip(offsets, sizes))], n, dev)
    codec = PrecisionAwareAdamW(master, chunks, decay, _cfg(), fmt[0], fmt[1], expand=fmt[2])
    return codec, grad_buf, g


def test_extension_builds():
    assert fused_extension() is not None, "csrc/fused_adamw.cu did not build (see the warning above)"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_kernel_matches_reference_100_steps(fmt, grad_dtype):
    codec, grad_buf, g = _setup(fmt, grad_dtype)
    assert codec.ext is not None, "the kernel should run for these formats"
    n = codec.master.numel()
    master = codec.master.clone()
    m = MomentState(fmt[0], n, "cuda", fmt[2], codec.m.fast)
    v = MomentState(fmt[1], n, "cuda", fmt[2], codec.v.fast)
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
    if fmt[0] == "fp8":
        assert all(torch.equal(a, b) for a, b in zip(codec.m.tensors() + codec.v.tensors(), m.tensors() + v.tensors()))
    if fmt[0] in EXACT_UPDATE:
        assert torch.equal(codec.master, master), "masters agree within 1e-6 but not bit for bit"
    else:
        assert not torch.equal(codec.master, master), "the approximate update should differ somewhere"
    for c in codec.chunks:
        assert torch.equal(c.weight, codec.master[c.start: c.start + c.numel].to(torch.bfloat16))
    assert codec.step_count.item() == 100


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_on_a_large_shard(grad_dtype):
    """A few steps on a shard large enough that every warp of the persistent grid loops (the pipelined
    FP8 configuration then copies its next unit in, also across chunk ends); the 100-step test's shard
    fits in one pass. Codes, s, k, c bit for bit; masters as in the 100-step test."""
    sizes = [2_000_001, 77, 4099, 131_077]
    for fmt in FORMATS:
        codec, grad_buf, g = _setup(fmt, grad_dtype, seed=5, sizes=sizes)
        n = codec.master.numel()
        master = codec.master.clone()
        m = MomentState(fmt[0], n, "cuda", fmt[2], codec.m.fast)
        v = MomentState(fmt[1], n, "cuda", fmt[2], codec.v.fast)
        step = torch.zeros((), device="cuda")
        for t in range(3):
            grad_buf.copy_((torch.randn(grad_buf.numel(), generator=g, device="cuda") * 10.0 ** -t).to(grad_dtype))
            flat = torch.cat([torch.nn.functional.pad(c.grad.float(), (0, c.end - c.start - c.numel))
                              for c in codec.chunks])
            norm = flat.norm()
            codec.step(1e-3, norm)
            reference_step(master, [Chunk(0, n, flat)], m, v, codec.group_decay, codec.hp, 1e-3,
                           torch.clamp(1.0 / (norm + 1e-6), max=1.0), step)
            step += 1
        assert all(torch.equal(a, b) for a, b in zip(codec.m.tensors() + codec.v.tensors(), m.tensors() + v.tensors())), fmt
        if fmt[0] in EXACT_UPDATE:
            assert torch.equal(codec.master, master), fmt
        else:
            rel = ((codec.master - master).abs().max() / master.abs().max()).item()
            assert rel <= 1e-6, (fmt, rel)
        for c in codec.chunks:
            assert torch.equal(c.weight, codec.master[c.start: c.start + c.numel].to(torch.bfloat16)), fmt


def test_moments_decaying_into_the_denormals_match_the_reference():
    """Groups whose values straddle fp32's smallest normal while their max stays far above the statistics'
    1e-30 floor (a moment decaying under zero gradients gets there): with k = 1/4 a group's values are
    (|q| s)^4, from ~2^-160 to ~2^-90. The fast form dequantizes those below 2^-126 to 0 in the kernel
    (MUFU.EX2 without its denormal path) and in the reference alike: codes and s, k, c stay identical. (A
    flushed negative value decays to +0 and its code is 0x00; unflushed it would stay a negative denormal,
    code 0x80: a kernel and a reference that flush differently disagree there.)"""
    codec, grad_buf, g = _setup(("fp8", "fp8", True), torch.float32, sizes=[1000, 77, 300])
    n = codec.master.numel()
    m = MomentState("fp8", n, "cuda", True, True)
    v = MomentState("fp8", n, "cuda", True, True)
    codes = torch.randint(1, 0x7E, (n,), generator=g, device="cuda", dtype=torch.int64).to(torch.uint8)
    signs = (torch.rand(n, generator=g, device="cuda") < 0.5).to(torch.uint8) * 0x80
    groups = n // GROUP
    s = 2.0 ** (-31.3 + torch.linspace(-1.0, 1.0, groups, device="cuda"))  # 448 s ~ 2^-22.5: max (448 s)^4 ~ 2^-90
    for st, data in ((codec.m, codes | signs), (m, codes | signs), (codec.v, codes), (v, codes)):
        st.data.copy_(data)
        st.s.copy_(s)
        st.k.fill_(0.25)
        st.c.fill_(1.0)
    from megacoat.optim.fp8_adam import dequantize_groups
    start = dequantize_groups(m.data.view(-1, GROUP), m.s, m.k, m.c, expand=True, fast=False).abs()
    assert ((start > 0) & (start < 2.0 ** -126)).any() and (start > 1e-28).any(), "the groups must straddle 2^-126"
    master = codec.master.clone()
    step = torch.zeros((), device="cuda")
    grad_buf.zero_()
    flat = torch.zeros(n, device="cuda")
    for t in range(5):
        assert bool(codec.step(1e-3, torch.zeros((), device="cuda")))
        reference_step(master, [Chunk(0, n, flat)], m, v, codec.group_decay, codec.hp, 1e-3,
                       torch.ones((), device="cuda"), step)
        step += 1
        for a, b in zip(codec.m.tensors() + codec.v.tensors(), m.tensors() + v.tensors()):
            assert torch.equal(a, b), t
    magnitudes = codec.m.data & 0x7F
    assert (magnitudes != 0).float().mean() > 0.05, "the groups' larger values (far above 1e-30) keep nonzero codes"


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


def _ordinal(q):
    """E4M3 codes as signed integers ordered like their values."""
    q = q.to(torch.int32)
    return torch.where(q >= 128, 128 - q, q)


def test_kernel_agrees_with_coat_golden():
    """Agreement with COAT's own kernel outputs (tests/data), measured, printed and bounded.

    Why not bit for bit on the GPU (on the H200 the v codes of tensor 0 differed at step 20):
    COAT's kernel is built with nvcc's default FMA contraction (its b1 m + (1 - b1) g and
    b2 v + (1 - b2) g g become fused multiply-adds), computes the centre as sqrt(max min) (ours:
    sqrt(max) sqrt(min), which cannot underflow) and uses powf, which is not correctly rounded; so
    some fp32 results differ from ours in the last bit. A last-bit difference moves an E4M3 code
    only where the value sits at a rounding boundary, and then by one step. Later steps carry it
    on: the moments differ by that step, a group whose smallest element moved gets another min,
    so another c and s (all its codes may shift) or even another k (several 1/16: k is
    floor(16 log2(448^2/2) / log2(max/min)) / 16). The CPU reference happens to match every checked
    code on these inputs (tests/test_fp8_adam.py keeps that exact, in COAT's powf form of the expansion); the
    GPU kernel, which runs the exp2/log2 form, need not.

    What a correct implementation guarantees, and is asserted: at step 1 (zero state: the moments
    are (1 - b) g up to one rounding) codes within one step and every k identical (both measured
    on the CPU: the fast form differs from the golden in 1e-5 of the codes there); at steps 10 and
    20 >= 99.5 % identical codes, identical k in >= 99 % of groups, dequantized moments within
    5e-3 relative L2 of COAT's (E4M3's own quantization error is ~3e-2; measured on the CPU: powf
    form 2.5e-7, exp2/log2 form 1.2e-3), parameters within 5e-4 relative L2 (measured on the CPU: 1.4e-4;
    tests/data/README.md's bound of 2e-5 holds for the powf form, whose codes are COAT's own rounding: the
    exp2/log2 form is a different rounding of the same function, so COAT's boundary cases flip more often)."""
    from coat_golden import golden_grad, load_coat_golden
    gold = load_coat_golden()
    h = gold["hyper"]
    cfg = OptimizerConfig(lr=h["lr"], weight_decay=h["wd"], adam_beta1=h["beta1"], adam_beta2=h["beta2"],
                          adam_eps=h["eps"], clip_grad=0.0)
    report = []
    for i, shape in enumerate(gold["shapes"]):
        n = math.prod(shape)
        size = -(-n // GROUP) * GROUP
        master = torch.zeros(size, device="cuda")
        master[:n] = gold["init"][i].reshape(-1).cuda()
        nk = gold["kept"][i]  # compared: the kept prefix, a whole number of groups
        gk = -(-nk // GROUP)
        grad = torch.zeros(n, device="cuda")
        decay = torch.ones(size // GROUP, dtype=torch.bool, device="cuda")
        codec = PrecisionAwareAdamW(master, [Chunk(0, size, grad)], decay, cfg, "fp8", "fp8", True)
        assert codec.ext is not None
        for t in range(1, 21):
            grad.copy_(golden_grad(t, i, shape).reshape(-1))
            codec.step(h["lr"], torch.zeros((), device="cuda"))
            if t not in (1, 10, 20):
                continue
            want = gold["expand"][t][i]
            for name, ms in (("m", codec.m), ("v", codec.v)):
                got = ms.data[:nk].cpu()
                dist = (_ordinal(got) - _ordinal(want[name])).abs()
                same = (dist == 0).float().mean().item()
                k = ms.k[:gk].cpu()
                k_same = (k == want["k" + name]).float().mean().item()
                k_dist = (k - want["k" + name]).abs().max().item()
                codes = torch.zeros(gk * GROUP, dtype=torch.uint8)
                codes[:nk] = want[name]
                theirs = MomentState("fp8", gk * GROUP, "cpu", True)  # COAT's values: exact form, its s, k, c
                theirs.data.copy_(codes)
                theirs.s.copy_(want["s" + name]), theirs.k.copy_(want["k" + name]), theirs.c.copy_(want["c" + name])
                ref_vals = theirs.load(0, gk).view(-1)[:nk]
                vals = ms.load(0, gk).view(-1)[:nk].cpu()
                val_rel = ((vals - ref_vals).norm() / ref_vals.norm()).item()
                report.append(f"tensor {i} step {t} {name}: codes identical {same:.6f} ({int((dist > 0).sum())} "
                              f"differ, max distance {int(dist.max())}), k identical {k_same:.4f} (max |dk| "
                              f"{k_dist}), values relative L2 {val_rel:.3g}")
                if t == 1:
                    assert int(dist.max()) <= 1 and k_same == 1.0, report[-1]
                assert same >= 0.995 and k_same >= 0.99 and val_rel <= 5e-3, report[-1]
            ref_p = want["param"]
            rel = ((codec.master[:nk].cpu() - ref_p).norm() / ref_p.norm()).item()
            report.append(f"tensor {i} step {t}: parameter relative L2 {rel:.3g}")
            assert rel <= 5e-4, report[-1]
    print("\n".join(report))


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
    """Without the kernel the GPU runs the reference under torch.compile (with the device skip).
    fullgraph=True: a graph break fails here (a host tensor made in AdamHyper.scalars once broke the
    graph, and inductor compiled a CPU kernel past the test's time limit). Small, one
    compile: lr changes every step but is passed as a device tensor (no recompilation)."""
    sizes = [1000, 77]
    a, grad_a, g = _setup(("fp8", "fp8", True), torch.float32, seed=3, sizes=sizes)
    b, grad_b, _ = _setup(("fp8", "fp8", True), torch.float32, seed=3, sizes=sizes)
    b.ext = None
    b._compiled = torch.compile(_reference_with_skip, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    for t in range(4):
        x = torch.randn(grad_a.numel(), generator=g, device="cuda") * 1e-2
        grad_a.copy_(x)
        grad_b.copy_(x)
        lr = 1e-3 * (t + 1)
        norm = x.norm() if t != 2 else torch.tensor(float("inf"), device="cuda")   # step 2 is skipped
        a.step(lr, norm)
        b.step(lr, norm)
    assert b._compiled is not _reference_with_skip, "the compiled reference fell back to eager"
    assert a.step_count.item() == b.step_count.item() == 3
    torch.testing.assert_close(a.master, b.master, rtol=1e-4, atol=1e-6)
    # Triton's exp2/log2 need not round like CUDA's exp2f/log2f: codes within one step
    dist = (_ordinal(a.m.data) - _ordinal(b.m.data)).abs()
    assert int(dist.max()) <= 1 and (dist == 0).float().mean() > 0.99
    for c_a, c_b in zip(a.chunks, b.chunks):
        torch.testing.assert_close(c_a.weight.float(), c_b.weight.float(), rtol=1e-2, atol=1e-5)
