"""Pipeline parallelism: schedule tables, PP (1F1B, interleaved, uneven) x TP/SP x DP/ZeRO equal the
single-process model (losses, gradients, weights), tied embeddings, 1F1B memory, bad flags, CLI."""
import json

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megacoat.config import (ConfigError, MegacoatConfig, OptimizerConfig, ParallelConfig, validate_config)
from megacoat.model.stages import build_model_chunks, stage_layers
from megacoat.model.transformer import LayerContext
from megacoat.model.gpt import padded_vocab_size
from megacoat.optim.distributed import DistributedOptimizer, ZeroOptions
from megacoat.optim.optimizer import MixedPrecisionAdamW
from megacoat.parallel.context import ParallelContext
from megacoat.parallel.pipeline import PipelineSchedule, build_schedule, check_tables
from megacoat.parallel.random import seed_everything
from megacoat.training.schedule import install_embedding_grad_sync, run_micro_batches
from parallel_harness import VOCAB, batches, build, full_grads, full_weights, run_step, small_model_config, trim_vocab


# ------------------------------------------------------------------------------ tables (no processes)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_schedule_tables_consistent_and_deadlock_free(pp):
    for vp in (1, 2, 3):
        if vp > 1 and pp == 1:
            continue
        for m in range(1, 17):
            if vp > 1 and m % pp:
                continue
            for forward_only in (False, True):
                tables = [build_schedule(pp, r, vp, m, forward_only) for r in range(pp)]
                check_tables(tables, m, vp, forward_only)


def _live_counts(table):
    live, peak = set(), 0
    for a in table:
        if a.kind == "F":
            live.add((a.mb, a.chunk))
            peak = max(peak, len(live))
        elif a.kind == "B":
            live.discard((a.mb, a.chunk))
    return peak


def test_1f1b_table_memory_and_shape():
    pp, m = 4, 8
    for r in range(pp):
        t = build_schedule(pp, r, 1, m)
        computes = [a for a in t if a.kind != "C"]
        warmup = pp - r - 1
        assert all(a.kind == "F" for a in computes[:warmup + 1])
        # steady state alternates forward / backward, then the cooldown backwards
        steady = computes[warmup:warmup + 2 * (m - warmup)]
        assert [a.kind for a in steady] == ["F", "B"] * (m - warmup)
        assert _live_counts(t) == pp - r
    assert [repr(a) for a in build_schedule(1, 0, 1, 3)] == ["F0.0", "B0.0", "F1.0", "B1.0", "F2.0", "B2.0"]


def test_stage_layer_split():
    assert stage_layers(8, 2) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert stage_layers(8, 2, vp_layers=2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert stage_layers(7, 3, first=1) == [[[0]], [[1, 2, 3]], [[4, 5, 6]]]
    assert stage_layers(6, 3, first=1, last=3) == [[[0]], [[1, 2]], [[3, 4, 5]]]


# ------------------------------------------------------------------------------ bad flags
def _cfg(layers=4, pp=2, world=2, gbs=8, mbs=2, **par):
    cfg = MegacoatConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = layers, 64, 4
    cfg.train.global_batch_size, cfg.train.micro_batch_size = gbs, mbs
    cfg.parallel.pipeline_model_parallel_size = pp
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg, world


@pytest.mark.parametrize("kw,expect", [
    (dict(layers=5), "--num-layers 5 is not divisible by --pipeline-model-parallel-size 2"),
    (dict(layers=6, pp=2, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=3),
     "= 5 layers, but --num-layers is 6"),
    (dict(layers=6, pp=4, world=4, decoder_first_pipeline_num_layers=1),
     "leave 5 of --num-layers 6 for the other 3 pipeline stage(s)"),
    (dict(layers=6, pp=3, world=3, decoder_first_pipeline_num_layers=0), "must be >= 1"),
    (dict(layers=8, num_layers_per_virtual_pipeline_stage=3),
     "--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x --num-layers-per-virtual-pipeline-stage 3"),
    (dict(layers=8, gbs=6, num_layers_per_virtual_pipeline_stage=2), "to be a multiple of --pipeline-model-parallel-size 2"),
    (dict(layers=8, num_layers_per_virtual_pipeline_stage=2, decoder_first_pipeline_num_layers=2), "cannot be combined"),
    (dict(pp=1, world=1, decoder_last_pipeline_num_layers=2), "need --pipeline-model-parallel-size > 1"),
])
def test_bad_pipeline_flags(kw, expect):
    cfg, world = _cfg(**kw)
    with pytest.raises(ConfigError, match=None) as e:
        validate_config(cfg, world)
    assert expect in str(e.value), str(e.value)


def test_good_pipeline_flags():
    for kw in (dict(layers=8, num_layers_per_virtual_pipeline_stage=2),
               dict(layers=7, pp=3, world=6, gbs=8, decoder_first_pipeline_num_layers=1),
               dict(layers=5, decoder_last_pipeline_num_layers=2)):
        validate_config(*_cfg(**kw))


# ------------------------------------------------------------------------------ equivalence
def _build_pp(m, ctx, sp, pcfg, zero=None, seed=11, lr=1e-2):
    rng = seed_everything(seed, ctx.tp_rank, ctx.device)
    lc = LayerContext(ctx.tp_group, sp, rng, torch.float32, ctx.device, seed)
    model, chunks = build_model_chunks(m, pcfg, lc, ctx, VOCAB,
                                       padded_vocab_size(VOCAB, m.make_vocab_size_divisible_by, ctx.tp_size))
    ocfg = OptimizerConfig(lr=lr, clip_grad=1.0, weight_decay=0.1, adam_eps=1e-5)
    opt = DistributedOptimizer(model, ocfg, ctx, zero) if zero is not None else MixedPrecisionAdamW(model, ocfg, ctx)
    install_embedding_grad_sync(chunks, opt, ctx)
    seq = m.seq_length // (ctx.tp_size if sp else 1)
    return model, chunks, opt, seq


def _pp_vs_single(rank, world, tp, pp, pkw, model_kw, sp, zero_kw, steps, n_micro, check_grads, device_type="cpu",
                  inf_step=None):
    m = small_model_config(**model_kw)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    ctx = ParallelContext.build(tp, pp, device)
    to_dev = lambda b: {k: v.to(device) for k, v in b.items()}  # noqa: E731
    pcfg = ParallelConfig(pipeline_model_parallel_size=pp, **pkw)
    zero = ZeroOptions(**zero_kw) if zero_kw is not None else None
    model, chunks, opt, seq = _build_pp(m, ctx, sp, pcfg, zero)
    mbs = 2
    sched = PipelineSchedule.from_context(ctx, len(chunks), (seq, mbs, m.hidden_size), torch.float32)
    ref_model, ref_opt = build(m, ParallelContext.single(device), False)
    dp = ctx.dp_size
    last = ctx.is_pipeline_last_stage

    def fwd_bwd(mine, n_micro):
        opt.zero_grad()
        return run_micro_batches(sched, chunks, mine, n_micro, to_dev, optimizer=opt) / n_micro

    micro_counts = n_micro if isinstance(n_micro, (list, tuple)) else [n_micro]
    for step in range(steps):
        n_micro = micro_counts[step % len(micro_counts)]
        glob = batches(step, dp * n_micro, mbs, m.seq_length)
        mine = glob[ctx.dp_rank * n_micro:(ctx.dp_rank + 1) * n_micro]
        loss = fwd_bwd(mine, n_micro)
        ref_loss = run_step(ref_model, ref_opt, glob, dp * n_micro)
        if dp > 1:
            dist.all_reduce(loss, group=ctx.dp_group)
            loss /= dp
        if last:
            assert abs(loss.item() - ref_loss) <= 2e-5 * abs(ref_loss), (step, loss.item(), ref_loss)
        else:
            assert loss.item() == 0.0
        vp, r = len(chunks), ctx.pp_rank
        # every activation sent was freed at once (only the graph stays for the backward)
        assert sched.stats.freed == n_micro * sum(not sched.is_last_stage(c) for c in range(vp))
        if vp == 1:  # 1F1B: stage r holds at most pp - r micro-batches' activations
            assert sched.stats.max_live == min(pp - r, n_micro), sched.stats.max_live
        else:  # interleaved: the warmup forwards plus one (all of them when m == pp)
            warmup = vp * n_micro if n_micro == pp else 2 * (pp - r - 1) + (vp - 1) * pp
            assert sched.stats.max_live <= min(warmup + 1, vp * n_micro), sched.stats.max_live
        if check_grads:
            # Probe: sum the tied embedding over the stages (as step() will), compare every gradient
            # with the single-process model's, then redo the pass for the real step.
            opt._run_pre_sync()
            opt._sync_sequence_parallel_grads()
            got, want = full_grads(model, ctx), full_grads(ref_model, ParallelContext.single(device))
            assert got.keys() <= want.keys()
            for name, g in got.items():
                w = trim_vocab(name, want[name])
                torch.testing.assert_close(trim_vocab(name, g), w, rtol=1e-4, atol=1e-4 * w.abs().max().item() + 1e-9,
                                           msg=lambda s: f"{name} step {step}: {s}")
            fwd_bwd(mine, n_micro)
        if step == inf_step:  # a non-finite gradient on the first stage only: every stage skips the step
            if ctx.pp_rank == 0:
                next(model.parameters()).main_grad.view(-1)[0] = float("inf")
            assert not bool(opt.step(1e-2).success)
            continue
        assert bool(opt.step(1e-2).success) and bool(ref_opt.step(1e-2).success)
    if zero is not None:
        opt.finish_param_sync()
    got, want = full_weights(model, ctx), full_weights(ref_model, ParallelContext.single(device))
    for name, w in got.items():
        torch.testing.assert_close(w, want[name], rtol=1e-5, atol=1e-5, msg=lambda s: f"{name}: {s}")
    # Tied embeddings: the first and the last stage hold bit-identical copies.
    tied = [p for c in chunks if c.embedding is not None for p in [c.embedding.weight]]
    if pp > 1 and not m.untie_embeddings_and_output_weights and ctx.embedding_group is not None:
        mine_w = tied[0].detach().clone()
        both = [torch.empty_like(mine_w) for _ in range(2)]
        dist.all_gather(both, mine_w, group=ctx.embedding_group)
        assert torch.equal(both[0], both[1])
    # Forward-only evaluation through the pipeline equals the reference model's loss.
    ev = batches(100, dp * n_micro, mbs, m.seq_length)
    model.eval()
    with torch.no_grad():
        total = run_micro_batches(sched, chunks, ev[ctx.dp_rank * n_micro:(ctx.dp_rank + 1) * n_micro], n_micro,
                                  to_dev, forward_only=True) / n_micro
        ref_total = sum(run_eval(ref_model, to_dev(b)) for b in ev) / (dp * n_micro)
    if dp > 1:
        dist.all_reduce(total, group=ctx.dp_group)
        total /= dp
    if last:
        assert abs(total.item() - ref_total) <= 2e-5 * abs(ref_total), (total.item(), ref_total)


def run_eval(model, b):
    from megacoat.model.loss import masked_mean_loss
    model.eval()
    return masked_mean_loss(model(b["tokens"], b["position_ids"], labels=b["labels"]), b["loss_mask"]).item()


@pytest.mark.slow
def test_pp2_1f1b_equals_single():
    """... with an Inf injected on the first stage at step 1: both stages skip it (global norm)."""
    run_distributed(_pp_vs_single, 2, 1, 2, {}, {}, False, None, 3, 4, True, "cpu", 1)


@pytest.mark.slow
def test_pp4_1f1b_equals_single():
    """More micro-batches than stages, then fewer (the warmup is cut to m)."""
    run_distributed(_pp_vs_single, 4, 1, 4, {}, dict(num_layers=4), False, None, 2, [6, 2], True)


def test_pp2_interleaved_equals_single():
    run_distributed(_pp_vs_single, 2, 1, 2, dict(num_layers_per_virtual_pipeline_stage=1), dict(num_layers=4),
                    False, None, 3, 4, True)


def test_pp2_uneven_untied_gpt2_style():
    gpt2 = dict(num_layers=4, normalization="LayerNorm", activation="gelu",
                position_embedding_type="learned_absolute", add_bias_linear=True,
                untie_embeddings_and_output_weights=True)
    run_distributed(_pp_vs_single, 2, 1, 2, dict(decoder_first_pipeline_num_layers=1), gpt2, False, None, 2, 3, True)


@pytest.mark.slow
def test_pp2_tp2_sp_equals_single():
    run_distributed(_pp_vs_single, 4, 2, 2, {}, {}, True, None, 2, 2, True)


@pytest.mark.slow
def test_pp2_dp2_zero_overlap_interleaved_equals_single():
    """ZeRO with overlapped grad reduce and param gather, interleaved chunks: the tied embedding's
    bucket waits for the embedding-group sum; other buckets launch after each chunk's last backward."""
    zero = dict(bucket_size=3000, overlap_grad_reduce=True, overlap_param_gather=True)
    run_distributed(_pp_vs_single, 4, 1, 2, dict(num_layers_per_virtual_pipeline_stage=1), dict(num_layers=4),
                    False, zero, 3, 2, False)


# ------------------------------------------------------------------------------ command line
@pytest.mark.slow
def test_cli_pp2_interleaved_zero_equals_single_and_checkpoint_reshards(tmp_path):
    """torchrun PP=2 (interleaved, ZeRO with overlap) = one process: losses, validation loss; its
    checkpoint (tied embedding stored once) resumes in one process exactly where the single run is."""
    from test_cli import TINY, run_cli

    common = TINY + ["--num-layers", "4", "--train-iters", "4", "--global-batch-size", "4", "--fp32",
                     "--eval-interval", "3", "--eval-iters", "1"]
    ckpt = str(tmp_path / "ckpt")
    runs = {}
    for name, nproc, extra in (
            ("single", 1, []),
            ("pp2", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                        "--log-pipeline-bubble", "--exit-interval", "3", "--save", ckpt]),
            ("resumed", 1, ["--load", ckpt])):
        path = tmp_path / f"{name}.jsonl"
        r = run_cli(common + extra + ["--log-json", str(path)], nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = [json.loads(line) for line in open(path)]
    loss = {k: [r["lm_loss"] for r in v if "lm_loss" in r] for k, v in runs.items()}
    valid = {k: [r["valid_loss"] for r in v if "valid_loss" in r] for k, v in runs.items()}
    assert len(loss["single"]) == 4 and len(loss["pp2"]) == 3 and len(loss["resumed"]) == 1
    assert valid["pp2"] and valid["single"]
    pairs = list(zip(loss["single"], loss["pp2"] + loss["resumed"])) + [(valid["single"][0], valid["pp2"][0])]
    for a, b in pairs:
        assert abs(a - b) <= 1e-5 * abs(a), (loss, valid)
    bubble = [r["pipeline_bubble"] for r in runs["pp2"] if "pipeline_bubble" in r]
    assert bubble and bubble[-1]["pp"] == 2 and bubble[-1]["vp"] == 2 and len(bubble[-1]["measured"]) == 2


# ------------------------------------------------------------------------------ NCCL (GPU machine)
@pytest.mark.gpu
def test_nccl_pp2_1f1b_and_interleaved_equal_single():
    run_distributed(_pp_vs_single, 2, 1, 2, {}, {}, False, None, 2, 4, True, "cuda", backend="nccl")
    run_distributed(_pp_vs_single, 2, 1, 2, dict(num_layers_per_virtual_pipeline_stage=1), dict(num_layers=4),
                    False, None, 2, 2, True, "cuda", backend="nccl")
