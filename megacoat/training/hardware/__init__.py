"""Machine descriptions for the step-time model (`training/step_time.py`): one JSON file per machine.

A file holds the machine's measured primitive rates, each with a `source` naming the result file or benchmark
that measured it:
- `memory_gib`, `reserved_gib`: memory per GPU and what the process cannot allocate (CUDA context, workspaces);
- `peak_tflops`: the datasheet's dense peak per format (MFU's denominator);
- `gemm`: per format (`bf16`, `fp8`), a table of measured GEMMs `[m, n, k, tflops]` (C[m, n] = A[m, k] B[k, n]);
  a GEMM's rate is interpolated in log(FLOPs) between the table's sizes, clamped at its ends, and never faster
  than its operands' bytes over `bandwidth_GBps.hbm_copy`;
- `attention`: achieved TFLOP/s of the fused attention forward and backward (FLOPs counted as model/flops.py:
  causal, 2 * seq * width per token forward, twice that backward);
- `bandwidth_GBps`: `hbm_copy` (a device copy), `elementwise` (the fused pointwise / norm kernels of a layer,
  bytes they move over their time), `cast` (FP8 casts and amax passes);
- `optimizer_ms_per_256M`: the fused AdamW step over 256M elements per moment format and gradient dtype;
- `sdp4bit_ms_per_256M`: SDP4Bit's quantization kernels over 256M elements;
- `host`: `launch_us` (host time to enqueue one kernel of a compiled layer), `kernel_gap_us` (GPU idle between
  two queued kernels);
- `links`: `intra_node` and `inter_node`, each `bus_GBps` (NCCL bus bandwidth per GPU: bytes one rank sends in
  a ring collective over its time), `latency_us` (per ring step or message) and `overlap` (the share of a
  transfer's time that does not slow the compute it overlaps: NCCL's kernels share the GPU's SMs and memory).

`load_hardware("h200")` reads the file shipped here; `load_hardware("path/to.json")` any other; both validate
it (a missing key or a non-positive number is a ConfigError naming the file and the key).
`benchmarks/calibrate.py` measures a machine and writes its file.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ...config import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
GEMM_FORMATS = ("bf16", "fp8")
BANDWIDTHS = ("hbm_copy", "elementwise", "cast")
OPTIMIZER_FORMATS = ("fp32", "bf16", "fp8")
GRAD_DTYPES = ("fp32", "bf16")
SDP4BIT_KERNELS = ("tlq_encode", "tlq_reduce_requantize", "tlq_reduce_decode", "qwd_encode", "qwd_apply")
LINK_CLASSES = ("intra_node", "inter_node")
GBPS_PER_GBYTE = 8.0  # --inter-node-gbps is in Gb/s (bits), the file's bus_GBps in GB/s


@dataclass(frozen=True)
class Link:
    bus_GBps: float
    latency_us: float
    overlap: float = 1.0  # share of an overlapped transfer's time that does not slow the compute beside it

    def seconds(self, nbytes: float, steps: int) -> float:
        """A collective in which this rank sends `nbytes` in `steps` dependent messages over this link."""
        return nbytes / (self.bus_GBps * 1e9) + steps * self.latency_us * 1e-6


@dataclass
class GemmTable:
    """Measured GEMMs of one format, sorted by FLOPs: rates interpolated in log(FLOPs)."""

    log_flops: List[float]
    tflops: List[float]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float]]) -> "GemmTable":
        by_size: Dict[float, List[float]] = {}
        for m, n, k, rate in rows:
            by_size.setdefault(2.0 * m * n * k, []).append(rate)
        sizes = sorted(by_size)
        return cls([math.log(s) for s in sizes], [sum(by_size[s]) / len(by_size[s]) for s in sizes])

    def rate(self, flops: float) -> float:
        x = math.log(max(flops, 1.0))
        i = bisect.bisect_left(self.log_flops, x)
        if i == 0:
            return self.tflops[0]
        if i == len(self.log_flops):
            return self.tflops[-1]
        x0, x1 = self.log_flops[i - 1], self.log_flops[i]
        w = (x - x0) / (x1 - x0)
        return self.tflops[i - 1] * (1 - w) + self.tflops[i] * w


@dataclass
class Hardware:
    name: str
    path: str
    memory_gib: float
    reserved_gib: float
    peak_tflops: Dict[str, float]
    gemm: Dict[str, GemmTable]
    attention_tflops: Dict[str, float]       # "forward", "backward"
    bandwidth_GBps: Dict[str, float]
    optimizer_ms_per_256M: Dict[str, Dict[str, float]]   # moment format -> gradient dtype -> ms
    sdp4bit_ms_per_256M: Dict[str, float]
    launch_us: float
    kernel_gap_us: float
    links: Dict[str, Link]
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def usable_bytes(self) -> float:
        """GPU memory the process can allocate."""
        return (self.memory_gib - self.reserved_gib) * 2**30

    def gemm_seconds(self, fmt: str, m: int, n: int, k: int) -> float:
        """One GEMM C[m, n] = A[m, k] B[k, n] in format `fmt` (bf16 or fp8)."""
        flops = 2.0 * m * n * k
        if flops <= 0:
            return 0.0
        operand = 1 if fmt == "fp8" else 2
        nbytes = operand * (m * k + k * n) + 2 * m * n
        return max(flops / (self.gemm[fmt].rate(flops) * 1e12), nbytes / (self.bandwidth_GBps["hbm_copy"] * 1e9))

    def memory_seconds(self, nbytes: float, kind: str = "elementwise") -> float:
        return nbytes / (self.bandwidth_GBps[kind] * 1e9)

    def optimizer_seconds(self, elements: int, moments: str, grad_dtype: str) -> float:
        return elements / 2**28 * self.optimizer_ms_per_256M[moments][grad_dtype] * 1e-3

    def with_inter_node_gbps(self, gbps: Optional[float]) -> "Hardware":
        """This machine with its inter-node link set by hand (Gb/s per GPU, as --inter-node-gbps)."""
        check_inter_node_gbps(gbps)
        if gbps is None:
            return self
        links = dict(self.links)
        links["inter_node"] = dataclasses.replace(self.links["inter_node"], bus_GBps=gbps / GBPS_PER_GBYTE)
        return Hardware(**{**self.__dict__, "links": links})


def check_inter_node_gbps(gbps: Optional[float]) -> None:
    """--inter-node-gbps (None: the file's link) must be a positive finite Gb/s per GPU; raises ConfigError."""
    if gbps is not None and not (math.isfinite(gbps) and gbps > 0):
        raise ConfigError(f"--inter-node-gbps {gbps} must be > 0 and finite (Gb/s per GPU, e.g. 400).")


def available() -> List[str]:
    """Names of the machine files shipped with megacoat."""
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".json"))


def resolve_path(name_or_path: str) -> str:
    if os.path.sep in name_or_path or name_or_path.endswith(".json"):
        return name_or_path
    return os.path.join(HERE, f"{name_or_path}.json")


def load_hardware(name_or_path: str = "h200", inter_node_gbps: Optional[float] = None) -> Hardware:
    """The machine of `--hardware NAME|FILE` (NAME: a file shipped here), validated; raises ConfigError."""
    if not name_or_path.strip():
        raise ConfigError(f"--hardware is empty: give one of: {', '.join(available())}, or a JSON file written by "
                          "benchmarks/calibrate.py.")
    path = resolve_path(name_or_path)
    if not os.path.exists(path):
        raise ConfigError(f"--hardware {name_or_path}: no such machine file ({path}); give a JSON file written by "
                          f"benchmarks/calibrate.py or one of: {', '.join(available())}.")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hardware {name_or_path}: {path} is not readable JSON ({e}).") from e
    return parse_hardware(raw, path).with_inter_node_gbps(inter_node_gbps)


def _is_number(v, allow_zero: bool = False) -> bool:
    """A finite JSON number (not a bool), > 0 or >= 0; an integer too large for a float is none."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        v = float(v)
    except OverflowError:
        return False
    return math.isfinite(v) and (v >= 0 if allow_zero else v > 0)


class _Reader:
    """Typed access into the file with one-line errors naming the file and the key."""

    def __init__(self, raw: dict, path: str):
        self.raw, self.path = raw, path

    def fail(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"machine file {self.path}: {key} {what} (see megacoat/training/hardware/h200.json "
                           "for the format; benchmarks/calibrate.py writes one).")

    def get(self, *keys: str):
        node = self.raw
        for i, k in enumerate(keys):
            if not isinstance(node, dict) or k not in node:
                raise self.fail(".".join(keys[:i + 1]), "is missing")
            node = node[k]
        return node

    def number(self, *keys: str, allow_zero: bool = False) -> float:
        v = self.get(*keys)
        if not _is_number(v, allow_zero):
            raise self.fail(".".join(keys), f"must be a {'non-negative' if allow_zero else 'positive'} number, "
                                            f"got {v!r}")
        return float(v)

    def fraction(self, *keys: str) -> float:
        v = self.number(*keys, allow_zero=True)
        if v > 1:
            raise self.fail(".".join(keys), f"must be a fraction in [0, 1], got {v!r}")
        return v

    def gemm_rows(self, fmt: str) -> List[Tuple[float, ...]]:
        rows = self.get("gemm", fmt)
        if not isinstance(rows, list) or not rows:
            raise self.fail(f"gemm.{fmt}", "must be a non-empty list of [m, n, k, tflops]")
        out = []
        for i, row in enumerate(rows):
            mnk = row.get("mnk") if isinstance(row, dict) else None
            vals = (mnk + [row.get("tflops")] if isinstance(mnk, list) else None) if isinstance(row, dict) else row
            if not (isinstance(vals, list) and len(vals) == 4 and all(_is_number(v) for v in vals)):
                raise self.fail(f"gemm.{fmt}[{i}]", f"must be four positive numbers [m, n, k, tflops], got {row!r}")
            out.append(tuple(float(v) for v in vals))
        return out


# A message's latency beyond a second is a typo (milliseconds for microseconds, say); left in, its products
# overflow to NaN and the step's parts drop out of the prediction instead of dominating it.
MAX_LATENCY_US = 1e6


def _latency_us(r, link_class: str) -> float:
    v = r.number("links", link_class, "latency_us", allow_zero=True)
    if v > MAX_LATENCY_US:
        raise r.fail(f"links.{link_class}.latency_us", f"must be at most {MAX_LATENCY_US:.0e} (one second per "
                                                        f"message), got {v!r}")
    return v


def parse_hardware(raw: dict, path: str = "<dict>") -> Hardware:
    if not isinstance(raw, dict):
        raise ConfigError(f"machine file {path}: expected a JSON object.")
    r = _Reader(raw, path)
    if not isinstance(raw.get("name", ""), str):
        raise r.fail("name", f"must be a string, got {raw['name']!r}")
    memory = r.number("memory_gib")
    reserved = r.number("reserved_gib", allow_zero=True)
    if reserved >= memory:
        raise r.fail("reserved_gib", f"({reserved}) must be less than memory_gib ({memory})")
    return Hardware(
        name=str(raw.get("name", os.path.basename(path))), path=path, memory_gib=memory, reserved_gib=reserved,
        peak_tflops={f: r.number("peak_tflops", f) for f in GEMM_FORMATS},
        gemm={f: GemmTable.from_rows(r.gemm_rows(f)) for f in GEMM_FORMATS},
        attention_tflops={d: r.number("attention", f"{d}_tflops") for d in ("forward", "backward")},
        bandwidth_GBps={b: r.number("bandwidth_GBps", b) for b in BANDWIDTHS},
        optimizer_ms_per_256M={m: {g: r.number("optimizer_ms_per_256M", m, g) for g in GRAD_DTYPES}
                               for m in OPTIMIZER_FORMATS},
        sdp4bit_ms_per_256M={k: r.number("sdp4bit_ms_per_256M", k) for k in SDP4BIT_KERNELS},
        launch_us=r.number("host", "launch_us"), kernel_gap_us=r.number("host", "kernel_gap_us", allow_zero=True),
        links={c: Link(r.number("links", c, "bus_GBps"), _latency_us(r, c), r.fraction("links", c, "overlap"))
               for c in LINK_CLASSES},
        raw=raw)
