"""Who this process is in the job, from the launcher's environment: read once at start-up, then passed on.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A process started
by `srun` alone (one task per GPU, no torchrun) has SLURM's variables instead, which are translated into the
same fields; without either it is rank 0 of 1. `read_launch_env` is the only place megacoat reads these
variables, and it never writes them: the result goes to `init_distributed` and to whoever needs a rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional


class LaunchError(RuntimeError):
    """The launcher's environment does not say how to join the job; the message says what to do."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # processes on this node
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # "torchrun" (or anything that sets torchrun's variables), "srun", "none"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def init_method(self) -> str:
        """torch.distributed's rendezvous at MASTER_ADDR:MASTER_PORT (what env:// reads; under torchrun the
        ranks join its agent's store there either way)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr  # IPv6
        return f"tcp://{host}:{self.master_port}"


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[07-09,12],cpu3' -> 'gpu07', 'n[001-002]-ib' -> 'n001-ib'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first host expression
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    if "[" not in first:
        return first
    prefix, rest = first.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from SLURM's compressed list, e.g. '4(x2),3' -> 4, 4, 3."""
    counts = []
    for item in tasks_per_node.split(","):
        if "(x" in item:
            n, rep = item.rstrip(")").split("(x")
            counts += [int(n)] * int(rep)
        else:
            counts.append(int(item))
    return counts[min(node_id, len(counts) - 1)]


def torchrun_env_from_slurm(env: Mapping[str, str]) -> Dict[str, str]:
    """The torchrun variables of a process started by `srun` (one task per GPU) without torchrun.

    Returns {} when torchrun's variables are already there or this is not a multi-task SLURM job
    step (plain `python` inside an sbatch script runs one process). The port defaults to one
    derived from the job id, so that jobs sharing a node do not collide."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return {}
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:  # not inside an srun job step
        return {}
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return {}
    missing = [] if "SLURM_LOCALID" in env else ["SLURM_LOCALID"]
    addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not addr and nodelist:
        addr = first_slurm_host(nodelist)
    if not addr:
        missing.append("SLURM_LAUNCH_NODE_IPADDR or SLURM_JOB_NODELIST (or MASTER_ADDR)")
    if missing:
        raise LaunchError(f"started by srun with {world} tasks, but {', '.join(missing)} is not set, so this process "
                          "cannot find the others; launch with `srun torchrun --nnodes $SLURM_NNODES "
                          "--nproc-per-node N ...` instead, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or env.get(
        "SLURM_NTASKS_PER_NODE")
    local_world = slurm_tasks_on_node(per_node, int(env.get("SLURM_NODEID", 0))) if per_node else world
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", 0) or 0) % 20000)
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr, "MASTER_PORT": port}


def _int(values: Mapping[str, str], name: str, default: int) -> int:
    raw = values.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer; the launcher sets it (torchrun, or srun through "
                          "SLURM_PROCID / SLURM_LOCALID): unset it to run one process") from None


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """This process's place in the job from `env` (default: the process environment). Raises LaunchError
    when it is incomplete (an srun task that cannot find the others, a rank without its world size)."""
    env = os.environ if env is None else env
    from_slurm = torchrun_env_from_slurm(env)
    values = from_slurm or env
    world = _int(values, "WORLD_SIZE", 1)
    if world > 1 and "RANK" not in values:
        raise LaunchError(f"WORLD_SIZE={world} but RANK is not set: launch with torchrun (or srun), or set RANK, "
                          "LOCAL_RANK, MASTER_ADDR and MASTER_PORT too")
    if world > 1 and not values.get("MASTER_ADDR"):
        raise LaunchError(f"WORLD_SIZE={world} but MASTER_ADDR is not set: the ranks cannot find each other; launch "
                          "with torchrun (or srun), or set MASTER_ADDR and MASTER_PORT")
    rank = _int(values, "RANK", 0)
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if from_slurm:
        launcher = "srun"
    else:
        launcher = "torchrun" if "RANK" in env or "WORLD_SIZE" in env else "none"
    return LaunchEnv(rank=rank, world_size=world, local_rank=_int(values, "LOCAL_RANK", 0),
                     local_world_size=_int(values, "LOCAL_WORLD_SIZE", world),
                     master_addr=values.get("MASTER_ADDR") or "127.0.0.1", master_port=_int(values, "MASTER_PORT", 29500),
                     launcher=launcher)
