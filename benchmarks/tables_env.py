"""Where a table's part ran: date, commit, GPU (or CPU), torch / Triton / CUDA versions, and the command.

The versions come from a child Python process, and the GPU from nvidia-smi, so that the process running the
table never creates a CUDA context: one held through the runs would take memory from the runs it measures
(the largest micro-batch search in particular)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Dict, List, Optional

from provenance import ROOT, source_commit

_VERSIONS = r"""
import json, platform
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
                  "python": platform.python_version()}))
"""


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_date() -> str:
    return utc_now()[:10]


def gpus() -> List[Dict[str, object]]:
    """[{name, memory_gib, driver}] of the visible NVIDIA GPUs; [] where nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    found = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            try:
                found.append({"name": parts[0], "memory_gib": round(float(parts[1]) / 1024, 2), "driver": parts[2]})
            except ValueError:
                continue
    return found


def hardware_name(gpu_list: List[Dict[str, object]]) -> str:
    """The short hardware name of result folders: `h200`, `h100`, ... for the first GPU, `cpu` without one."""
    if not gpu_list:
        return "cpu"
    name = str(gpu_list[0]["name"]).lower()
    for known in ("h200", "h100", "b200", "a100", "l40s", "l4"):
        if known in name:
            return known
    return "".join(c for c in name.replace("nvidia", "") if c.isalnum()) or "gpu"


def software_versions(python: str = sys.executable) -> Dict[str, Optional[str]]:
    try:
        out = subprocess.run([python, "-c", _VERSIONS], capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"torch": None, "cuda": None, "triton": None, "python": platform.python_version()}


def changed_files(root: str = ROOT) -> Optional[int]:
    """How many tracked files differ from the commit (results excluded); None outside a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True, cwd=root, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line[3:] and not line[3:].startswith("benchmarks/results/"))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(argv: List[str], device: str) -> Dict[str, object]:
    """The provenance record of one part: when, which code, which machine and software, which command."""
    gpu_list = gpus() if device == "cuda" else []
    return {
        "date": utc_now(),
        "commit": source_commit(),
        "changed_files": changed_files(),
        "hardware": hardware_name(gpu_list),
        "gpu": gpu_list[0] if gpu_list else None,
        "gpu_count": len(gpu_list),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        **software_versions(),
        "command": " ".join(shlex.quote(a) for a in argv),
    }
