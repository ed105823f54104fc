"""ParallelContext: the rank grid (pp, dp, tp) and its process groups.

Rank layout (Megatron's): TP is innermost (fastest-varying), then DP, then PP:
    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
Data-parallel ranks are further split for two-level communication: the DP ranks whose
global ranks sit on one node form the intra-node group; DP ranks with the same position
inside their node, across nodes, form the inter-node group. The node size is given by the caller
(--ranks-per-node, else the launcher's LOCAL_WORLD_SIZE), so nodes can be emulated on one host.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import ConfigError
from .launch_env import LaunchEnv


def rank_grid(world_size: int, tp: int, pp: int) -> Dict[str, List[List[int]]]:
    """All groups of the grid as lists of global ranks (pure function, testable without processes)."""
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} not divisible by tp*pp={tp * pp}")
    dp = world_size // (tp * pp)
    groups: Dict[str, List[List[int]]] = {"tp": [], "dp": [], "pp": [], "mp": [], "tp_dp": [], "embedding": []}
    for p in range(pp):
        base = p * dp * tp
        for d in range(dp):
            groups["tp"].append([base + d * tp + t for t in range(tp)])
        for t in range(tp):
            groups["dp"].append([base + d * tp + t for d in range(dp)])
        groups["tp_dp"].append(list(range(base, base + dp * tp)))
    for d in range(dp):
        for t in range(tp):
            groups["pp"].append([p * dp * tp + d * tp + t for p in range(pp)])
    if pp > 1:  # first and last stage of each pipeline: they hold the two copies of tied embeddings
        groups["embedding"] = [[ranks[0], ranks[-1]] for ranks in groups["pp"]]
    for d in range(dp):  # model-parallel group: all TP and PP ranks of one model replica
        groups["mp"].append(sorted(p * dp * tp + d * tp + t for p in range(pp) for t in range(tp)))
    return groups


def two_level_dp_groups(dp_group: List[int], ranks_per_node: int):
    """Split one DP group into intra-node groups and inter-node groups by node membership.

    Returns (intra, inter): lists of rank lists. Intra: DP ranks sharing a node. Inter: the
    i-th DP rank of every node. Every node must hold the same number of this group's ranks,
    otherwise two-level communication cannot be symmetric and we raise ConfigError (a ValueError).
    """
    by_node: Dict[int, List[int]] = {}
    for r in dp_group:
        by_node.setdefault(r // ranks_per_node, []).append(r)
    sizes = {len(v) for v in by_node.values()}
    if len(sizes) != 1:
        raise ConfigError(f"DP group {dp_group} is spread unevenly over nodes of {ranks_per_node} ranks "
                          "(--ranks-per-node; default: the launcher's processes per node), but SDP4Bit's two-level "
                          "data-parallel groups (--quantized-weights / --quantized-gradients) need the same number "
                          "of its ranks on every node: choose another --ranks-per-node, or another "
                          "--tensor-model-parallel-size / --pipeline-model-parallel-size.")
    intra = [by_node[n] for n in sorted(by_node)]
    per_node = sizes.pop()
    inter = [[intra[n][i] for n in range(len(intra))] for i in range(per_node)]
    return intra, inter


def dp_groups_split_evenly(world_size: int, tp: int, pp: int, ranks_per_node: int) -> bool:
    """Whether every DP group of the grid has the same number of ranks on each node (what SDP4Bit's two-level
    groups need)."""
    try:
        for dp_ranks in rank_grid(world_size, tp, pp)["dp"]:
            two_level_dp_groups(dp_ranks, ranks_per_node)
    except ConfigError:
        return False
    return True


@dataclass
class ParallelContext:
    """Process groups and coordinates of this rank. Passed explicitly; there is no global copy."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    ranks_per_node: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: Optional[object] = None
    pp_group: Optional[object] = None
    dp_group: Optional[object] = None
    mp_group: Optional[object] = None
    dp_intra_group: Optional[object] = None
    dp_inter_group: Optional[object] = None
    dp_intra_size: int = 1
    dp_inter_size: int = 1
    tp_ranks: List[int] = field(default_factory=lambda: [0])
    dp_ranks: List[int] = field(default_factory=lambda: [0])
    pp_ranks: List[int] = field(default_factory=lambda: [0])
    embedding_group: Optional[object] = None  # first + last pipeline stage (None on other stages and PP=1)

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage (a ring: the last stage's next is the first)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def pp_prev_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelContext":
        return cls(device=device or torch.device("cpu"))

    @classmethod
    def build(cls, tp: int, pp: int, device: torch.device, ranks_per_node: Optional[int] = None,
              timeout_minutes: Optional[float] = None, high_priority: Sequence[str] = (),
              two_level_dp: bool = True) -> "ParallelContext":
        """Create every group. Must be called on all ranks after init_process_group (or alone, world 1).

        `ranks_per_node`: processes per node (default: all on one node).
        `timeout_minutes` (--distributed-timeout-minutes) is given to every group: new_group does not
        inherit init_process_group's timeout (it falls back to torch's 30-minute default), so without
        it a rank waiting on a stuck peer in a TP/DP/PP collective would hang for half an hour.
        `high_priority` (--high-priority-stream-groups): the kinds of group ("dp" covers its intra- and
        inter-node subgroups) whose NCCL streams are created with high priority.
        `two_level_dp`: SDP4Bit is on and needs each DP group split by node (the same number of its ranks on
        every node, else ConfigError); off, a DP group spread unevenly over nodes simply gets no node-level
        subgroups (plain data parallelism and ZeRO use the whole DP group)."""
        if not dist.is_initialized():
            if tp * pp != 1:
                raise ValueError("tensor/pipeline parallel sizes > 1 need torch.distributed (launch with torchrun)")
            return cls.single(device)
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = rank_grid(world, tp, pp)
        rpn = ranks_per_node or world
        ctx = cls(world_size=world, rank=rank, tp_size=tp, pp_size=pp, dp_size=world // (tp * pp),
                  ranks_per_node=rpn, device=device)
        base_kw = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
        fast_kw = dict(base_kw, **_high_priority_options()) if high_priority else base_kw
        kw_of = lambda kind: fast_kw if kind in high_priority else base_kw  # noqa: E731
        # new_group must be called by every rank for every group, in the same order.
        for kind in ("tp", "dp", "pp", "mp"):
            for ranks in grid[kind]:
                g = dist.new_group(ranks, **kw_of(kind))
                if rank in ranks:
                    setattr(ctx, f"{kind}_group", g)
                    if kind in ("tp", "dp", "pp"):
                        setattr(ctx, f"{kind}_ranks", ranks)
                        setattr(ctx, f"{kind}_rank", ranks.index(rank))
        for ranks in grid["embedding"]:
            g = dist.new_group(ranks, **kw_of("embedding"))
            if rank in ranks:
                ctx.embedding_group = g
        try:
            splits = [two_level_dp_groups(dp_ranks, rpn) for dp_ranks in grid["dp"]]
        except ConfigError:
            if two_level_dp:
                raise
            splits = []  # every rank decides alike (same grid): no new_group calls for node-level subgroups
        for intra, inter in splits:
            for kind, lists in (("intra", intra), ("inter", inter)):
                for ranks in lists:
                    g = dist.new_group(ranks, **kw_of("dp"))
                    if rank in ranks:
                        setattr(ctx, f"dp_{kind}_group", g)
                        setattr(ctx, f"dp_{kind}_size", len(ranks))
        return ctx


def _high_priority_options() -> dict:
    """new_group's keyword for high-priority NCCL streams; none on other backends (gloo has no streams)."""
    if dist.get_backend() != "nccl":
        return {}
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return {"pg_options": opts}


def init_distributed(launch: LaunchEnv, backend: str = "auto", timeout_minutes: float = 10,
                     use_cpu: bool = False) -> torch.device:
    """Join the job `launch` describes (nothing to join for a single process) and pick this rank's device:
    GPU `local_rank` of this node, or the CPU. Returns the device."""
    on_gpu = torch.cuda.is_available() and not use_cpu
    device = (torch.device("cuda", launch.local_rank % max(torch.cuda.device_count(), 1)) if on_gpu
              else torch.device("cpu"))
    if on_gpu:
        torch.cuda.set_device(device)
    if launch.distributed and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if on_gpu else "gloo"
        kwargs = dict(backend=backend, init_method=launch.init_method, rank=launch.rank, world_size=launch.world_size,
                      timeout=datetime.timedelta(minutes=timeout_minutes))
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return device
