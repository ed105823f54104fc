"""Pipeline stages of the GPT model: which layers each stage holds, and the per-rank model chunks.

Virtual stage `v` (0 .. pp*vp - 1) lives on PP rank `v % pp` as its model chunk `v // pp`
(Megatron's interleaved assignment; vp = 1 is plain 1F1B). Stage 0 holds the embedding, the
last stage the final norm, output layer and loss. Layers keep their global numbers, so parameter
names and initial values are the same at every pipeline layout.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch.distributed as dist
from torch import nn

from ..config import ModelConfig, ParallelConfig
from ..parallel.context import ParallelContext
from ..parallel.mappings import group_size
from .gpt import GPTModel
from .transformer import LayerContext


def stage_layers(num_layers: int, pp: int, vp_layers: Optional[int] = None, first: Optional[int] = None,
                 last: Optional[int] = None) -> List[List[List[int]]]:
    """Global layer numbers per [pp rank][model chunk] (flags validated by config.validate_config)."""
    if vp_layers is not None:
        vp = num_layers // (pp * vp_layers)
        return [[list(range((c * pp + r) * vp_layers, (c * pp + r + 1) * vp_layers)) for c in range(vp)]
                for r in range(pp)]
    counts = [None] * pp
    if pp > 1 and first is not None:
        counts[0] = first
    if pp > 1 and last is not None:
        counts[-1] = last
    free = [i for i, c in enumerate(counts) if c is None]
    if free:
        each = (num_layers - sum(c for c in counts if c is not None)) // len(free)
        for i in free:
            counts[i] = each
    out, start = [], 0
    for c in counts:
        out.append([list(range(start, start + c))])
        start += c
    return out


class ModelChunks(nn.Module):
    """The model chunks one PP rank holds (one for 1F1B, several for interleaving), as one module
    for the optimizer and checkpoints. `chunks[c]` is virtual stage `c * pp + pp_rank`."""

    def __init__(self, chunks: Sequence[GPTModel], total_parameters: int, all_names: Sequence[str]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.vocab_size, self.padded_vocab = chunks[0].vocab_size, chunks[0].padded_vocab
        self._total_parameters = total_parameters
        # Every parameter name of the whole model (all stages): a checkpoint holds them all.
        self.all_parameter_names = frozenset(all_names)

    @property
    def pre_module_hook(self):
        return self.chunks[0].pre_module_hook

    @pre_module_hook.setter
    def pre_module_hook(self, fn) -> None:
        for c in self.chunks:
            c.pre_module_hook = fn

    @property
    def pre_backward_hook(self):
        return self.chunks[0].pre_backward_hook

    @pre_backward_hook.setter
    def pre_backward_hook(self, fn) -> None:
        for c in self.chunks:
            c.pre_backward_hook = fn

    def num_parameters(self) -> int:
        """Parameters of the full model (all stages, all TP shards, tied embedding once)."""
        return self._total_parameters

    def forward(self, *args, **kwargs):  # pragma: no cover - the pipeline schedule calls the chunks
        raise RuntimeError("run a pipelined model through megacoat.parallel.pipeline (its chunks), not directly")


def build_model_chunks(m: ModelConfig, p: ParallelConfig, lc: LayerContext, ctx: ParallelContext, vocab_size: int,
                       padded_vocab: int, compile_layers: bool = False):
    """(model, chunks): with PP = 1 the GPTModel itself (and [it]); otherwise this rank's
    chunks and a ModelChunks holding them (collective over the PP group: counts parameters)."""
    if ctx.pp_size == 1:
        model = GPTModel(m, lc, vocab_size, padded_vocab, compile_layers=compile_layers)
        return model, [model]
    layers = stage_layers(m.num_layers, ctx.pp_size, p.num_layers_per_virtual_pipeline_stage,
                          p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)[ctx.pp_rank]
    vp = len(layers)
    chunks = []
    for c, numbers in enumerate(layers):
        v = c * ctx.pp_size + ctx.pp_rank
        chunks.append(GPTModel(m, lc, vocab_size, padded_vocab, compile_layers=compile_layers,
                               pre_process=v == 0, post_process=v == ctx.pp_size * vp - 1, layer_numbers=numbers))
    tp = group_size(lc.tp_group)
    mine = sum(q.numel() * (tp if q.tensor_model_parallel else 1) for c in chunks for q in c.parameters()
               if not getattr(q, "tied_copy", False))
    gathered: List = [None] * ctx.pp_size
    dist.all_gather_object(gathered, (mine, [q.global_name for c in chunks for q in c.parameters()]),
                           group=ctx.pp_group)
    total = sum(n for n, _ in gathered)
    names = [name for _, ns in gathered for name in ns]
    return ModelChunks(chunks, total, names), chunks
