"""Rank grid, two-level DP groups, vocab-parallel cross entropy, LR schedule, config parsing."""
import math

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from megacoat.config import ConfigError, OptimizerConfig, parse_args, validate_config
from megacoat.optim.lr_scheduler import LRScheduler
from megacoat.parallel.context import ParallelContext, rank_grid, two_level_dp_groups
from megacoat.parallel.cross_entropy import vocab_parallel_cross_entropy


def test_rank_grid_tp_innermost_then_dp_then_pp():
    g = rank_grid(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for kind in ("tp", "dp", "pp"):  # each kind partitions the world
        assert sorted(r for grp in g[kind] for r in grp) == list(range(8))


def test_two_level_groups():
    intra, inter = two_level_dp_groups([0, 1, 2, 3], ranks_per_node=2)
    assert intra == [[0, 1], [2, 3]] and inter == [[0, 2], [1, 3]]
    intra, inter = two_level_dp_groups([0, 2, 4, 6], ranks_per_node=4)  # TP=2: 2 DP ranks per node
    assert intra == [[0, 2], [4, 6]] and inter == [[0, 4], [2, 6]]
    with pytest.raises(ConfigError, match="unevenly .* ranks \\(--ranks-per-node"):  # a message, not a crash
        two_level_dp_groups([0, 1, 2], ranks_per_node=2)


def _context_groups(rank, world, high_priority=()):
    ctx = ParallelContext.build(1, 1, torch.device("cpu"), ranks_per_node=2, high_priority=high_priority)
    assert ctx.dp_size == 4 and ctx.dp_intra_size == 2 and ctx.dp_inter_size == 2
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=ctx.dp_intra_group)
    assert t.item() == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=ctx.dp_inter_group)
    assert t.item() == {0: 2, 1: 4, 2: 2, 3: 4}[rank]


@pytest.mark.parametrize("high_priority", [(), ("dp", "tp")])
@pytest.mark.slow
def test_context_two_level_groups_emulated_nodes(high_priority):
    run_distributed(_context_groups, 4, high_priority)  # high-priority streams: an NCCL option, ignored on gloo


def test_high_priority_stream_groups_flag():
    assert parse_args([]).parallel.high_priority_stream_groups == []
    assert parse_args(["--high-priority-stream-groups", "dp", "tp"]).parallel.high_priority_stream_groups == ["dp", "tp"]
    with pytest.raises(SystemExit):
        parse_args(["--high-priority-stream-groups", "dp_cp"])  # not a group of this framework


def _ce_tp(rank, world, vocab):
    ctx = ParallelContext.build(world, 1, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    padded = 8 * world * math.ceil(vocab / (8 * world))
    logits = torch.randn(5, 3, padded, generator=g) * 3
    target = torch.randint(0, vocab, (5, 3), generator=g)
    ref_logits = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none").view(5, 3)
    ref.sum().backward()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, ctx.tp_group, vocab)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    full_grad = torch.zeros(5, 3, padded)
    full_grad[..., :vocab] = ref_logits.grad
    torch.testing.assert_close(local.grad, full_grad.chunk(world, -1)[rank], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,vocab", [(1, 37), (2, 37), (4, 50)])
@pytest.mark.slow
def test_vocab_parallel_cross_entropy_equals_torch(world, vocab):
    if world == 1:
        _ce_single(vocab)
    else:
        run_distributed(_ce_tp, world, vocab)


def _ce_single(vocab):
    ctx = ParallelContext.single()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 2, 40, generator=g, requires_grad=True)
    target = torch.randint(0, vocab, (4, 2), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target, ctx.tp_group, vocab)
    ref = F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction="none").view(4, 2)
    torch.testing.assert_close(loss, ref)


def test_lr_schedule_megatron_shape():
    s = LRScheduler(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="cosine",
                                    lr_decay_iters=110), train_iters=200)
    assert s.lr_at(5) == pytest.approx(0.5)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.55)
    assert s.lr_at(110) == pytest.approx(0.1)
    assert s.lr_at(150) == pytest.approx(0.1)
    lin = LRScheduler(OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear"), 100)
    assert lin.lr_at(50) == pytest.approx(0.5)
    const = LRScheduler(OptimizerConfig(lr=2.0, lr_warmup_iters=0, lr_decay_style="constant"), 100)
    assert const.lr_at(99) == 2.0


def test_config_flags_and_resolution():
    cfg = parse_args(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "6",
                      "--group-query-attention", "--num-query-groups", "2", "--micro-batch-size", "2",
                      "--data-path", "0.3", "A", "0.7", "B", "--no-torch-compile", "--swiglu"])
    validate_config(cfg, world_size=4)
    assert cfg.model.num_query_groups == 2 and cfg.model.kv_channels == 16
    assert cfg.model.ffn_hidden_size == 256  # Llama rule: 2/3 * 4 * 96 = 256
    assert cfg.train.global_batch_size == 8  # micro-batch x DP
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"]
    assert cfg.train.torch_compile is False
    with pytest.raises(ConfigError, match="--num-query-groups needs --group-query-attention"):
        validate_config(parse_args(["--num-query-groups", "2"]), 1)
    with pytest.raises(ConfigError, match="--mock-data conflicts"):
        validate_config(parse_args(["--mock-data", "--data-path", "X"]), 1)
    with pytest.raises(ConfigError, match="--fp8-weight-cache needs --fp8-format"):
        validate_config(parse_args(["--fp8-weight-cache", "step"]), 1)

