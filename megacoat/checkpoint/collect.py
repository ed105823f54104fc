"""What one rank writes: the pieces of model weights and optimizer state it is the owner of.

Every rank describes what it holds as (global name, TP coordinate, flat range of the TP-local
tensor) - the optimizer's `state_ranges()` - and the first rank (in global order) holding an
element writes it. This one rule removes every duplicate: TP-replicated tensors (norms), DP
replicas (no ZeRO), and, when pipeline stages share a tensor (tied embeddings), its copies; under
ZeRO each DP rank writes exactly its shard.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .layout import TensorLayout, layout_of_parameter

MODEL_KIND = "model"
OPTIM_PREFIX = "optim."
# Per-group optimizer state (FP8 moments' scale, exponent, centre) covers groups of this many
# elements of the TP-local flat tensor: a piece [a, b) of elements carries groups
# [a // GROUP_SIZE, ceil(b / GROUP_SIZE)); owned ranges start at group boundaries (ZeRO buffers
# align every parameter and shard to 128), so DP resharding reads whole groups.
GROUP_SIZE = 128


@dataclass
class Piece:
    kind: str                 # "model" or "optim.<state name>" ("optim.master", "optim.exp_avg", ...)
    name: str                 # the parameter's global name
    tp_rank: int              # TP coordinate in the saving layout (0 for TP-replicated tensors)
    start: int                # flat range of the TP-local tensor
    end: int
    tensor: torch.Tensor      # 1-D, end - start elements (a live view until snapshotted)
    group: int = 1            # > 1: per-group state, start/end count groups of this many elements


@dataclass
class HeldRange:
    """One parameter range this rank holds: its model tensor and optimizer state views."""

    param: torch.nn.Parameter
    start: int
    end: int
    states: Dict[str, torch.Tensor]
    groups: Dict[str, torch.Tensor] = field(default_factory=dict)  # per group of GROUP_SIZE elements


def held_ranges(model: torch.nn.Module, optimizer=None) -> List[HeldRange]:
    """Skips `tied_copy` parameters (the last pipeline stage's copy of the tied word embedding:
    the first stage holds the same values and writes them)."""
    if optimizer is not None:
        return [HeldRange(r.param, r.start, r.end, dict(r.tensors), dict(getattr(r, "groups", {})))
                for r in optimizer.state_ranges()
                if not getattr(r.param, "tied_copy", False)]
    return [HeldRange(p, 0, p.numel(), {}) for p in model.parameters() if not getattr(p, "tied_copy", False)]


def subtract_intervals(start: int, end: int, taken: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """[start, end) minus the union of `taken`, as sorted disjoint intervals."""
    out, cursor = [], start
    for a, b in sorted(taken):
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if cursor < end:
        out.append((cursor, end))
    return out


def owned_intervals(mine: List[Tuple[str, int, int, int]]) -> List[List[Tuple[int, int]]]:
    """For each (name, tp coordinate, start, end) this rank holds, the sub-ranges it must write.

    Collective over the world (one all_gather_object of range descriptors, no tensor data).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [[(s, e)] for _, _, s, e in mine]
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    taken = defaultdict(list)
    for lower in everyone[: dist.get_rank()]:
        for name, tp, s, e in lower:
            taken[(name, tp)].append((s, e))
    return [subtract_intervals(s, e, taken[(name, tp)]) for name, tp, s, e in mine]


def collect_pieces(ranges: List[HeldRange], tp_rank: int, tp_size: int, vocab_size: Optional[int]):
    """Layouts of every tensor this rank holds (by name) and the pieces it owns.

    Returns (layouts, dtypes, pieces): dtypes maps "kind/name" -> dtype name.
    """
    layouts: Dict[str, TensorLayout] = {}
    dtypes: Dict[str, str] = {}
    mine = []
    for r in ranges:
        layout = layout_of_parameter(r.param, tp_size, vocab_size)
        layouts[r.param.global_name] = layout
        mine.append((r.param.global_name, tp_rank if layout.tp_size > 1 else 0, r.start, r.end))
        dtypes[f"{MODEL_KIND}/{r.param.global_name}"] = dtype_name(r.param.dtype)
        for state, t in {**r.states, **r.groups}.items():
            dtypes[f"{OPTIM_PREFIX}{state}/{r.param.global_name}"] = dtype_name(t.dtype)
    pieces = []
    for r, (name, tp, _, _), owned in zip(ranges, mine, owned_intervals(mine)):
        flat = r.param.detach().reshape(-1)
        for a, b in owned:
            pieces.append(Piece(MODEL_KIND, name, tp, a, b, flat[a:b]))
            for state, t in r.states.items():
                pieces.append(Piece(OPTIM_PREFIX + state, name, tp, a, b, t.detach()[a - r.start: b - r.start]))
            if r.groups:
                if a % GROUP_SIZE:
                    raise RuntimeError(f"{name}: owned range [{a}, {b}) does not start a group of {GROUP_SIZE}")
                g0, ga, gb = r.start // GROUP_SIZE, a // GROUP_SIZE, -(-b // GROUP_SIZE)
                for state, t in r.groups.items():
                    pieces.append(Piece(OPTIM_PREFIX + state, name, tp, ga, gb, t.detach()[ga - g0: gb - g0],
                                        GROUP_SIZE))
    return layouts, dtypes, pieces


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
