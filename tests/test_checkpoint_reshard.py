"""Save at (TP, DP) = (2, 2), load at other layouts: same logits, same next optimizer step.

Also a ZeRO-style save/load: every DP rank holding only a flat sub-range of each TP-local tensor
(ranges straddle parameters), loaded at another TP and DP size.
"""
import os
import types

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megacoat.checkpoint import Checkpointer, CheckpointReader
from megacoat.config import MegacoatConfig
from megacoat.optim.lr_scheduler import LRScheduler
from megacoat.optim.optimizer import ParamStateRange
from megacoat.parallel.context import ParallelContext
from megacoat.parallel.random import seed_everything
from megacoat.training.trainer import TrainState
from parallel_harness import VOCAB, batches, build, run_step, small_model_config

MODEL_KW = dict(group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=True)
GLOBAL_MICRO, MBS = 4, 2  # global batch: 4 micro-batches of 2, split over DP


def trainer_like(model, opt, ctx, m, save_dir=None, load_dir=None):
    """The attributes Checkpointer reads from a Trainer, for a harness-built model."""
    cfg = MegacoatConfig()
    cfg.model = m
    cfg.checkpoint.save, cfg.checkpoint.load = save_dir, load_dir
    return types.SimpleNamespace(model=model, optimizer=opt, ctx=ctx, cfg=cfg, state=TrainState(),
                                 scheduler=LRScheduler(cfg.optim, 10), rng=seed_everything(11, ctx.tp_rank, ctx.device),
                                 tokenizer=types.SimpleNamespace(vocab_size=VOCAB))


def global_step(model, opt, ctx, step):
    """One optimizer step on global batch `step` (this DP rank's block); returns the global loss."""
    n_micro = GLOBAL_MICRO // ctx.dp_size
    glob = batches(step, GLOBAL_MICRO, MBS, 16)
    mine = glob[ctx.dp_rank * n_micro:(ctx.dp_rank + 1) * n_micro]
    loss = torch.tensor(run_step(model, opt, mine, n_micro))
    opt.step(1e-2)
    if ctx.dp_size > 1:
        dist.all_reduce(loss, group=ctx.dp_group)
        loss /= ctx.dp_size
    return loss.item()


@torch.no_grad()
def probe_logits(model):
    tokens = batches(99, 1, 2, 16)[0]["tokens"]
    return model(tokens).float()


def _save_reference(rank, world, tmp):
    m = small_model_config(**MODEL_KW)
    ctx = ParallelContext.build(2, 1, torch.device("cpu"))
    model, opt = build(m, ctx, sp=False)
    for step in range(2):
        global_step(model, opt, ctx, step)
    t = trainer_like(model, opt, ctx, m, save_dir=os.path.join(tmp, "ckpt"))
    t.state.iteration = 2
    Checkpointer(t.cfg, ctx, log=lambda s: None).save(t)
    z = trainer_like(model, FlatShardedView(opt, ctx.dp_rank, ctx.dp_size), ctx, m, save_dir=os.path.join(tmp, "zero"))
    z.state.iteration = 2
    Checkpointer(z.cfg, ctx, log=lambda s: None).save(z)
    before = probe_logits(model)
    loss3 = global_step(model, opt, ctx, 2)
    after = probe_logits(model)
    if rank == 0:
        torch.save({"before": before, "loss3": loss3, "after": after}, os.path.join(tmp, "ref.pt"))


def _load_and_compare(rank, world, tp, tmp):
    m = small_model_config(**MODEL_KW)
    ctx = ParallelContext.build(tp, 1, torch.device("cpu"))
    model, opt = build(m, ctx, sp=False, seed=999)  # other init: everything must come from the checkpoint
    t = trainer_like(model, opt, ctx, m, load_dir=os.path.join(tmp, "ckpt"))
    assert Checkpointer(t.cfg, ctx, log=lambda s: None).load(t)
    assert t.state.iteration == 2
    ref = torch.load(os.path.join(tmp, "ref.pt"))
    torch.testing.assert_close(probe_logits(model), ref["before"], rtol=1e-5, atol=1e-5)
    check_zero_style_load(m, ctx, opt, tmp)
    loss3 = global_step(model, opt, ctx, 2)
    assert abs(loss3 - ref["loss3"]) <= 1e-5 * abs(ref["loss3"]), (loss3, ref["loss3"])
    torch.testing.assert_close(probe_logits(model), ref["after"], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reshard"))
    run_distributed(_save_reference, 4, tmp)
    return tmp


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2), (1, 4)])  # saved at TP 2 x DP 2
@pytest.mark.slow
def test_load_at_other_layout(reference, tp, world):
    run_distributed(_load_and_compare, world, tp, reference)


def test_checkpoint_holds_each_element_once(reference):
    reader = CheckpointReader(os.path.join(reference, "ckpt", "iter_0000002"))
    assert reader.meta["parallel"] == {"world_size": 4, "tp": 2, "pp": 1, "dp": 2}
    files = {rec["file"] for e in reader.tensors.values() for rec in e["pieces"]}
    assert files == {"rank_00000.bin", "rank_00001.bin"}  # DP rank 1 holds replicas only: nothing to write
    # Vocabulary padding is not stored: the embedding is [VOCAB, hidden] at any TP.
    assert reader.canonical("model", "embedding.word_embeddings.weight").shape[0] == VOCAB
    zero = CheckpointReader(os.path.join(reference, "zero", "iter_0000002"))
    files = {rec["file"] for e in zero.tensors.values() for rec in e["pieces"]}
    assert len(files) == 4  # ZeRO-style: every rank writes its own shard


# ------------------------------------------------------------------------------ ZeRO-style
class FlatShardedView:
    """Exposes only this DP rank's 1/dp slice of the concatenated flat state (like ZeRO):
    ranges are sub-ranges of TP-local tensors and straddle parameters."""

    def __init__(self, opt, dp_rank, dp_size):
        self.opt, full = opt, opt.state_ranges()
        total = sum(r.end - r.start for r in full)
        lo, hi = total * dp_rank // dp_size, total * (dp_rank + 1) // dp_size
        self.ranges, pos = [], 0
        for r in full:
            a, b = max(lo, pos), min(hi, pos + r.end - r.start)
            if a < b:
                s, e = a - pos, b - pos
                self.ranges.append(ParamStateRange(r.param, s, e, {k: v[s:e] for k, v in r.tensors.items()}))
            pos += r.end - r.start

    def state_ranges(self):
        return self.ranges

    def scalar_state(self):
        return self.opt.scalar_state()


def check_zero_style_load(m, ctx, loaded_opt, tmp):
    """Load the ZeRO-style checkpoint into this layout's ZeRO-style ranges: equal to the plain load."""
    from megacoat.checkpoint.checkpointer import load_optimizer_state
    model, opt = build(m, ctx, sp=False, seed=7)
    view = FlatShardedView(opt, ctx.dp_rank, ctx.dp_size)
    load_optimizer_state(CheckpointReader(os.path.join(tmp, "zero", "iter_0000002")), model, view,
                         ctx.tp_rank, ctx.tp_size)
    ref = {r.param.global_name: r.tensors for r in loaded_opt.state_ranges()}
    assert view.state_ranges()
    for r in view.state_ranges():
        for state, got in r.tensors.items():
            torch.testing.assert_close(got, ref[r.param.global_name][state][r.start:r.end], rtol=0, atol=0)
