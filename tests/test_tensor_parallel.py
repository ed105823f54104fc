"""TP=2/4 with and without sequence parallelism equal TP=1 (losses and gradients, fp32)."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from megacoat.parallel.context import ParallelContext
from parallel_harness import batches, build, full_grads, run_step, small_model_config, trim_vocab


def _tp_vs_single(rank, world, tp, sp, model_kw, steps, device_type="cpu"):
    m = small_model_config(**model_kw)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    ctx = ParallelContext.build(tp, 1, device)
    model, opt = build(m, ctx, sp)
    ref_model, ref_opt = build(m, ParallelContext.single(device), False)
    dp = ctx.dp_size
    n_micro, mbs = 2, 2
    for step in range(steps):
        # Global batch = dp * n_micro * mbs samples; each DP rank takes its contiguous block.
        glob = batches(step, dp * n_micro, mbs, m.seq_length)
        mine = glob[ctx.dp_rank * n_micro:(ctx.dp_rank + 1) * n_micro]
        loss = torch.tensor(run_step(model, opt, mine, n_micro))
        if dp > 1:
            dist.all_reduce(loss, group=ctx.dp_group)
            loss /= dp
        ref_loss = run_step(ref_model, ref_opt, glob, dp * n_micro)
        assert abs(loss.item() - ref_loss) <= 2e-5 * abs(ref_loss), (step, loss.item(), ref_loss)
        opt._sync_sequence_parallel_grads()
        [opt.comm.reduce_grads(b) for b in opt.grad_buffer.buckets]
        grads, ref = full_grads(model, ctx), full_grads(ref_model, ParallelContext.single(device))
        for name, g in ref.items():
            got, want = trim_vocab(name, grads[name]), trim_vocab(name, g)
            # Absolute slack scaled to the tensor: after an Adam step, gradients whose true value is
            # ~0 carry round-off of either sign, and Adam turns the sign into a full lr-sized update.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item() + 1e-9, msg=lambda s: f"{name} step {step}: {s}")
        # The step re-syncs: undo our manual sync so the optimizer sees raw grads again.
        opt.zero_grad()
        run_step(model, opt, mine, n_micro)
        opt.step(1e-2)
        ref_opt.step(1e-2)


def tp2_compiled_bf16_vs_tp1_eager(rank, world, sp, device_type="cpu", hidden=512, seq=256):
    """The production path (bf16, compiled layers, gradient-accumulation fusion into bucket views) at TP=2
    against TP=1 eager: every full gradient within bf16 round-off."""
    from megacoat.model.loss import masked_mean_loss

    device = torch.device(device_type, rank if device_type == "cuda" else None)
    m = small_model_config(hidden_size=hidden, num_attention_heads=8, seq_length=seq, num_layers=2)
    ctx = ParallelContext.build(2, 1, device)
    grads = []
    for model_ctx, compiled in ((ctx, True), (ParallelContext.single(device), False)):
        model, opt = build(m, model_ctx, sp and model_ctx.tp_size > 1, dtype=torch.bfloat16, compile_layers=compiled)
        b = {k: v.to(device) for k, v in batches(0, 1, 2, m.seq_length)[0].items()}
        for _ in range(2):  # the second step runs the compiled graphs already built (and a fresh bucket)
            opt.zero_grad()
            opt.start_micro_batch(is_last=True)
            masked_mean_loss(model(b["tokens"], b["position_ids"], labels=b["labels"]), b["loss_mask"]).backward()
            opt.grad_buffer.finalize()
        opt._sync_sequence_parallel_grads()
        grads.append(full_grads(model, model_ctx))
    for name, want in grads[1].items():
        got, want = trim_vocab(name, grads[0][name]).float(), trim_vocab(name, want).float()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 3e-2, (name, rel)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.slow
def test_tp2_compiled_bf16_gradients_equal_tp1(sp):
    """Compiled layers with their TP/SP collectives inside the graphs (functional collectives: the in-place
    ones lost the backward reduce-scatter under torch 2.11's compile on the H200)."""
    run_distributed(tp2_compiled_bf16_vs_tp1_eager, 2, sp, "cpu", 64, 32)


def compiled_tp2_sp_wgrad_phases(rank, world, device_type, coat):
    """Rank 0 of a fake TP=2 group (run_distributed's fake backend: collectives do nothing, so values are
    meaningless, but dynamo/AOTAutograd/inductor build the same graphs): the compiled TP=2 + SP layers run
    forward and backward, and every weight-gradient GEMM (gradient-accumulation fusion) must run in backward.
    Each such GEMM clears its weight's `main_grad_overwrite` flag, whichever op runs it (the Python ops, or on a
    GPU the extension's C++ op): all flags set after the forward, all clear after the backward. The Python ops'
    calls are also counted: each exactly once per weight and step, in backward (none where the C++ op runs)."""
    import megacoat.kernels.wgrad as wgrad
    import megacoat.precision.linear as fp8_linear
    from megacoat.model.loss import masked_mean_loss
    from megacoat.precision.recipe import Fp8Recipe

    device = torch.device(device_type)
    m = small_model_config(hidden_size=64, num_attention_heads=4, seq_length=32, num_layers=2)
    model, opt = build(m, ParallelContext.build(world, 1, device), True, dtype=torch.bfloat16, compile_layers=True,
                       fp8=Fp8Recipe() if coat else None)
    b = {k: v.to(device) for k, v in batches(0, 1, 2, m.seq_length)[0].items()}
    flags = {n: p.main_grad_overwrite for n, p in model.named_parameters()
             if "layers." in n and hasattr(p, "main_grad_overwrite")}
    assert len(flags) == 2 * 4, sorted(flags)  # 2 layers x 4 linears
    calls, phase = {"forward": 0, "backward": 0}, ["forward"]
    module, name = (fp8_linear, "_fp8_wgrad_impl") if coat else (wgrad, "_wgrad_accumulate_impl")
    impl = getattr(module, name)

    def counting(*args):
        calls[phase[0]] += 1
        return impl(*args)

    setattr(module, name, counting)
    for _ in range(2):  # the second step runs the graphs built by the first
        opt.zero_grad()
        opt.start_micro_batch(is_last=True)
        phase[0] = "forward"
        loss = masked_mean_loss(model(b["tokens"], b["position_ids"], labels=b["labels"]), b["loss_mask"])
        ran_in_forward = [n for n, f in flags.items() if not f.item()]
        assert not ran_in_forward, f"weight-gradient GEMMs ran in the forward: {ran_in_forward}"
        phase[0] = "backward"
        loss.backward()
        missing = [n for n, f in flags.items() if f.item()]
        assert not missing, f"weight-gradient GEMMs that did not run in the backward: {missing}"
        opt.grad_buffer.finalize()
    c_ops = coat and model.layers[0].mlp.fc1.linear_impl.lt_gemm  # the extension's C++ op ran them (GPU)
    assert calls == {"forward": 0, "backward": 0 if c_ops else 2 * 2 * 4}, calls  # 2 steps x 2 layers x 4 linears


@pytest.mark.parametrize("coat", [False, True])
@pytest.mark.slow
def test_compiled_tp2_sp_weight_gradients_run_in_backward(coat):
    """The symptom of the lost reduce-scatter on the H200: weight-gradient GEMMs of compiled TP=2 + SP layers
    ran in the forward (their output gradient no longer depended on the backward's input). coat: the FP8
    linear's own SP gather of FP8 codes and its backward reduce-scatter."""
    run_distributed(compiled_tp2_sp_wgrad_phases, 2, "cpu", coat, backend="fake")


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True)])
@pytest.mark.slow
def test_tp2_equals_tp1(tp, sp):
    run_distributed(_tp_vs_single, 2, tp, sp, {}, 3)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.slow
def test_tp4_equals_tp1(sp):
    run_distributed(_tp_vs_single, 4, 4, sp, dict(group_query_attention=True, num_query_groups=4), 2)


@pytest.mark.slow
def test_tp2_gqa_untied_gpt2_style():
    kw = dict(group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=True)
    run_distributed(_tp_vs_single, 2, 2, True, kw, 2)
    gpt2 = dict(normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute",
                add_bias_linear=True)
    run_distributed(_tp_vs_single, 2, 2, True, gpt2, 2)


@pytest.mark.slow
def test_dp2_equals_dp1():
    run_distributed(_tp_vs_single, 2, 1, False, {}, 3)


@pytest.mark.slow
def test_tp2_dp2():
    run_distributed(_tp_vs_single, 4, 2, True, {}, 2)


class DropoutMasks:
    """Records the dropout masks the model really uses, by wrapping torch's functions.

    Attention dropout happens inside SDPA, where the mask is not visible: before each real call the
    wrapper runs SDPA once more from the same RNG state on probe inputs (q = k = 0, v = identity) whose
    output is nonzero exactly where the mask keeps a weight, then restores the state, so the real call
    draws the same mask. `check` recomputes attention by hand with that mask and compares it with
    SDPA's real output, so the recorded masks are proven to be the ones used."""

    def __init__(self, monkeypatch):
        self.attention, self.hidden = [], []
        real_sdpa, real_dropout = F.scaled_dot_product_attention, F.dropout

        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            if dropout_p == 0.0:
                return real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
            s, d = q.shape[-2], q.shape[-1]
            assert d >= s, "the probe needs head_dim >= seq_length"
            state = torch.get_rng_state()
            probe_v = torch.zeros_like(v)
            probe_v[..., :s] = torch.eye(s)
            probe = real_sdpa(torch.zeros_like(q), torch.zeros_like(k), probe_v, attn_mask=attn_mask,
                              dropout_p=dropout_p, is_causal=is_causal, **kw)
            torch.set_rng_state(state)
            out = real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
            keep = probe[..., :s] != 0
            weights = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(
                ~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf")), dim=-1)
            manual = (weights * keep / (1 - dropout_p)) @ v
            torch.testing.assert_close(out, manual, rtol=1e-4, atol=1e-5)  # the recorded mask is the real one
            self.attention.append(keep.detach())
            return out

        def dropout(x, p=0.5, training=True, inplace=False):
            out = real_dropout(x, p, training, inplace)
            if training and p > 0:
                self.hidden.append((out == 0).detach())
            return out

        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        monkeypatch.setattr(F, "dropout", dropout)


def _gather(t, ctx):
    parts = [torch.empty_like(t) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.tp_group)
    return parts


def _dropout_streams(rank, world, sp):
    from parallel_harness import VOCAB
    monkeypatch = pytest.MonkeyPatch()
    masks = DropoutMasks(monkeypatch)
    m = small_model_config(attention_dropout=0.2, hidden_dropout=0.2)
    ctx = ParallelContext.build(2, 1, torch.device("cpu"))
    model, _ = build(m, ctx, sp)
    model.train()
    tokens = torch.randint(0, VOCAB, (2, m.seq_length + 1), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    monkeypatch.undo()
    # Replicated activations got the same hidden-dropout mask on both TP ranks (default stream,
    # or the model-parallel stream on disjoint sequence shards under SP): the losses agree.
    other = loss.clone()
    dist.broadcast(other, src=0, group=ctx.tp_group)
    assert torch.equal(loss, other)
    model.eval()
    assert not torch.equal(loss, model(tokens[:, :-1], labels=tokens[:, 1:]))  # dropout is on
    causal = torch.ones(m.seq_length, m.seq_length, dtype=torch.bool).tril()
    assert len(masks.attention) == m.num_layers
    for keep in masks.attention:  # [batch, local heads, s, s]: every mask drops about p of the weights
        dropped = 1 - keep[..., causal].float().mean().item()
        assert 0.1 < dropped < 0.3, dropped
        # Heads on different TP ranks draw from different model-parallel streams: different masks.
        theirs = _gather(keep.to(torch.uint8), ctx)
        assert not torch.equal(theirs[0], theirs[1])
    # Hidden dropout: the embedding and both residual dropouts of every layer.
    assert len(masks.hidden) == 1 + 2 * m.num_layers
    for drop in masks.hidden:
        assert 0.1 < drop.float().mean().item() < 0.3
        theirs = _gather(drop.to(torch.uint8), ctx)
        if sp:  # different sequence shards: the model-parallel stream, different masks
            assert not torch.equal(theirs[0], theirs[1])
        else:  # the same replicated activation: the default stream, the same mask on every TP rank
            assert torch.equal(theirs[0], theirs[1])


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.slow
def test_dropout_rng_streams_under_tp(sp):
    run_distributed(_dropout_streams, 2, sp)
