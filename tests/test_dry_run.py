"""--dry-run: its byte counts equal the counters of real CPU runs with the same flags, its
model-state sizes equal what real ranks allocate, and configuration errors surface in it."""
import dataclasses
import json
import os

import pytest
import torch

from megacoat.config import ConfigError, parse_args
from megacoat.training.planner import (_grad_bytes, _master_bytes, _state_bytes, _weight_bytes,
                                       activation_bytes_per_token_layer, format_plan, peak_estimate, plan_run)
from dist_utils import run_distributed
from test_cli import TINY, run_cli

BASE = TINY + ["--fp32", "--num-workers", "0", "--train-iters", "2", "--global-batch-size", "8"]


def _plan_for_rank(plans, rank):
    (pl,) = [p for p in plans if p.ranks == [rank]]
    return pl


def _last_record(path):
    return [json.loads(x) for x in open(path) if "lm_loss" in x][-1]


@pytest.mark.parametrize("extra,world,option", [
    ([], 2, "all-reduce (no ZeRO)"),
    (["--hidden-size", "72"], 2, "all-reduce (no ZeRO)"),  # norm weights of 72: gaps between the buckets' views
    (["--use-distributed-optimizer", "--ddp-bucket-size", "20000"], 2, "plain"),
    (["--use-distributed-optimizer", "--ddp-bucket-size", "20000", "--ranks-per-node", "2", "--quantized-weights",
      "--quantized-gradients", "--hadamard-transform"], 4, "qWD+TLq-HS"),
])
@pytest.mark.slow
def test_dry_run_bytes_equal_a_real_runs_counters(tmp_path, extra, world, option):
    log = tmp_path / "log.jsonl"
    r = run_cli(BASE + extra + ["--log-json", str(log)], nproc=world)
    assert r.returncode == 0, r.stderr[-3000:]
    real = {k: v for k, v in _last_record(log)["comm_bytes_per_iter"].items() if v}
    cfg = parse_args(BASE + extra)
    plans = plan_run(cfg, world, 301, torch.device("cpu"))
    planned = {k: v for k, v in _plan_for_rank(plans, world - 1).comm[option].items() if v}  # the logging rank
    assert planned == real and real, (planned, real)


def _allocated(rank, world, flags, out_dir):
    """In a real DP rank: build the trainer per optimizer-state format, record what it allocated."""
    from megacoat.training.trainer import Trainer
    res = {}
    for fmt in ("fp32", "bf16", "fp8"):
        extra = [] if fmt == "fp32" else ["--use-precision-aware-optimizer", "--exp-avg-dtype", fmt,
                                          "--exp-avg-sq-dtype", fmt]
        tr = Trainer(parse_args(flags + extra))
        opt = tr.optimizer
        storage = lambda t: t.untyped_storage().nbytes()  # noqa: E731 - what is really allocated
        if hasattr(opt, "buffer"):
            assert storage(opt.buffer.param_data) == _weight_bytes(opt)
            assert storage(opt.buffer.grad_data) == _grad_bytes(opt)
        if getattr(opt, "master_flat", None) is not None:
            assert storage(opt.master_flat) == _master_bytes(opt)
        res[fmt] = dict(weights=_weight_bytes(opt), grads=_grad_bytes(opt), master=_master_bytes(opt),
                        states=_state_bytes(opt), params=sum(p.numel() for p in opt.params))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


@pytest.mark.parametrize("extra,world", [
    (["--use-distributed-optimizer", "--ddp-bucket-size", "20000", "--bf16"], 2),
    (["--tensor-model-parallel-size", "2", "--bf16"], 2),
])
@pytest.mark.slow
def test_dry_run_state_sizes_equal_real_allocations(tmp_path, extra, world):
    flags = [f for f in BASE if f != "--fp32"] + extra
    run_distributed(_allocated, world, flags, str(tmp_path))
    plans = plan_run(parse_args(flags), world, 301, torch.device("cpu"))
    for rank in range(world):
        real = json.load(open(tmp_path / f"rank{rank}.json"))
        pl = _plan_for_rank(plans, rank)
        for fmt, r in real.items():
            assert (pl.params, pl.weights, pl.grads, pl.master[fmt], pl.states[fmt]) == \
                (r["params"], r["weights"], r["grads"], r["master"], r["states"]), (rank, fmt)


@pytest.mark.parametrize("cache", ["auto", "none"])
def test_dry_run_counts_the_kept_fp8_weight_copies_a_real_run_allocates(cache):
    from megacoat.precision.linear import _fp8_caches
    from megacoat.training.trainer import Trainer
    flags = [f for f in BASE if f != "--fp32"] + ["--bf16", "--fp8-format", "hybrid", "--fp8-weight-cache", cache]
    (pl,) = plan_run(parse_args(flags), 1, 301, torch.device("cpu"))
    tr = Trainer(parse_args(flags))
    try:
        tr.train_step(tr._next_micro_batches(tr.data_iterators().train))
        real = sum(c.wq.numel() + c.wqt.numel() + 4 * c.scale.numel() for _, c in _fp8_caches(tr.model)
                   if c.wq is not None)
    finally:
        tr.close()
    assert pl.fp8_weight_copies == real and (real > 0) == (cache == "auto")


def test_configuration_errors_surface_in_the_dry_run():
    with pytest.raises(ConfigError, match="not divisible by --tensor-model-parallel-size 4"):
        plan_run(parse_args(BASE + ["--tensor-model-parallel-size", "4"]), 6, 301)
    with pytest.raises(ConfigError, match="--quantized-gradients needs --use-distributed-optimizer"):
        plan_run(parse_args(BASE + ["--quantized-gradients"]), 2, 301)
    with pytest.raises(ConfigError, match="spread unevenly over nodes"):
        plan_run(parse_args(BASE + ["--use-distributed-optimizer", "--quantized-gradients", "--ranks-per-node", "3"]),
                 4, 301)
    # plain ZeRO over nodes that split the DP group unevenly plans (only SDP4Bit needs node-level groups)
    assert plan_run(parse_args(BASE + ["--use-distributed-optimizer", "--ranks-per-node", "3"]), 4, 301)


@pytest.mark.slow
def test_dry_run_from_the_command_line_plans_a_7b_layout():
    r = run_cli(["--dry-run", "--world-size", "32", "--ranks-per-node", "8", "--num-layers", "32", "--hidden-size",
                 "4096", "--ffn-hidden-size", "11008", "--num-attention-heads", "32", "--seq-length", "4096",
                 "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer", "--bf16",
                 "--mock-data", "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "64"],
                timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "world 32 = TP 2 x PP 1 x DP 16" in out
    assert "3,303,804,928 parameters" in out  # 6.74B model / TP 2 (+ padded vocabulary)
    assert "weights 6.16 GiB" in out and "fp8 430.87 MiB + 787.88 MiB" in out  # bf16 weights; COAT states of a 1/16 shard


def test_activation_estimate_orders_recipes_and_splits_over_tp():
    h, f = 4096, 11008
    bf16, tw, coat = (activation_bytes_per_token_layer(h, f, h, r, 1, False) for r in ("bf16", "tensorwise", "coat"))
    assert coat < tw < bf16
    # By hand, bf16: 2 bytes x (4h norm in/out + 3h qkv + h attn out + 3f gate/up/product).
    assert bf16 == 2 * (4 * h + 3 * h + h + 3 * f)
    assert activation_bytes_per_token_layer(h, f, h, "bf16", 2, True) == bf16 / 2


def test_activation_estimate_with_full_recomputation():
    flags = BASE + ["--num-layers", "4", "--use-distributed-optimizer"]
    (plain,) = plan_run(parse_args(flags), 1, 301, torch.device("cpu"))
    (full,) = plan_run(parse_args(flags + ["--recompute-granularity", "full", "--recompute-num-layers", "2"]), 1, 301,
                       torch.device("cpu"))
    tokens, h = 2 * 32, 64
    per_layer = plain.activations["bf16"] / (4 * tokens)
    # two groups of two layers: their two inputs (2 bytes x h per token) + one group live in backward
    assert full.activations["bf16"] == int(tokens * (2 * 2 * h + 2 * per_layer))
    # coat: the second group's input is the previous layer's deferred stream and MLP output (two bf16 tensors)
    per_layer_coat = plain.activations["coat"] / (4 * tokens)
    assert full.activations["coat"] == int(tokens * ((1 + 2) * 2 * h + 2 * per_layer_coat))


@pytest.mark.slow
def test_dry_run_under_a_launcher_prints_one_plan():
    r = run_cli(BASE + ["--dry-run", "--world-size", "4", "--use-distributed-optimizer"], nproc=2, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("dry run: world 4 = TP 1 x PP 1 x DP 4") == 1


def test_dry_run_counts_the_loss_on_the_last_stage():
    """The logits saved for the loss's backward and their gradient (and, unfused, the fp32 working copy),
    on the last pipeline stage only; 301 tokens padded to 304 by --make-vocab-size-divisible-by 8."""
    tokens = 2 * 32
    (cpu,) = plan_run(parse_args(BASE), 1, 301, torch.device("cpu"))
    assert cpu.loss == tokens * 304 * (2 * 4 + 4)      # fp32 logits, references: + the fp32 copy
    gpu_flags = TINY + ["--num-workers", "0", "--train-iters", "2", "--global-batch-size", "8"]
    (gpu,) = plan_run(parse_args(gpu_flags), 1, 301, torch.device("cuda"))
    assert gpu.loss == tokens * 304 * (2 * 2)          # bf16 logits and gradient, fused kernels
    (eager,) = plan_run(parse_args(gpu_flags + ["--no-cross-entropy-loss-fusion"]), 1, 301, torch.device("cuda"))
    assert eager.loss == tokens * 304 * (2 * 2 + 4)
    stages = plan_run(parse_args(BASE + ["--pipeline-model-parallel-size", "2"]), 2, 301, torch.device("cpu"))
    assert sorted((p.pp_rank, p.loss > 0) for p in stages) == [(0, False), (1, True)]
    text = format_plan(parse_args(BASE), 1, [cpu])
    assert "loss (logits and their gradient)" in text


def test_peak_estimate_takes_the_larger_phase_only_when_gradients_come_and_go():
    """One micro-batch per step, non-sharded optimizer: gradient buckets are allocated while the backward frees
    the activations, so the peak is the larger phase; with accumulation (buckets live from the first
    micro-batch's backward through the next forwards) or ZeRO (buffers persist) it is the sum."""
    one = BASE[:-1] + ["2"]  # --global-batch-size 2 = one micro-batch of 2
    (pl,) = plan_run(parse_args(one), 1, 301, torch.device("cpu"))
    assert pl.grads_released and pl.micro_batches == 1 and pl.in_flight == 1 and len(pl.buckets) == 1
    base = pl.weights + pl.master["fp32"] + pl.states["fp32"]
    acts = pl.activations["bf16"] + pl.loss
    assert peak_estimate(pl, "fp32", "bf16") == base + max(acts + pl.grads, pl.grads)  # one bucket: all grads
    assert 0 < pl.backward_activations["bf16"] < pl.activations["bf16"]  # one layer's of two
    several = dataclasses.replace(pl, buckets=[3, 1], grads=4000, backward_activations={"bf16": 7})
    assert peak_estimate(several, "fp32", "bf16") == base + max(acts + 3000, 4000 + 7)
    small_acts = dataclasses.replace(several, activations={"bf16": 10}, loss=0)
    assert peak_estimate(small_acts, "fp32", "bf16") == base + 4000 + 7  # the backward's phase is larger
    (accum,) = plan_run(parse_args(BASE), 1, 301, torch.device("cpu"))
    assert accum.micro_batches == 4
    assert peak_estimate(accum, "fp32", "bf16") == base + accum.grads + accum.activations["bf16"] + accum.loss
    zero = plan_run(parse_args(one[:-1] + ["4", "--use-distributed-optimizer"]), 2, 301, torch.device("cpu"))
    assert not any(z.grads_released for z in zero)
    assert "one micro-batch: the larger of the forward's end and the backward's" in format_plan(
        parse_args(one), 1, [pl])


def test_live_plan_of_a_trainer_equals_the_dry_runs_plan():
    """The trainer's own plan (what --fp8-weight-cache auto decides from) gives the dry run's peak."""
    from megacoat.training.planner import LIVE, live_plan
    from megacoat.training.trainer import Trainer
    flags = [f for f in BASE if f != "--fp32"] + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "coat",
                                                  "--global-batch-size", "2", "--micro-batch-size", "2"]
    (pl,) = plan_run(parse_args(flags), 1, 301, torch.device("cpu"))
    tr = Trainer(parse_args(flags))
    try:
        live = live_plan(tr.cfg, tr.ctx, tr.model, tr.chunks, tr.optimizer, tr.padded_vocab, tr.recipe.params_dtype,
                         tr.device)
    finally:
        tr.close()
    assert live.fp8_weight_copies == pl.fp8_weight_copies > 0
    assert live.grads_released == pl.grads_released and live.micro_batches == pl.micro_batches == 1
    for recipe in ("bf16", "coat"):
        assert peak_estimate(live, LIVE, recipe) == peak_estimate(pl, "fp32", recipe) > 0


def test_auto_fp8_weight_cache_drops_the_copies_when_the_peak_would_not_fit(monkeypatch):
    """--fp8-weight-cache auto on a GPU keeps the copies while the estimated peak fits 95% of the memory the process
    can have, else every linear casts per use (as `none`) before the first forward. Run here on the CPU with the
    GPU's memory query replaced: the decision itself, then training on the path it chose."""
    import megacoat.training.trainer as trainer_module
    from megacoat.training.planner import AUTO_FP8_COPIES_SHARE, LIVE, live_plan
    from megacoat.training.trainer import Trainer
    flags = [f for f in BASE if f != "--fp32"] + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "coat",
                                                  "--global-batch-size", "2", "--micro-batch-size", "2"]
    reported = []  # the cross-rank report (its collective would allocate on the posed GPU): test_weight_cache_report_*
    monkeypatch.setattr(trainer_module, "report_fp8_copies_dropped", lambda note, device, log: reported.append(note))
    tr = Trainer(parse_args(flags))
    try:
        assert tr.recipe.fp8.cache_weights and tr._fit_fp8_weight_copies() is None and reported == []  # CPU: none
        plan = live_plan(tr.cfg, tr.ctx, tr.model, tr.chunks, tr.optimizer, tr.padded_vocab, tr.recipe.params_dtype,
                         torch.device("cuda"))  # as the trainer plans on a GPU (the fused loss's bytes)
        peak, copies = peak_estimate(plan, LIVE, "coat"), plan.fp8_weight_copies
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        cpu = tr.device
        tr.device = torch.device("cuda")
        roomy = int(peak / AUTO_FP8_COPIES_SHARE) + 1
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (roomy, roomy))
        assert tr._fit_fp8_weight_copies() is None and tr.recipe.fp8.cache_weights and reported == [None]
        tight = int(peak / AUTO_FP8_COPIES_SHARE) - 1
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (tight, tight))
        note = tr._fit_fp8_weight_copies()
        tr.device = cpu
        assert note and "FP8 weight copies not kept" in note and f"{copies / 2**30:.2f} GiB" in note
        assert reported == [None, note]
        assert not tr.recipe.fp8.cache_weights and all(getattr(c, "_fp8_refreshers", None) is None for c in tr.chunks)
        from megacoat.precision.linear import _fp8_caches, fp8_weight_copy_bytes
        assert fp8_weight_copy_bytes(tr.model) == 0
        losses = [tr.train_step(tr._next_micro_batches(tr.data_iterators().train)).loss for _ in range(2)]
        assert all(c.wq is None for _, c in _fp8_caches(tr.model))  # cast per use: nothing kept
    finally:
        tr.close()
    ref = Trainer(parse_args(flags + ["--fp8-weight-cache", "none"]))
    try:
        expect = [ref.train_step(ref._next_micro_batches(ref.data_iterators().train)).loss for _ in range(2)]
    finally:
        ref.close()
    assert [float(x) for x in losses] == [float(x) for x in expect]


def test_dry_run_says_when_auto_would_drop_the_fp8_weight_copies():
    """The dry run names the GPU memory below which auto drops the copies: the peak over the kept share."""
    from megacoat.training.planner import AUTO_FP8_COPIES_SHARE, _gib, fp8_copies_fit
    flags = [f for f in BASE if f != "--fp32"] + ["--bf16", "--fp8-format", "hybrid"]
    cfg = parse_args(flags)
    (pl,) = plan_run(cfg, 1, 301, torch.device("cpu"))
    text = format_plan(cfg, 1, [pl])
    peak = peak_estimate(pl, "fp32", "coat")
    assert f"{_gib(peak)}; --fp8-weight-cache auto drops the kept FP8 weight copies ({_gib(pl.fp8_weight_copies)}) " \
           f"where the run can use less than {_gib(peak / AUTO_FP8_COPIES_SHARE)}" in text
    edge = peak / AUTO_FP8_COPIES_SHARE
    assert fp8_copies_fit(peak, int(edge) + 1) and not fp8_copies_fit(peak, int(edge) - 1)
    cfg = parse_args(flags + ["--fp8-weight-cache", "step"])
    assert "auto drops" not in format_plan(cfg, 1, plan_run(cfg, 1, 301, torch.device("cpu")))


def test_adam_eps_must_be_positive():
    with pytest.raises(ConfigError, match="--adam-eps 0.0 must be > 0"):
        plan_run(parse_args(BASE + ["--adam-eps", "0"]), 1, 301)


def _report_on_ranks(rank, world, dropping, out_dir):
    """The weight-cache report of each rank, through a stand-in trainer (the decision itself needs a GPU)."""
    from megacoat.training.trainer import report_fp8_copies_dropped
    lines = []
    report_fp8_copies_dropped(f"> dropped on rank {rank}" if rank in dropping else None, torch.device("cpu"),
                              lines.append)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(lines, f)


@pytest.mark.parametrize("dropping", [[0], [0, 1], []])
def test_weight_cache_report_counts_every_ranks_decision(tmp_path, dropping):
    """Pipeline stage 0 drops its copies first, but the last rank logs: it says how many ranks dropped theirs."""
    run_distributed(_report_on_ranks, 2, dropping, str(tmp_path))
    said = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    if not dropping:
        assert said == [[], []]
    elif dropping == [0]:
        assert said[1] == ["> --fp8-weight-cache auto: 1 of 2 ranks do not keep their FP8 weight copies (their step's "
                           "estimated peak with them would not fit); this rank keeps its own"]
    else:
        assert said[1] == ["> dropped on rank 1 [2 of 2 ranks dropped theirs]"]


def test_coat_activation_estimate_equals_what_its_layer_saves():
    """activation_bytes_per_token_layer for coat against the bytes a coat layer saves for backward (saved-tensor
    hooks on distinct storages, weights and RoPE tables left out): equal but for the attention's logsumexp and
    the norms' rstd (fp32 per head and per token). Catches a saved tensor the estimate misses (the attention's bf16
    output next to coat's FP8 copy of it) or miscounts (the 1x16 scales are bf16)."""
    from megacoat.config import ModelConfig, resolve_model_defaults
    from megacoat.model.rope import RotaryEmbedding
    from megacoat.model.transformer import LayerContext, TransformerLayer
    from megacoat.parallel.random import seed_everything
    from megacoat.precision.linear import _fp8_caches, refresh_fp8_weights
    from megacoat.precision.recipe import Fp8Recipe
    h, f, heads, seq = 256, 688, 4, 128
    m = ModelConfig(num_layers=2, hidden_size=h, ffn_hidden_size=f, num_attention_heads=heads, seq_length=seq,
                    max_position_embeddings=seq, attention_dropout=0.0, hidden_dropout=0.0)
    resolve_model_defaults(m)
    cpu = torch.device("cpu")
    layer = TransformerLayer(m, LayerContext(None, False, seed_everything(1, 0, cpu), torch.bfloat16, cpu, 1,
                                             fp8=Fp8Recipe()), 0)
    refresh_fp8_weights(layer)
    rope = RotaryEmbedding(m.kv_channels, seq, m.rotary_base, device=cpu)(torch.arange(seq).unsqueeze(0), torch.bfloat16)
    excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    excluded |= {t.untyped_storage().data_ptr() for _, c in _fp8_caches(layer) for t in (c.wq, c.wqt, c.scale)}
    excluded |= {t.untyped_storage().data_ptr() for t in rope}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in excluded:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(seq, 1, h, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, rope)
    estimate = activation_bytes_per_token_layer(h, f, h, "coat", 1, False) * seq
    fp32_stats = seq * (4 * heads + 2 * 4)  # logsumexp per head, rstd of both norms
    assert sum(seen.values()) == pytest.approx(estimate + fp32_stats, abs=64), (sum(seen.values()), estimate)
