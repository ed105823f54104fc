"""Gradient-accumulation fusion: the weight-gradient GEMM adds into main_grad (no bf16 .grad)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megacoat.kernels.wgrad import wgrad_accumulate, wgrad_accumulate_reference


def wgrad_accumulate_(main, g, x, flag):
    """The op with the mutate-in-place signature of the reference; checks its placeholder output."""
    out = wgrad_accumulate(main, g, x, flag, g.dtype)
    assert out.shape == main.shape and out.dtype == g.dtype
from megacoat.optim.buffers import GradAccumulator
from megacoat.parallel.layers import ColumnParallelLinear, InitSpec, RowParallelLinear


def test_wgrad_accumulate_matches_float64():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 7, 24, generator=gen)
    x = torch.randn(3, 7, 40, generator=gen)
    main = torch.randn(24, 40, generator=gen)
    expect = main.double() + g.reshape(-1, 24).double().t() @ x.reshape(-1, 40).double()
    flag = torch.tensor([False])
    for fn, arg in ((wgrad_accumulate_, flag), (wgrad_accumulate_reference, False)):
        out = main.clone()
        fn(out, g, x, arg)
        torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)
    # overwrite: the stale contents are ignored, and the op clears its flag
    flag = torch.tensor([True])
    out = torch.full_like(main, float("nan"))
    wgrad_accumulate_(out, g, x, flag)
    torch.testing.assert_close(out.double(), expect - main.double(), rtol=1e-5, atol=1e-5)
    assert not flag.item()


def test_wgrad_accumulate_mixed_dtype_reference():
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(33, 16, generator=gen).bfloat16()
    x = torch.randn(33, 48, generator=gen).bfloat16()
    main = torch.randn(16, 48, generator=gen)
    out = main.clone()
    wgrad_accumulate_(out, g, x, torch.tensor([False]))
    expect = main.double() + g.double().t() @ x.double()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expect, rtol=2e-2, atol=2e-2)


def _layers(fuse, bias):
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 24, tp_group=None, name="c", init=InitSpec(5, 0.1), bias=bias,
                               gradient_accumulation_fusion=fuse)
    row = RowParallelLinear(24, 8, tp_group=None, name="r", init=InitSpec(6, 0.1), bias=bias,
                            gradient_accumulation_fusion=fuse)
    return nn.ModuleList([col, row])


def _run(model, micro_batches, compile_):
    params = list(model.parameters())
    for p in params:
        p.main_grad = torch.full_like(p, 123.0)  # stale values from a previous step must not leak in
    acc = GradAccumulator(params)
    fwd = (lambda x: model[1](F.gelu(model[0](x))))
    if compile_:
        fwd = torch.compile(fwd)
    for step in range(2):
        acc.zero()
        for x in micro_batches:
            fwd(x).square().sum().backward()
        acc.finalize()
        assert all(p.grad is None for p in params)
    return [p.main_grad.clone() for p in params]


def test_fused_linear_layers_match_unfused_over_micro_batches():
    gen = torch.Generator().manual_seed(2)
    mbs = [torch.randn(5, 2, 16, generator=gen) for _ in range(3)]
    plain = _run(_layers(False, True), mbs, False)
    fused_model = _layers(True, True)
    assert fused_model[0].weight.grad_added_to_main_grad and not hasattr(fused_model[0].bias, "grad_added_to_main_grad")
    fused = _run(fused_model, mbs, False)
    for a, b in zip(plain, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert a.abs().max() < 100  # the stale 123s were overwritten / zeroed


@pytest.mark.slow
def test_fused_linear_under_torch_compile():
    gen = torch.Generator().manual_seed(3)
    mbs = [torch.randn(4, 3, 16, generator=gen) for _ in range(2)]
    plain = _run(_layers(False, False), mbs, False)
    fused = _run(_layers(True, False), mbs, True)
    for a, b in zip(plain, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_layers_write_bucket_views_without_functionalizing_them():
    """main_grads are views of one gradient bucket. If the compiled graphs treat them as mutated inputs,
    AOTAutograd functionalizes the aliased views (a cloned synthetic base in the forward, copies back after
    the backward): on the H200 at TP=2 the layer gradients then never reached the buffer. The op must stay
    an opaque call that writes the bucket itself, and the bucket must hold the right gradients."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, _inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    gen = torch.Generator().manual_seed(7)
    mbs = [torch.randn(4, 3, 16, generator=gen) for _ in range(2)]
    plain = _run(_layers(False, False), mbs, False)
    model = _layers(True, False)
    params = list(model.parameters())
    bucket = torch.full((sum(p.numel() for p in params),), 123.0)
    acc = GradAccumulator(params)
    offset = 0
    for p in params:
        p.main_grad = bucket[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    torch._dynamo.reset()
    fwd = torch.compile(lambda x: model[1](F.gelu(model[0](x))), backend=aot_autograd(fw_compiler=record,
                                                                                       bw_compiler=record))
    for step in range(2):
        acc.zero()
        for x in mbs:
            fwd(x).square().sum().backward()
        acc.finalize()
    for a, p in zip(plain, params):
        torch.testing.assert_close(p.main_grad, a, rtol=1e-5, atol=1e-5)
    code = "\n".join(graphs)
    assert "megacoat.wgrad_accumulate" in code and code.count("wgrad_accumulate.default(") == 2
    assert "auto_functionalized" not in code and "as_strided" not in code and "copy_" not in code


def test_inference_without_main_grad_uses_plain_linear():
    model = _layers(True, False)
    x = torch.randn(2, 16)
    y = model[1](model[0](x))
    y.sum().backward()  # no main_grad: ordinary .grad
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


def test_fused_linear_two_forwards_before_backwards():
    """Pipelining runs several forwards before their backwards: main_grad changes in between."""
    gen = torch.Generator().manual_seed(4)
    mbs = [torch.randn(4, 16, generator=gen) for _ in range(2)]
    grads = []
    for fuse in (False, True):
        model = _layers(fuse, False)
        params = list(model.parameters())
        for p in params:
            p.main_grad = torch.zeros_like(p)
        acc = GradAccumulator(params)
        acc.zero()
        losses = [model[1](model[0](x)).square().sum() for x in mbs]
        for loss in losses:
            loss.backward()
        acc.finalize()
        grads.append([p.main_grad.clone() for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _tiny_gpt_with_optimizer(bucket_size, **opt_kwargs):
    """A 2-layer GPT (CPU, fp32) and its non-sharded optimizer with small gradient buckets."""
    from megacoat.config import ModelConfig, OptimizerConfig, resolve_model_defaults
    from megacoat.model.gpt import GPTModel
    from megacoat.model.transformer import LayerContext
    from megacoat.optim.optimizer import MixedPrecisionAdamW
    from megacoat.parallel.context import ParallelContext

    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, attention_dropout=0.0,
                    hidden_dropout=0.0)
    resolve_model_defaults(m)
    model = GPTModel(m, LayerContext(None, False, None, torch.float32, torch.device("cpu"), 7), 100, 128)
    opt = MixedPrecisionAdamW(model, OptimizerConfig(lr=1e-2, **opt_kwargs), ParallelContext.single(torch.device("cpu")),
                              bucket_size=bucket_size)
    return model, opt


def test_grad_buckets_released_between_steps_match_persistent():
    """GradBuffer with release_between_steps: same gradients, memory only between backward and step."""
    tokens = torch.randint(0, 100, (3, 2, 17), generator=torch.Generator().manual_seed(5))
    results = []
    for release in (False, True):
        model, opt = _tiny_gpt_with_optimizer(5000)
        assert len(opt.grad_buffer.buckets) > 2 and opt.grad_buffer.release_between_steps
        if not release:
            model.pre_backward_hook = None
            opt.grad_buffer.release_between_steps = False
            for b in opt.grad_buffer.buckets:
                b.untyped_storage().resize_(b.numel() * b.element_size())
        else:
            assert all(b.untyped_storage().nbytes() == 0 for b in opt.grad_buffer.buckets)
        losses, grads = [], []
        for step in range(3):
            opt.zero_grad()
            for i, mb in enumerate(tokens[step:step + 2]):  # two micro-batches
                opt.start_micro_batch(is_last=i == 1)
                loss = model(mb[:, :-1], labels=mb[:, 1:]).mean() / 2
                loss.backward()
            grads.append(torch.cat([b.clone() for b in opt.grad_buffer.buckets]))
            opt.step(1e-2)
            losses.append(loss.item())
            if release:
                assert all(b.untyped_storage().nbytes() == 0 for b in opt.grad_buffer.buckets)
        results.append((losses, grads))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_released_buffer_refuses_writes():
    from megacoat.optim.buffers import GradBuffer
    p = nn.Parameter(torch.randn(4, 4))
    buf = GradBuffer([p], release_between_steps=True)
    buf.zero()
    with pytest.raises(RuntimeError, match="released"):
        (p * 2).sum().backward()  # nothing allocated the bucket: a loud error, not a write into freed memory
    p.grad = None
    buf.allocate_for([p])
    (p * 2).sum().backward()
    buf.finalize()
    assert torch.equal(p.main_grad, torch.full_like(p, 2.0))


def test_grad_norm_overlap_matches_the_norm_after_backward():
    """The norm's per-bucket partial sums taken during the last backward equal the norm read afterwards."""
    tokens = torch.randint(0, 100, (4, 2, 17), generator=torch.Generator().manual_seed(6))
    norms = []
    for overlap in (True, False):
        model, opt = _tiny_gpt_with_optimizer(3000, clip_grad=0.5)
        assert opt.norm_overlap is not None
        if not overlap:
            opt.norm_overlap = None
        got = []
        for step in range(3):
            opt.zero_grad()
            for i, mb in enumerate(tokens[step:step + 2]):
                opt.start_micro_batch(is_last=i == 1)
                (model(mb[:, :-1], labels=mb[:, 1:]).mean() / 2).backward()
            if overlap:  # every bucket was complete in the last backward: its partial exists already
                assert len(opt.norm_overlap._partials) == len(opt.grad_buffer.buckets)
            got.append(opt.step(1e-2).grad_norm.item())
        norms.append(got)
    for a, b in zip(*norms):
        assert abs(a - b) <= 1e-6 * b, norms


def test_grad_norm_overlap_with_the_last_flag_given_twice_is_not_stale():
    """A caller that flags every micro-batch as the last must still get the true norm."""
    tokens = torch.randint(0, 100, (2, 2, 17), generator=torch.Generator().manual_seed(8))
    norms = []
    for overlap in (True, False):
        model, opt = _tiny_gpt_with_optimizer(3000, clip_grad=0.5)
        if not overlap:
            opt.norm_overlap = None
        opt.zero_grad()
        for mb in tokens:
            opt.start_micro_batch(is_last=True)
            (model(mb[:, :-1], labels=mb[:, 1:]).mean() / 2).backward()
        norms.append(opt.step(1e-2).grad_norm.item())
    assert abs(norms[0] - norms[1]) <= 1e-6 * norms[1], norms


def test_pre_backward_hook_keeps_stage_outputs_freeable():
    """The pipeline frees a sent activation by replacing its data: the hook must not make it a view."""
    model, opt = _tiny_gpt_with_optimizer(3000)
    tokens = torch.randint(0, 100, (2, 17))
    h = model.embed(tokens[:, :-1], torch.arange(16).unsqueeze(0).expand(2, 16))
    x = model.layers[0](h)
    x = model._before_backward(x, model.layers[0])
    assert x._base is None and x.grad_fn is not None


def test_grad_buffer_aligns_every_view_and_zeroes_the_gaps():
    """Each main_grad view starts a multiple of 16 elements into its bucket (a compiled graph would copy a view
    that is not 16-byte aligned, and the fused weight-gradient ops would write the copy); the gaps between views
    read zero after every (re-)allocation, whatever the memory held before."""
    from megacoat.optim.buffers import VIEW_ALIGN, GradBuffer
    params = [nn.Parameter(torch.randn(n)) for n in (5, 16, 3, 33)]
    buf = GradBuffer(params, release_between_steps=True)
    for _ in range(2):
        buf.allocate_for(params)
        bucket = buf.buckets[0]
        for p in params:
            assert (p.main_grad.data_ptr() - bucket.data_ptr()) % (VIEW_ALIGN * 4) == 0
            p.main_grad.fill_(7.0)
        assert float(bucket.sum()) == 7.0 * sum(p.numel() for p in params)
        covered = torch.zeros(bucket.numel(), dtype=torch.bool)
        for p in params:
            start = (p.main_grad.data_ptr() - bucket.data_ptr()) // 4
            covered[start:start + p.numel()] = True
        assert not covered.all() and torch.equal(bucket[~covered], torch.zeros(int((~covered).sum())))
        bucket.fill_(float("nan"))  # stale memory for the next allocation
        buf.release()


def test_bucket_norm_reads_whole_buckets_only_where_every_parameter_counts():
    """A bucket whose parameters all count is normed as its flat tensor (its zeroed gaps add nothing); a bucket with
    a parameter that does not count (a TP duplicate) is normed per counted parameter: both equal the float64 norm."""
    from megacoat.optim.buffers import GradBuffer
    from megacoat.optim.grad_norm_overlap import BucketNormOverlap
    gen = torch.Generator().manual_seed(11)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 16, 3, 33, 7, 21)]
    buf = GradBuffer(params, bucket_size=40)
    assert len(buf.buckets) >= 2
    for p in params:
        p.main_grad.copy_(torch.randn(p.numel(), generator=gen).view_as(p) * 3)
    skipped = buf.bucket_params[0][1]  # not counted on this rank
    counted = {id(p) for p in params if p is not skipped}
    overlap = BucketNormOverlap(buf.bucket_params, counted, torch.device("cpu"), buf.buckets)
    assert overlap.flats[0] is None and all(f is not None for f in overlap.flats[1:])
    overlap.set_last_micro_batch(True)
    for p in params:
        overlap.on_ready(p)
    assert len(overlap._partials) == len(buf.buckets)
    expect = sum(float(p.main_grad.double().square().sum()) for p in params if p is not skipped)
    got = float(overlap.total())
    assert abs(got - expect) <= 1e-5 * expect, (got, expect)
