"""GPT model: vocab-parallel embedding -> transformer layers -> final norm -> vocab-parallel logits/loss."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.layers import ColumnParallelLinear, InitSpec, VocabParallelEmbedding, register_replicated
from ..parallel.mappings import (gather_from_tp_region, group_size, reduce_from_tp_region,
                                 reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region)
from ..parallel.random import param_generator
from ..precision.linear import Fp8WeightRefresher, release_fp8_weight_copies
from .rope import RotaryEmbedding
from .inductor_settings import launch_user_kernels_statically
from .recompute import RecomputePlan, run_layer_group
from .transformer import LayerContext, Norm, TransformerLayer, _dropout_region


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: a multiple of divisible_by * TP, so every TP shard is equal and aligned."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


class GPTModel(nn.Module):
    """The whole model, or one pipeline stage (model chunk) of it.

    A stage holds the transformer layers `layer_numbers` (global indices: names and initial
    values do not depend on the split), the embedding if `pre_process` (first stage) and the
    final norm, output layer and loss if `post_process` (last stage). With tied embeddings a last
    stage that is not also the first holds a copy of the word embedding for its output layer,
    initialised identically and marked `tied_copy = True` (its gradient is summed with the first
    stage's before the optimizer step; checkpoints store the first stage's tensor only).
    """

    def __init__(self, m: ModelConfig, lc: LayerContext, vocab_size: int, padded_vocab: int,
                 compile_layers: bool = False, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Optional[Sequence[int]] = None):
        super().__init__()
        self.m, self.lc = m, lc
        self.vocab_size, self.padded_vocab = vocab_size, padded_vocab
        self.tied = not m.untie_embeddings_and_output_weights
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(m.num_layers) if layer_numbers is None else layer_numbers)
        init = InitSpec(lc.seed, m.init_method_std, valid_rows=vocab_size)
        self.embedding = None
        if pre_process or (post_process and self.tied):
            self.embedding = VocabParallelEmbedding(padded_vocab, m.hidden_size, tp_group=lc.tp_group,
                                                    name="embedding.word_embeddings", init=init,
                                                    dtype=lc.dtype, device=lc.device)
            if not pre_process:
                self.embedding.weight.tied_copy = True
        self.position_embedding = None
        self.rope = None
        if m.position_embedding_type == "learned_absolute" and not pre_process:
            pass  # learned positions are added by the first stage only
        elif m.position_embedding_type == "learned_absolute":
            w = torch.empty(m.max_position_embeddings, m.hidden_size, device=lc.device, dtype=torch.float32)
            w.normal_(0.0, m.init_method_std,
                      generator=param_generator(lc.seed, "embedding.position_embeddings.weight", lc.device))
            self.position_embedding = register_replicated(nn.Parameter(w.to(lc.dtype)),
                                                          "embedding.position_embeddings.weight")
        else:
            self.rope = RotaryEmbedding(m.kv_channels, m.max_position_embeddings, m.rotary_base, device=lc.device)
        self.layers = nn.ModuleList(TransformerLayer(m, lc, i) for i in self.layer_numbers)
        # Each layer's last residual add goes into the next layer's input norm, which adds it where the recipe's norm
        # can (coat); the chunk's last layer adds its own, so the chunk returns a tensor.
        if lc.ops.defers_residual_add:
            for layer in list(self.layers)[:-1]:
                layer.defer_residual = True
        self.final_norm = self.output_layer = None
        if post_process:
            self.final_norm = Norm(m, lc, "final_norm")
            self.output_layer = ColumnParallelLinear(m.hidden_size, padded_vocab, tp_group=lc.tp_group,
                                                     name="output_layer", init=init,
                                                     sequence_parallel=lc.sequence_parallel,
                                                     dtype=lc.dtype, device=lc.device, skip_weight=self.tied,
                                                     gradient_accumulation_fusion=lc.gradient_accumulation_fusion)
        if compile_layers:
            launch_user_kernels_statically()
            for layer in self.layers:
                layer.compile()
        # Called with each top-level module just before its forward, outside compiled code: the
        # ZeRO optimizer waits there for the deferred all-gather of that module's weights.
        self.pre_module_hook = None
        # Called with a tuple of modules just before their backward (see _BeforeBackward).
        self.pre_backward_hook = None
        # --recompute-granularity full: which layers recompute their forward in backward (set by the trainer).
        self.recompute_plan = None
        # Per layer, what remakes its kept FP8 weight copies when stale (None: the recipe keeps none).
        self._fp8_refreshers = ([Fp8WeightRefresher(layer) for layer in self.layers]
                                if lc.fp8 is not None and lc.fp8.cache_weights else None)

    def cast_fp8_weights_per_use(self) -> int:
        """Keep no FP8 weight copies from now on (the trainer's --fp8-weight-cache auto when they would not fit):
        each linear casts its weight where it uses it. Returns the bytes released. Before the first forward."""
        self._fp8_refreshers = None
        return release_fp8_weight_copies(self)

    def _before(self, module: nn.Module) -> None:
        if self.pre_module_hook is not None:
            self.pre_module_hook(module)

    def _before_backward(self, x, *modules: nn.Module):
        """Have `pre_backward_hook(modules)` run just before the backward of the node that produced x (the
        optimizer allocates the gradient storage of these modules' parameters there). A hook on the
        autograd node, not an identity function: x stays the same tensor, so the pipeline can still free
        its data after sending it. x may be a layer's deferred residual add (precision/handoff.py: PendingAdd):
        every node that made one of its tensors gets the hook (whichever runs first allocates; the allocation is
        idempotent)."""
        hook = self.pre_backward_hook
        if hook is None or not torch.is_grad_enabled():
            return x
        nodes = {}
        for t in (x if isinstance(x, tuple) else (x,)):
            if t is not None and t.grad_fn is not None:
                nodes[id(t.grad_fn)] = t.grad_fn
        for node in nodes.values():
            node.register_prehook(lambda grad_outputs: hook(modules))
        return x

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, h] (sequence-sharded under SP)."""
        self._before(self.embedding)
        if self.position_embedding is not None:
            self._before(self)  # the learned position table is a direct parameter of the model
        x = self.embedding(tokens).transpose(0, 1).contiguous()
        if self.lc.sequence_parallel:
            x = reduce_scatter_to_sequence_parallel_region(x, self.lc.tp_group)
        else:
            x = reduce_from_tp_region(x, self.lc.tp_group)
        if self.position_embedding is not None:
            pos = F.embedding(position_ids, self.position_embedding).transpose(0, 1)
            if self.lc.sequence_parallel:
                pos = scatter_to_sequence_parallel_region(pos, self.lc.tp_group)
            x = x + pos
        p = self.m.hidden_dropout
        if self.training and p > 0:
            with _dropout_region(self.lc, inside_tp=False, p=p):
                x = F.dropout(x, p, training=True)
        return self._before_backward(x, self.embedding, self)

    def forward(self, tokens: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                hidden: Optional[torch.Tensor] = None):
        """With labels: per-token loss [b, s] (fp32). Without: full logits [b, s, vocab] (gathered over TP).

        A pipeline stage without `pre_process` takes the previous stage's output `hidden` [s, b, h]
        instead of tokens; one without `post_process` returns its hidden output [s, b, h].
        """
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        rope = self.rope(position_ids, x.dtype) if self.rope is not None else None
        plan = self.recompute_plan or RecomputePlan("none")
        index = 0  # of the layer in self.layers (groups come in order)
        for recomputed, group in plan.layer_groups(self.layers):
            # A recomputed group after a deferring layer keeps both of its bf16 inputs (the planner counts them):
            # adding them here first would round the residual gradient differently from the run without
            # recomputation, which must give the same bits.
            for layer in group:
                self._before(layer)
                if self._fp8_refreshers is not None:
                    # Kept FP8 weight copies: remade here, outside compiled code, if stale (the trainer
                    # usually remade them all right after the optimizer step; this is then a quick check)
                    self._fp8_refreshers[index]()
                index += 1
            x = self._before_backward(run_layer_group(group, x, rope, attention_mask, recomputed and self.training,
                                                      self.lc.rng), *group)
        if not self.post_process:
            return x
        if self.tied and not self.pre_process:
            self._before(self.embedding)  # the tied copy the output layer uses
        self._before(self.final_norm)
        x = self._before_backward(self.final_norm(x), self.final_norm)
        self._before(self.output_layer)
        logits = self.output_layer(x, weight=self.embedding.weight if self.tied else None)  # [s, b, V/tp]
        logits = self._before_backward(logits, self.output_layer, *((self.embedding,) if self.tied else ()))
        if labels is None:
            full = gather_from_tp_region(logits, self.lc.tp_group).transpose(0, 1)
            return full[..., : self.vocab_size]
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.lc.tp_group, self.vocab_size,
                                            fused=self.lc.cross_entropy_fusion)
        return loss.transpose(0, 1)

    def num_parameters(self) -> int:
        """Parameters of the full model (all TP shards; padded vocabulary)."""
        tp = group_size(self.lc.tp_group)
        return sum(p.numel() * (tp if p.tensor_model_parallel else 1) for p in self.parameters())
