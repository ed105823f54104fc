"""A small GPT trained through the ZeRO optimizer with SDP4Bit's strategy (qWD and/or TLq-HS) tracks
the plain strategy; the ablations (direct weight quantization, 4 bits at both gradient levels) are
worse; TP=2 x DP=2 and PP=2 x DP=2 work (DP replicas bit-identical, losses close to plain)."""
import gc
import json

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megacoat.comm.base import CommStats
from megacoat.comm.sdp4bit import SDP4BitComm
from megacoat.config import CommConfig, OptimizerConfig, ParallelConfig
from megacoat.model.gpt import padded_vocab_size
from megacoat.model.stages import build_model_chunks
from megacoat.model.transformer import LayerContext
from megacoat.optim.distributed import DistributedOptimizer, ZeroOptions
from megacoat.parallel.context import ParallelContext
from megacoat.parallel.pipeline import PipelineSchedule
from megacoat.parallel.random import seed_everything
from megacoat.training.schedule import install_embedding_grad_sync, run_micro_batches
from parallel_harness import VOCAB, batches, small_model_config

QWD = dict(quantized_weights=True)
TLQ_HS = dict(quantized_gradients=True, hadamard_transform=True, gradient_alltoall_pipeline=2)
VARIANTS = {"plain": None, "qwd": QWD, "tlq_hs": TLQ_HS, "both": {**QWD, **TLQ_HS},
            "qwd_directly": dict(QWD, quantize_weights_directly=True),
            "int4_both_levels": dict(TLQ_HS, gradient_quantization_bits_intra=4)}
# COAT's FP8 optimizer states (E4M3 moments, groups of 128 with range expansion) under the same comm variants
FP8_STATES = dict(use_precision_aware_optimizer=True, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8")
VARIANTS.update({"plain_fp8_states": None, "both_fp8_states": {**QWD, **TLQ_HS}})
OPT_VARIANTS = {"plain_fp8_states": FP8_STATES, "both_fp8_states": FP8_STATES}


def _train(rank, world, tp, pp, rpn, names, steps, out_path):
    m = small_model_config(num_layers=2 * pp)
    ctx = ParallelContext.build(tp, pp, torch.device("cpu"), ranks_per_node=rpn)
    dp, n_micro, mbs = ctx.dp_size, 2, 2
    losses = {}
    for name in names:
        rng = seed_everything(11, ctx.tp_rank, ctx.device)
        lc = LayerContext(ctx.tp_group, False, rng, torch.float32, ctx.device, 11)
        model, chunks = build_model_chunks(m, ParallelConfig(pipeline_model_parallel_size=pp), lc, ctx, VOCAB,
                                           padded_vocab_size(VOCAB, m.make_vocab_size_divisible_by, tp))
        ocfg = OptimizerConfig(lr=3e-3, clip_grad=1.0, weight_decay=0.1, adam_eps=1e-5, **OPT_VARIANTS.get(name, {}))
        stats = CommStats()
        comm = SDP4BitComm(CommConfig(**VARIANTS[name]), ctx, stats, seed=3) if VARIANTS[name] else None
        opt = DistributedOptimizer(model, ocfg, ctx, ZeroOptions(bucket_size=20000, overlap_grad_reduce=True,
                                                                 overlap_param_gather=True), comm=comm)
        install_embedding_grad_sync(chunks, opt, ctx)
        sched = PipelineSchedule.from_context(ctx, len(chunks), (m.seq_length, mbs, m.hidden_size), torch.float32)
        curve = []
        for step in range(steps):
            glob = batches(step % 2, dp * n_micro, mbs, m.seq_length)  # two batches: the loss falls
            mine = glob[ctx.dp_rank * n_micro:(ctx.dp_rank + 1) * n_micro]
            opt.zero_grad()
            loss = run_micro_batches(sched, chunks, mine, n_micro, lambda b: b, optimizer=opt) / n_micro
            dist.all_reduce(loss, group=ctx.dp_group)
            curve.append(loss.item() / dp)
            res = opt.step(3e-3)
            assert bool(res.success)
            if comm is not None and dp > 1:
                kinds = {k for k, v in res.comm_bytes.items() if v}
                want = ({"param"} | ({"grad_intra", "grad_inter"} & {k for k in kinds if k.startswith("grad_")}))
                assert kinds <= {"grad", "param", "grad_intra", "grad_inter"} and "param" in kinds, kinds
                assert want <= kinds
        opt.finish_param_sync()
        # DP replicas hold bit-identical weights
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(dp)]
        dist.all_gather(everyone, flat, group=ctx.dp_group)
        assert all(torch.equal(e, flat) for e in everyone), name
        losses[name] = curve
    if ctx.is_last_rank:
        with open(out_path, "w") as f:
            json.dump(losses, f)
    # Drop every object holding process groups before the harness destroys them: a gloo group
    # destructed at interpreter exit can abort the process ("terminate called without an active exception").
    dist.barrier()
    del model, chunks, opt, comm, sched, ctx
    gc.collect()


def _gaps(path):
    with open(path) as f:
        losses = json.load(f)
    plain = losses["plain"]
    return losses, {k: max(abs(a - b) for a, b in zip(v, plain)) for k, v in losses.items()}


@pytest.mark.slow
def test_small_gpt_tracks_plain_2x2(tmp_path):
    """4 ranks as 2 nodes x 2: both SDP4Bit parts on track; the ablations clearly worse."""
    out = tmp_path / "losses.json"
    run_distributed(_train, 4, 1, 1, 2, [k for k in VARIANTS if k not in OPT_VARIANTS], 12, str(out))
    losses, gap = _gaps(out)
    print("loss gaps vs plain:", gap, "plain losses:", losses["plain"])
    # measured (CPU, 12 steps, plain loss 5.33 -> 4.12), max |loss - plain| over the steps: qwd 0.0005,
    # tlq_hs 0.019, both 0.019; ablations: int4 at both levels 0.033, qwd_directly 0.75 (with comm/codecs.py's
    # exact floor(x * inv + u) stochastic rounding)
    assert losses["plain"][-1] < losses["plain"][0] - 0.2, losses["plain"]
    for k in ("qwd", "tlq_hs", "both"):
        assert gap[k] < 0.03, gap
    assert gap["qwd_directly"] > 3 * gap["qwd"] and gap["qwd_directly"] > 0.05, gap
    assert gap["int4_both_levels"] > gap["tlq_hs"], gap


@pytest.mark.slow
def test_tp2_dp2_and_pp2_dp2(tmp_path):
    for tp, pp in ((2, 1), (1, 2)):
        out = tmp_path / f"tp{tp}pp{pp}.json"
        run_distributed(_train, 4, tp, pp, 2, ["plain", "both"], 6, str(out))
        _, gap = _gaps(out)
        print(f"tp{tp} pp{pp} gaps:", gap)
        assert gap["both"] < 0.03, (tp, pp, gap)  # measured: TP2xDP2 0.012, PP2xDP2 0.002


@pytest.mark.slow
def test_sdp4bit_with_fp8_optimizer_states_2x2(tmp_path):
    """qWD + TLq-HS over ZeRO shards whose Adam moments are FP8 (groups of 128 never straddle a shard):
    DP replicas stay bit-identical (checked in _train) and the run tracks the same optimizer without SDP4Bit."""
    out = tmp_path / "fp8_states.json"
    run_distributed(_train, 4, 1, 1, 2, ["plain", "plain_fp8_states", "both_fp8_states"], 12, str(out))
    losses, gap = _gaps(out)
    print("fp8-state gaps vs plain:", gap)
    assert losses["both_fp8_states"][-1] < losses["both_fp8_states"][0] - 0.2, losses["both_fp8_states"]
    diff = max(abs(a - b) for a, b in zip(losses["both_fp8_states"], losses["plain_fp8_states"]))
    # measured (CPU, 12 steps): plain_fp8_states 0.0001 from plain, both_fp8_states 0.0199 from plain
    assert diff < 0.03 and gap["plain_fp8_states"] < 0.03, (diff, gap)
