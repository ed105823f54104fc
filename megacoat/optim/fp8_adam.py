"""Precision-aware AdamW (`--use-precision-aware-optimizer`): Adam moments in fp32, bf16 or COAT's FP8.

FP8 moments: E4M3 codes in groups of 128 contiguous elements of each parameter's own
flat range, with per group a scale s, an exponent k and a centre c (fp32). With dynamic range
expansion each group is mapped by x -> sign(x) (|x|/c)^k before scaling, so that its range fills
E4M3's; without it (`--no-optimizer-state-expansion`) k = 1, c = 1 and s = absmax / 448.

The codec works on a *flat shard*: one fp32 master tensor whose length is a multiple of 128 and
whose parameters start at multiples of 128 (padding is zero and stays zero: a zero has no effect
on the group maximum and is excluded from the group's nonzero minimum, so a parameter's last,
partial group needs no length). The shard is a list of chunks (ZeRO: one per bucket), each with
its gradient and, optionally, the bf16 weight buffer the step writes in the same pass.

`reference_step` is the specification, the CPU path and the test oracle: every fp32 operation is
a single IEEE-rounded torch op in a fixed order, which the CUDA kernel (`csrc/fused_adamw.cu`)
repeats one for one, so the two agree bit for bit on the GPU. The transcendental functions
(pow, log2, exp2) are CUDA's `powf`/`log2f`/`exp2f` on the GPU (torch's fp32 pow, log2 and exp2
call them); on the CPU they are computed in float64 and rounded, which is what CUDA's functions
return in most cases (the exact form reproduces COAT's golden codes this way on the CPU).

The expansion has two forms with the same group statistics: the exp2/log2 form, which the codec
and its kernel run (~5x fewer instructions per element), and COAT's (powf and divisions per element),
kept in the reference functions (`fast=False`) because it reproduces COAT's own codes (the golden
tests); the codes of the two are within one E4M3 step (tests/test_fp8_adam_fast.py). Checkpoints store
(codes, s, k, c) with the same meaning in both forms.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..config import round_to_fp32

GROUP = 128
FP8_MAX = 448.0
TINY = 1e-30                                   # added to the group max and nonzero min (COAT's)
K16 = float(torch.tensor(16 * math.log2(FP8_MAX * FP8_MAX / 2), dtype=torch.float32))  # 16 log2(448^2/2)
# COAT leaves k uncapped; a group whose values are (nearly) all equal has R -> 1 and k -> inf. Beyond
# ~2^10 the fp32 rounding of |x|/c, raised to the power k, approaches the E4M3 step and values near
# the group minimum collapse to 0, so k is capped. A constant or all-zero group (R = 1, k = inf)
# takes the cap; its values then quantize to +-448 (or 0) and dequantize to themselves.
K_MAX = 1024.0
K_MIN = 1.0 / 16
FORMATS = ("fp32", "bf16", "fp8")


def moment_bytes_per_element(fmt: str) -> float:
    """Bytes one Adam moment takes per element in `fmt` (fp8: the code plus fp32 s, k, c per group)."""
    return {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 12 / GROUP}[fmt]


# ------------------------------------------------------------------------------ fp32 functions
def pow32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x ** y in fp32 as CUDA's powf computes it (see module doc)."""
    if x.is_cuda:
        return torch.pow(x, y)
    return torch.pow(x.double(), y.double()).float()


FP32_MIN_NORMAL = 2.0 ** -126


def log2_32(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.log2(x)
    return torch.log2(x.double()).float()


def exp2_32(x: torch.Tensor) -> torch.Tensor:
    """2 ** x in fp32: CUDA's exp2f on the GPU, float64 rounded on the CPU (see module doc)."""
    if x.is_cuda:
        return torch.exp2(x)
    return torch.exp2(x.double()).float()


# log2 of a moment's magnitude in the fast quantizer: exponent + piecewise-linear log2 of the mantissa over
# LOG2_SEGMENTS segments (top 10 mantissa bits), interpolation error <= 1.8e-7 (below the fp32 rounding of
# log2 results beyond |2|, as log2f's own). The table is data: the kernel receives this very tensor, so both
# compute the same bits.
_SEGMENT_BITS = 10  # the mantissa's top 10 bits index the segment, the low 13 place x in it
LOG2_SEGMENTS = 1 << _SEGMENT_BITS
_LOG2_TABLES: Dict[str, torch.Tensor] = {}


def log2_table(device) -> torch.Tensor:
    """[LOG2_SEGMENTS, 2] fp32: per segment i of [1, 2), T0 = log2(1 + i / 1024) and the slope T1 =
    (T0[i + 1] - T0[i]) * 1024 per unit of the fp32 `(1 + low13 * 2^-23) - 1` (low13: the mantissa's low
    13 bits, the position inside the segment, in [0, 2^-10)), so that T0 + T1 * that interpolates linearly."""
    key = str(device)
    if key not in _LOG2_TABLES:
        i = torch.arange(LOG2_SEGMENTS + 1, dtype=torch.float64)
        t0 = torch.log2(1 + i / LOG2_SEGMENTS).float()
        t1 = ((t0[1:].double() - t0[:-1].double()) * LOG2_SEGMENTS).float()
        _LOG2_TABLES[key] = torch.stack([t0[:-1], t1], dim=1).contiguous().to(device)
    return _LOG2_TABLES[key]


def log2_lut(x: torch.Tensor) -> torch.Tensor:
    """log2|x| (fp32) as the kernel computes it: e + (T0[i] + T1[i] * f), every operation one fp32
    rounding; -inf for zeros and for denormals (|x| < 2^-126: such moments quantize to 0)."""
    b = x.view(torch.int32) & 0x7FFFFFFF
    tab = log2_table(x.device)
    seg = tab[((b >> (23 - _SEGMENT_BITS)) & (LOG2_SEGMENTS - 1)).long()]
    f = ((b & ((1 << (23 - _SEGMENT_BITS)) - 1)) | 0x3F800000).view(torch.float32) - 1.0  # low13 * 2^-23, exact
    e = ((b >> 23) - 127).float()
    lg = (seg[..., 1] * f + seg[..., 0]) + e
    return torch.where(b < 0x00800000, torch.full_like(lg, -math.inf), lg)


def _sign(x: torch.Tensor) -> torch.Tensor:
    """+1, -1 or 0 (also for -0.0): the kernel computes (x > 0) - (x < 0)."""
    return (x > 0).float() - (x < 0).float()


def group_stats(x: torch.Tensor, expand: bool):
    """Per-group (s, k, c) for x of shape [G, 128] (fp32): COAT's statistics, with the cap on k."""
    a = x.abs()
    mx = a.amax(1) + TINY
    nz = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin(1)
    mn = torch.where(torch.isinf(nz), torch.zeros_like(nz), nz) + TINY  # true nonzero minimum
    if not expand:
        one = torch.ones_like(mx)
        return mx / torch.full_like(mx, FP8_MAX), one, one.clone()
    c = torch.sqrt(mx) * torch.sqrt(mn)       # geometric centre (sqrt(mx * mn) could underflow)
    log2r = log2_32(mx / mn)                  # >= 0; 0 for constant and all-zero groups
    k = torch.floor(torch.full_like(log2r, K16) / log2r) / 16   # K16 / 0 = inf -> capped below
    # R overflows fp32 (inf, k = 0) when max/min > 3e38: take the smallest k, 1/16.
    k = torch.clamp(k, min=K_MIN, max=K_MAX)
    s = pow32(mx / c, k) / torch.full_like(mx, FP8_MAX)
    return s, k, c


def quantize_groups(x: torch.Tensor, s, k, c, expand: bool, fast: bool = False) -> torch.Tensor:
    """E4M3 codes (uint8, shape of x [G, 128]) of x under the group statistics.

    `fast` (expansion only): (|x|/c)^k / s as exp2(k log2|x| - (k log2 c + log2 s)), with log2|x| from
    `log2_lut` (a table lookup and three fp32 operations) and one exp2 per element, no division (COAT's
    form costs two divisions and a powf). Same group statistics; the code differs from the exact form only
    where the value lies within ~k * 3e-6 (relative) of a rounding boundary, and then by one E4M3 step
    (tests/test_fp8_adam_fast.py)."""
    if expand and fast:
        a = k * log2_32(c) + log2_32(s)                        # per group
        y = _sign(x) * exp2_32(k[:, None] * log2_lut(x) - a[:, None])
    elif expand:
        y = _sign(x) * pow32(x.abs() / c[:, None], k[:, None]) / s[:, None]
    else:
        y = x / s[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_groups(q: torch.Tensor, s, k, c, expand: bool, fast: bool = False) -> torch.Tensor:
    """fp32 values of codes q (uint8 [G, 128]); also works per element (s, k, c shaped like q).

    `fast`: (|q| s)^(1/k) c as exp2((log2|q| + log2 s) / k + log2 c); log2|q| takes one of 127
    values (the kernel reads it from a table), so only one exp2 per element remains."""
    per_group = s.dim() == 1 and q.dim() == 2
    s_, k_, c_ = (t[:, None] for t in (s, k, c)) if per_group else (s, k, c)
    qf = q.view(torch.float8_e4m3fn).float()
    if expand and fast:
        inv_k = torch.ones_like(k_) / k_
        e = exp2_32((log2_32(qf.abs()) + log2_32(s_)) * inv_k + log2_32(c_))
        # Results below fp32's smallest normal flushed to 0, as the kernel's exp2 (MUFU.EX2 without its
        # denormal path: 3 instructions per element and moment fewer); a moment that small is 0 to Adam.
        return _sign(qf) * e.masked_fill(e < FP32_MIN_NORMAL, 0.0)
    y = qf * s_
    if not expand:
        return y
    inv_k = torch.ones_like(k_) / k_
    return _sign(y) * pow32(y.abs(), inv_k) * c_


# ------------------------------------------------------------------------------ moment storage
class MomentState:
    """One Adam moment of a flat shard of n elements (n a multiple of 128) in one format."""

    def __init__(self, fmt: str, n: int, device, expand: bool = True, fast: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown optimizer state dtype {fmt!r}; choose one of {FORMATS}")
        if n % GROUP:
            raise ValueError(f"a flat optimizer shard must hold whole groups of {GROUP}, got {n} elements")
        self.fmt, self.n, self.expand = fmt, n, expand and fmt == "fp8"
        self.fast = fast and self.expand   # exp2/log2 form of the expansion (quantize_groups)
        if self.fast:
            log2_table(device)  # made here, not first inside a (possibly compiled) step
        g = n // GROUP
        if fmt == "fp8":
            self.data = torch.zeros(n, dtype=torch.uint8, device=device)
            # Initial state: s = 0, k = 1, c = 1 dequantizes to 0.
            self.s = torch.zeros(g, dtype=torch.float32, device=device)
            self.k = torch.ones(g, dtype=torch.float32, device=device)
            self.c = torch.ones(g, dtype=torch.float32, device=device)
        else:
            self.data = torch.zeros(n, dtype=torch.float32 if fmt == "fp32" else torch.bfloat16, device=device)
            self.s = self.k = self.c = None

    @property
    def bytes_per_element(self) -> float:
        return moment_bytes_per_element(self.fmt)

    def load(self, g0: int, g1: int) -> torch.Tensor:
        """fp32 values of groups [g0, g1) as [g1 - g0, 128]."""
        d = self.data[g0 * GROUP: g1 * GROUP].view(-1, GROUP)
        if self.fmt != "fp8":
            return d.float()
        return dequantize_groups(d, self.s[g0:g1], self.k[g0:g1], self.c[g0:g1], self.expand, self.fast)

    def store(self, g0: int, g1: int, x: torch.Tensor) -> None:
        """Store fp32 values x [g1 - g0, 128] (new group statistics for fp8)."""
        d = self.data[g0 * GROUP: g1 * GROUP].view(-1, GROUP)
        if self.fmt != "fp8":
            d.copy_(x)
            return
        s, k, c = group_stats(x, self.expand)
        d.copy_(quantize_groups(x, s, k, c, self.expand, self.fast))
        self.s[g0:g1], self.k[g0:g1], self.c[g0:g1] = s, k, c

    def tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.data, self.s, self.k, self.c) if t is not None]


# ------------------------------------------------------------------------------ the step
@dataclass
class Chunk:
    """A run of whole groups of the shard: master[start:end] is updated from `grad` (fp32 or bf16,
    the first numel <= end - start elements; the rest of the last group is padding: zero gradient)
    and, when `weight` is given (bf16, numel elements), the new weights are written into it."""

    start: int
    end: int
    grad: torch.Tensor
    weight: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        return self.grad.numel()


@dataclass
class AdamHyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def __post_init__(self):
        # Computed once here, as Python floats: under torch.compile a host tensor made inside the
        # traced step broke the graph (and compiled a CPU kernel).
        b1, b2 = round_to_fp32(self.beta1), round_to_fp32(self.beta2)
        self._scalars = {"b1": b1, "ob1": round_to_fp32(1.0 - b1), "b2": b2, "ob2": round_to_fp32(1.0 - b2),
                         "eps": round_to_fp32(self.eps), "wd": round_to_fp32(self.weight_decay)}

    def scalars(self) -> Dict[str, float]:
        """The constants as the fp32 values the reference and the kernel both use; 1 - beta is
        computed in fp32 from the fp32 beta, as COAT's kernel does (needed to reproduce it)."""
        return self._scalars


def bias_corrections(step: torch.Tensor, hp: AdamHyper):
    """(1 - b1^t, sqrt(1 - b2^t)) for t = step + 1, fp32 0-dim tensors (step counts successes)."""
    t = step.float() + 1
    one = torch.ones_like(t)
    bc1 = one - pow32(torch.full_like(t, hp.beta1), t)
    bc2 = torch.sqrt(one - pow32(torch.full_like(t, hp.beta2), t))
    return bc1, bc2


@torch.no_grad()
def reference_step(master: torch.Tensor, chunks: Sequence[Chunk], m: MomentState, v: MomentState,
                   group_decay: torch.Tensor, hp: AdamHyper, lr: float, coeff: torch.Tensor,
                   step: torch.Tensor) -> None:
    """One AdamW step (COAT's order of operations) on every chunk; the caller skips it when the
    gradient is not finite and counts the step. `group_decay` (bool, one per group) says whether
    the group's parameter has weight decay; `coeff` is the clip factor (0-dim fp32, <= 1)."""
    sc = hp.scalars()
    bc1, bc2 = bias_corrections(step, hp)
    for ch in chunks:
        g0, g1 = ch.start // GROUP, ch.end // GROUP
        p = master[ch.start: ch.end].view(-1, GROUP)
        g = ch.grad.reshape(-1).float()
        if ch.numel != ch.end - ch.start:
            g = torch.cat([g, g.new_zeros(ch.end - ch.start - ch.numel)])
        g = g.view(-1, GROUP) * coeff
        mm = m.load(g0, g1) * sc["b1"] + g * sc["ob1"]
        vv = v.load(g0, g1) * sc["b2"] + (g * sc["ob2"]) * g
        denom = (torch.sqrt(vv) / bc2 + sc["eps"]) * bc1
        wd = torch.where(group_decay[g0:g1], sc["wd"], 0.0).float()[:, None]
        update = mm / denom + p * wd
        p.copy_(p - update * lr)
        m.store(g0, g1, mm)
        v.store(g0, g1, vv)
        if ch.weight is not None:
            ch.weight.view(-1).copy_(p.view(-1)[: ch.numel])


def clip_factor(norm: torch.Tensor, clip_grad: float) -> torch.Tensor:
    """Megatron's clip coefficient min(1, clip / (norm + 1e-6)) on the device (1 when disabled or
    when the norm is not finite: that step is skipped anyway)."""
    if clip_grad <= 0:
        return torch.ones((), dtype=torch.float32, device=norm.device)
    coeff = torch.clamp(clip_grad / (norm.float() + 1e-6), max=1.0)
    return torch.nan_to_num(coeff, nan=1.0, posinf=1.0, neginf=1.0)


# ------------------------------------------------------------------------------ configuration
def choose_state_formats(cfg, device) -> Optional[tuple]:
    """(exp_avg format, exp_avg_sq format, expansion) for the flat codec, or None: torch's AdamW
    (`adamw.Fp32AdamW`) with fp32 moments. Without --use-precision-aware-optimizer the flat codec
    runs with fp32 moments where the fused kernel exists (it writes the bf16 weights in the same
    pass, saving the separate master -> bf16 copy)."""
    if cfg.use_precision_aware_optimizer:
        return cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype, cfg.optimizer_state_expansion
    if torch.device(device).type == "cuda" and fused_extension() is not None:
        return "fp32", "fp32", True
    return None


def decay_table(spans, n: int, device) -> torch.Tensor:
    """Per group of a flat shard of n elements: True where weight decay applies. `spans` are
    (shard offset, numel, decays) per parameter piece; pieces start at multiples of 128."""
    table = torch.zeros(n // GROUP, dtype=torch.bool)
    for offset, numel, decays in spans:
        if offset % GROUP:
            raise ValueError(f"parameter piece at shard offset {offset} does not start a group of {GROUP}")
        table[offset // GROUP: (offset + numel + GROUP - 1) // GROUP] = bool(decays)
    return table.to(device)


def round_up_group(n: int) -> int:
    return (n + GROUP - 1) // GROUP * GROUP


# ------------------------------------------------------------------------------ the kernel
# The kernel's moment formats (csrc/fused_adamw.h, Format); FP8 with expansion is 4 (the exp2/log2 form: COAT's
# powf form, 3, exists only in the reference). Each format runs one configuration of the kernel (ConfigFor in
# csrc/fused_adamw.cu): fp32 and bf16 moments equal the reference bit for bit, FP8 moments too except for the
# master and the bf16 weights, whose update uses the hardware's approximate sqrt and reciprocal (within 1e-6).
FORMAT_CODE = {"fp32": 0, "bf16": 1, "fp8": 2}
FP8_EXPAND_CODE = 4


def _format_code(ms: MomentState) -> Optional[int]:
    """The kernel's format code of a moment, None for one the kernel does not run (COAT's powf form)."""
    if ms.expand:
        return FP8_EXPAND_CODE if ms.fast else None
    return FORMAT_CODE[ms.fmt]


def fused_extension():
    """The compiled `csrc/fused_adamw.cu`, or None (then the reference runs; one warning)."""
    from ..kernels.cuda_ext import load_extension
    return load_extension("fused_adamw")


def kernel_supports(m: MomentState, v: MomentState, chunks: Sequence[Chunk]) -> bool:
    """The kernel handles equal formats of both moments, fp32/bf16 gradients and bf16 weights."""
    if _format_code(m) is None or _format_code(m) != _format_code(v) or not chunks:
        return False
    grads = {c.grad.dtype for c in chunks}
    weights = {c.weight.dtype for c in chunks if c.weight is not None}
    return len(grads) == 1 and grads <= {torch.float32, torch.bfloat16} and weights <= {torch.bfloat16}


def chunk_table(chunks: Sequence[Chunk], device) -> torch.Tensor:
    """int64 [4, nchunks + 1] for the kernel: group starts, gradient and weight addresses, element
    counts. Rebuilt every step (a released gradient bucket gets a new address when re-allocated);
    copied without a host wait."""
    n = len(chunks)
    rows = [[c.start // GROUP for c in chunks] + [chunks[-1].end // GROUP],
            [c.grad.data_ptr() for c in chunks] + [0],
            [0 if c.weight is None else c.weight.data_ptr() for c in chunks] + [0],
            [c.numel for c in chunks] + [0]]
    for i, c in enumerate(chunks):
        if c.start % GROUP or c.end % GROUP or (i and chunks[i - 1].end != c.start) or c.numel > c.end - c.start \
                or not c.grad.is_contiguous() or (c.weight is not None and c.weight.numel() != c.numel):
            raise ValueError("chunks must tile the shard in whole groups, with contiguous gradients")
    del n
    host = torch.tensor(rows, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if torch.cuda.is_available() else host.to(device)


class PrecisionAwareAdamW:
    """The flat-shard state codec: AdamW with moments in fp32, bf16 or FP8 (per moment).

    `step()` runs the fused CUDA kernel when it is available (one launch for the whole shard; the
    clip factor, the skip flag and the step count are read on the device), else the reference
    (compiled with torch.compile on the GPU). It also writes the chunks' bf16 weights.

    FP8 moments with expansion are kept in the exp2/log2 form (quantize_groups with fast=True).
    """

    name = "precision-aware"

    def __init__(self, master: torch.Tensor, chunks: Sequence[Chunk], group_decay: torch.Tensor,
                 cfg, m_fmt: str = "fp32", v_fmt: str = "fp32", expand: bool = True, use_kernel: Optional[bool] = None):
        self.master, self.chunks, self.cfg = master, list(chunks), cfg
        self.group_decay = group_decay
        self.hp = AdamHyper(cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay)
        n, dev = master.numel(), master.device
        self.m = MomentState(m_fmt, n, dev, expand, fast=True)
        self.v = MomentState(v_fmt, n, dev, expand, fast=True)
        self.step_count = torch.zeros((), dtype=torch.float32, device=dev)
        self.ext = None
        if dev.type == "cuda" and use_kernel is not False and kernel_supports(self.m, self.v, self.chunks):
            self.ext = fused_extension()
        self._compiled = None
        self._incoming = None  # fp32 moments being loaded from a checkpoint of another format

    @property
    def writes_weights(self) -> bool:
        return any(c.weight is not None for c in self.chunks)

    @property
    def bytes_per_element(self) -> float:
        return self.m.bytes_per_element + self.v.bytes_per_element

    def formats(self) -> str:
        def one(ms):
            return ms.fmt + ("+expand" + ("(exp2)" if ms.fast else "") if ms.expand else "") if ms.fmt == "fp8" else ms.fmt
        return f"exp_avg {one(self.m)}, exp_avg_sq {one(self.v)}"

    @torch.no_grad()
    def step(self, lr: float, norm: torch.Tensor, scale_grads=None) -> torch.Tensor:
        """One step; returns success (bool 0-dim tensor, False when the gradient is not finite)."""
        coeff = clip_factor(norm, self.cfg.clip_grad)
        found_inf = (~torch.isfinite(norm)).float()
        if self.ext is not None:
            self._launch(lr, coeff, found_inf)
        elif self.master.is_cuda:
            self._device_reference(lr, coeff, found_inf)
        else:
            if found_inf.item():
                return torch.tensor(False)
            reference_step(self.master, self.chunks, self.m, self.v, self.group_decay, self.hp, lr, coeff,
                           self.step_count)
        self.step_count.add_(1 - found_inf)
        return found_inf == 0

    def _launch(self, lr, coeff, found_inf) -> None:
        sc = self.hp.scalars()
        m, v = self.m, self.v
        empty = torch.empty(0, dtype=torch.float32, device=self.master.device)
        opt = [t if t is not None else empty for t in (m.s, m.k, m.c, v.s, v.k, v.c)]
        self.ext.adamw_step(
            self.master, chunk_table(self.chunks, self.master.device),
            int(self.chunks[0].grad.dtype == torch.bfloat16), self.group_decay,
            m.data, opt[0], opt[1], opt[2], v.data, opt[3], opt[4], opt[5],
            _format_code(m), self.step_count, found_inf, coeff,
            float(lr), sc["b1"], sc["ob1"], sc["b2"], sc["ob2"], sc["eps"], sc["wd"], K16, K_MAX, TINY,
            log2_table(self.master.device))

    def _device_reference(self, lr, coeff, found_inf) -> None:
        """GPU without the kernel: the reference on copies, kept only when the step is not skipped
        (torch.where on the device: the host never waits)."""
        if self._compiled is None:
            warnings.warn("megacoat: the fused AdamW kernel is not available for these state formats or "
                          "this build: running the PyTorch reference (compiled)", stacklevel=3)
            self._compiled = _maybe_compile(_reference_with_skip)
        # lr as a device tensor: a changing Python float would recompile the graph every step.
        lr = torch.full((), float(lr), dtype=torch.float32, device=self.master.device)
        try:
            self._compiled(self, lr, coeff, found_inf)
        except Exception as e:  # noqa: BLE001 - a compiler failure must leave the eager reference running
            if self._compiled is _reference_with_skip:
                raise
            warnings.warn(f"megacoat: torch.compile of the AdamW reference failed ({type(e).__name__}); eager",
                          stacklevel=3)
            self._compiled = _reference_with_skip
            self._compiled(self, lr, coeff, found_inf)

    def conversion_states(self, a: int, b: int) -> Dict[str, torch.Tensor]:
        """fp32 per-element moments [a, b) to load a checkpoint of another state format into;
        after_load() re-encodes them in this codec's formats."""
        if self._incoming is None:
            n, dev = self.master.numel(), self.master.device
            self._incoming = (torch.zeros(n, device=dev), torch.zeros(n, device=dev))
        return {"exp_avg": self._incoming[0][a:b], "exp_avg_sq": self._incoming[1][a:b]}

    @torch.no_grad()
    def after_load(self) -> None:
        """Re-encode moments loaded through conversion_states (in slices: bounded temporaries)."""
        if self._incoming is None:
            return
        groups, step = self.master.numel() // GROUP, 1 << 18
        for ms, x in zip((self.m, self.v), self._incoming):
            for g0 in range(0, groups, step):
                g1 = min(groups, g0 + step)
                ms.store(g0, g1, x[g0 * GROUP: g1 * GROUP].view(-1, GROUP))
        self._incoming = None

    # ------------------------------------------------------------------ checkpoint interface
    def range_states(self, a: int, b: int):
        """Checkpoint views of shard elements [a, b) (a at a group start): per-element tensors, and
        per-group tensors (groups [a / 128, ceil(b / 128))) for FP8 moments."""
        elem, groups = {}, {}
        ga, gb = a // GROUP, (b + GROUP - 1) // GROUP
        for name, ms in (("exp_avg", self.m), ("exp_avg_sq", self.v)):
            if ms.fmt != "fp8":
                elem[name] = ms.data[a:b]
                continue
            elem[name + ".fp8"] = ms.data[a:b]
            groups[name + ".scale"] = ms.s[ga:gb]
            groups[name + ".exponent"] = ms.k[ga:gb]
            groups[name + ".centre"] = ms.c[ga:gb]
        return elem, groups

    def scalar_state(self) -> dict:
        return {"adam_step": float(self.step_count)}

    def load_scalar_state(self, d: dict) -> None:
        self.step_count.fill_(d["adam_step"])


def _reference_with_skip(codec: PrecisionAwareAdamW, lr, coeff, found_inf) -> None:
    state = [codec.master] + codec.m.tensors() + codec.v.tensors() + \
        [c.weight for c in codec.chunks if c.weight is not None]
    saved = [t.clone() for t in state]
    reference_step(codec.master, codec.chunks, codec.m, codec.v, codec.group_decay, codec.hp, lr, coeff,
                   codec.step_count)
    skip = found_inf > 0
    for t, old in zip(state, saved):
        t.copy_(torch.where(skip, old, t))


def _maybe_compile(fn, fullgraph: bool = False):
    try:
        return torch.compile(fn, dynamic=False, fullgraph=fullgraph)
    except Exception:  # noqa: BLE001 - no compiler: eager reference
        return fn
