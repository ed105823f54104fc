"""SDP4Bit's codecs: the one int-k group quantizer, the 32-point Hadamard transform, packing, and
the fused operations of qWD and TLq-HS built from them. Plain torch: these are the specification,
the CPU path and the test oracle of the Triton kernels (`megacoat.kernels.sdp4bit`), which the
public functions at the bottom call instead when they can run (CUDA tensors, Triton present).

Quantizer (k = 4 or 8, qmax = 2^(k-1) - 1), per group of G contiguous elements:
    amax  = max |x|, taken over the fp32 bit patterns with the sign cleared (they order like |x|;
            a pattern >= 0x7F800000 is Inf/NaN: the group gets scale NaN and q = 0, so it
            dequantizes to NaN and the optimizer's non-finite check fires)
    a group with amax < 2^-96 is sent as zeros with scale 1 (keeps qmax / amax finite)
    scale = amax / qmax   (fp32, IEEE division),   inv = qmax / amax
    q     = floor(x * inv + u), computed exactly (the product and the sum unrounded: one fma rounded
            toward -inf, then floor); |x * inv| <= qmax (1 + 2^-24) and 2^-17 <= u <= 1 - 2^-17 keep
            q in [-qmax, qmax] without a clamp
    u     = stochastic offset in (0, 1): (bits16 + 1/2) / 2^16, carried as the fp32 f = 1 + u whose
            mantissa bits 7..22 are bits16 (so q = floor(x * inv + f) - 1). bits16: 16 bits of a
            counter-based hash; one 32-bit hash of pair p = e // 2 serves elements 2p (low half) and
            2p + 1 (high half). Hash input: (((p >> 4) ^ k1) + k2) << 4 | (p & 15) (mod 2^32): the 16
            pairs of 32 aligned elements share all but the low 4 bits, which a kernel computes once.
            P(round up) = frac(x * inv) to 2^-16: unbiased, reproducible on any device.
Dequantize: q * scale (fp32). Codes are stored as q + 2^(k-1): one byte each (k = 8) or two per
byte (k = 4: element 2i in the low nibble).

Message: the codes of n elements, then their n/G fp32 scales as bytes: ONE uint8 tensor of
`message_bytes(n, k, G)` bytes per destination, so that a hop is one collective.

Hadamard: unnormalised Sylvester H (entries +-1) on every 32 consecutive elements, computed as
five butterfly stages h = 1, 2, 4, 8, 16 (x_i, x_i+h) -> (x_i + x_i+h, x_i - x_i+h); H H = 32 I,
so the inverse is H x / 32. The butterfly order is part of the specification (the kernels follow it).
"""
from __future__ import annotations

from typing import Tuple

import torch

from ..kernels import sdp4bit as _kernels

M32 = 0xFFFFFFFF
HASH_C1, HASH_C2 = _kernels.HASH_C1, _kernels.HASH_C2
MIN_AMAX = _kernels.MIN_AMAX
MIN_AMAX_BITS = 0x0F800000  # fp32 bits of MIN_AMAX = 2^-96
INF_BITS, ONE_BITS = 0x7F800000, 0x3F800000
HADAMARD_BLOCK = 32
Key = Tuple[int, int]


# ------------------------------------------------------------------------------ random numbers
def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * HASH_C1) & M32
    x ^= x >> 15
    x = (x * HASH_C2) & M32
    return x ^ (x >> 16)


def derive_key(*ids: int) -> Key:
    """A stream key from integers such as (seed, round, rank, bucket, slice, hop).

    Two 31-bit words with bit 30 set (kernels take them as int32 arguments that never
    specialise to constants)."""
    h1, h2 = 0x3C6EF372, 0x1B873593
    for v in ids:
        v = int(v) & 0xFFFFFFFFFFFFFFFF
        for part in (v & M32, v >> 32):
            h1 = _mix32_int(h1 ^ part)
            h2 = _mix32_int((h2 + part + 0x9E3779B9) & M32)
    return (h1 & 0x3FFFFFFF) | 0x40000000, (h2 & 0x3FFFFFFF) | 0x40000000


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' uint32 hash on int64 tensors holding uint32 values (products stay < 2^63)."""
    x = x ^ (x >> 16)
    x = (x * HASH_C1) & M32
    x = x ^ (x >> 15)
    x = (x * HASH_C2) & M32
    return x ^ (x >> 16)


def hash_inputs(p: torch.Tensor, key: Key) -> torch.Tensor:
    """The 32-bit hash input of pair indices p (int64 holding uint32 values): the pair's 16-pair block
    mixed with the key in the upper 28 bits, its position in the block in the low 4."""
    return ((((((p >> 4) ^ key[0]) + key[1]) << 4) | (p & 15)) & M32)


def rounding_offsets(idx: torch.Tensor, key: Key) -> torch.Tensor:
    """f = 1 + u (fp32 in (1, 2), exact multiples of 2^-17) with u the stochastic-rounding offsets in
    (0, 1) of the elements with stream indices `idx` (int64): 16 bits each, two elements per hash."""
    h = _mix32(hash_inputs((idx >> 1) & M32, key))
    bits16 = (h >> ((idx & 1) * 16)) & 0xFFFF
    return ((bits16 << 7) | 0x3F800040).to(torch.int32).view(torch.float32)  # 1 + (bits16 + 1/2) / 2^16


def floor_of_fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """floor(x * y + z) of fp32 tensors, exactly (int64): the product is exact in float64 (24 + 24 bits),
    the sum's rounding error is recovered by TwoSum, and only a sum that rounded UP onto an integer
    moves the floor (then the error is negative). The kernels get the same integer from one fma
    rounded toward -inf."""
    t = x.double() * y.double()
    c = z.double()
    s = t + c
    b = s - t  # TwoSum (Knuth): s + err == t + c exactly
    err = (t - (s - b)) + (c - b)
    f = torch.floor(s)
    return (f - ((s == f) & (err < 0)).double()).to(torch.int64)


# ------------------------------------------------------------------------------------- Hadamard
def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised 32-point Sylvester Hadamard transform of every 32 consecutive elements (fp32)."""
    if x.numel() % HADAMARD_BLOCK:
        raise ValueError(f"the Hadamard transform works on blocks of 32 elements; got {x.numel()} elements")
    y = x.float().reshape(-1, HADAMARD_BLOCK)
    h = 1
    while h < HADAMARD_BLOCK:
        v = y.view(-1, HADAMARD_BLOCK // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, HADAMARD_BLOCK)
        h *= 2
    return y.view(x.shape)


def inverse_hadamard32(x: torch.Tensor) -> torch.Tensor:
    return hadamard32(x) * (1.0 / HADAMARD_BLOCK)


# ------------------------------------------------------------------------------------ quantizer
def qmax_of(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"the int-k quantizer supports 4 or 8 bits, got {bits}")
    return (1 << (bits - 1)) - 1


def quantize_groups(x: torch.Tensor, idx: torch.Tensor, key: Key, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [groups, G] fp32, idx [groups, G] int64 element indices -> (q int32 [groups, G], scale fp32 [groups])."""
    qmax = qmax_of(bits)
    x = x.float().contiguous()
    amax_b = (x.view(torch.int32) & 0x7FFFFFFF).amax(dim=1)
    bad = amax_b >= INF_BITS
    pos = (amax_b >= MIN_AMAX_BITS) & ~bad
    amax = torch.where(pos, amax_b, torch.full_like(amax_b, ONE_BITS)).view(torch.float32)
    qm = torch.full_like(amax, float(qmax))
    scale = torch.where(pos, amax / qm, torch.ones_like(amax))
    inv = torch.where(pos, qm / amax, torch.zeros_like(amax))
    q = (floor_of_fma(x, inv[:, None].expand_as(x), rounding_offsets(idx, key)) - 1).to(torch.int32)
    q = q.clamp(-qmax, qmax)  # never active (see the module doc); kept as a guard
    q = torch.where(bad[:, None], torch.zeros_like(q), q)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return q, scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """q [..., n] int, scale [..., n/G] -> fp32 [..., n]."""
    s = scale.repeat_interleave(group, dim=-1)
    return q.to(torch.float32) * s


# ---------------------------------------------------------------------------------- messages
def message_bytes(n: int, bits: int, group: int) -> int:
    """Bytes of one message of n elements (codes, then fp32 scales)."""
    if n % group or group % 8:
        raise ValueError(f"a message holds whole groups: {n} elements, groups of {group}")
    return n * bits // 8 + 4 * (n // group)


def bits_per_element(bits: int, group: int) -> float:
    return bits + 32.0 / group


def write_messages(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bits: int) -> None:
    """out uint8 [B, M]; q int32 [B, n]; scale fp32 [B, n/G]."""
    n = q.shape[-1]
    nb = n * bits // 8
    c = (q + (1 << (bits - 1))).to(torch.uint8)
    if bits == 4:
        c = c.view(q.shape[0], n // 2, 2)
        c = c[..., 0] | (c[..., 1] << 4)
    out[:, :nb] = c
    out[:, nb:] = scale.contiguous().view(torch.uint8).view(q.shape[0], -1)


def read_messages(msgs: torch.Tensor, n: int, bits: int, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """msgs uint8 [B, M] -> (q int32 [B, n], scale fp32 [B, n/G])."""
    nb = n * bits // 8
    c = msgs[:, :nb].to(torch.int32)
    if bits == 4:
        c = torch.stack((c & 15, c >> 4), dim=-1).view(msgs.shape[0], n)
    scale = msgs[:, nb:].contiguous().view(torch.float32)
    return c - (1 << (bits - 1)), scale


def _sum_dequantized(msgs: torch.Tensor, n: int, bits: int, group: int) -> torch.Tensor:
    q, s = read_messages(msgs, n, bits, group)
    deq = dequantize_groups(q, s, group)
    acc = torch.zeros(n, dtype=torch.float32, device=msgs.device)
    for i in range(msgs.shape[0]):  # fixed order: the kernels add sources in the same order
        acc = acc + deq[i]
    return acc


# ------------------------------------------------------------------- fused operations (references)
def encode_partitioned_reference(src: torch.Tensor, out: torch.Tensor, shard_size: int, slice_off: int,
                                 slice_len: int, ndest: int, nblocks: int, bits: int, group: int, hadamard: bool,
                                 key: Key) -> None:
    """TLq-HS first hop: [Hadamard +] quantize + pack one slice of a bucket in partition order.

    The bucket `src` holds ndest * nblocks shards of `shard_size`. Destination d gets, for b = 0..
    nblocks-1, elements [slice_off, slice_off + slice_len) of shard b * ndest + d, in that order, as
    one message: out[d] (uint8 [ndest, message_bytes(nblocks * slice_len, bits, group)]). Random
    stream indices: the position in partition order (d, b, offset).
    """
    n = nblocks * slice_len
    x = src.view(nblocks, ndest, shard_size)[:, :, slice_off: slice_off + slice_len]
    x = x.permute(1, 0, 2).reshape(ndest, n).float()
    if hadamard:
        x = hadamard32(x)
    idx = torch.arange(ndest * n, device=src.device, dtype=torch.int64).view(-1, group)
    q, s = quantize_groups(x.reshape(-1, group), idx, key, bits)
    write_messages(out, q.view(ndest, n), s.view(ndest, n // group), bits)


def reduce_requantize_reference(msgs: torch.Tensor, out: torch.Tensor, n: int, bits_in: int, group_in: int,
                                bits_out: int, group_out: int, ndest: int, key: Key) -> None:
    """TLq-HS between hops: sum the dequantized messages msgs[s] (n elements each) in fp32, requantize,
    split into ndest messages of n / ndest elements: out uint8 [ndest, M_out]. Stream index: element."""
    acc = _sum_dequantized(msgs, n, bits_in, group_in)
    idx = torch.arange(n, device=msgs.device, dtype=torch.int64).view(-1, group_out)
    q, s = quantize_groups(acc.view(-1, group_out), idx, key, bits_out)
    write_messages(out, q.view(ndest, n // ndest), s.view(ndest, -1), bits_out)


def reduce_decode_reference(msgs: torch.Tensor, out: torch.Tensor, n: int, bits: int, group: int, hadamard: bool,
                            scale: float) -> None:
    """TLq-HS last hop: out (n elements, fp32 or bf16) = [H] (sum of dequantized messages) * scale.

    With the forward Hadamard applied first, scale = 1 / (32 * dp) gives the inverse transform and
    the DP mean at once. `scale` must be an fp32 number (round it with `config.round_to_fp32`)."""
    acc = _sum_dequantized(msgs, n, bits, group)
    if hadamard:
        acc = hadamard32(acc)
    out.copy_((acc * scale).to(out.dtype))


def encode_delta_reference(master: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, bits: int, group: int,
                           key: Key, directly: bool) -> None:
    """qWD: quantize + pack delta = weight_dtype(master) - weights (or weight_dtype(master) itself
    with `directly`, the ablation) into one message out (uint8 [M]). Stream index: element."""
    x = master.to(weights.dtype).float()
    if not directly:
        x = x - weights.float()
    n = x.numel()
    idx = torch.arange(n, device=x.device, dtype=torch.int64).view(-1, group)
    q, s = quantize_groups(x.view(-1, group), idx, key, bits)
    write_messages(out.view(1, -1), q.view(1, n), s.view(1, -1), bits)


def apply_delta_reference(msgs: torch.Tensor, weights: torch.Tensor, bits: int, group: int, directly: bool) -> None:
    """qWD: weights (nsrc * n elements) chunk s += dequant(msgs[s]), rounded to the weight dtype
    (fp32 addition); with `directly` chunk s = dequant(msgs[s])."""
    nsrc = msgs.shape[0]
    n = weights.numel() // nsrc
    q, s = read_messages(msgs, n, bits, group)
    deq = dequantize_groups(q, s, group)
    w = weights.view(nsrc, n)
    w.copy_((deq if directly else w.float() + deq).to(weights.dtype))


# --------------------------------------------------------------------------------- dispatch
def use_kernels(t: torch.Tensor) -> bool:
    """Triton kernels on CUDA tensors when Triton is present (MEGACOAT_NO_TRITON=1: references)."""
    return t.is_cuda and _kernels.available()


def encode_partitioned(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard, key):
    fn = _kernels.encode_partitioned if use_kernels(src) else encode_partitioned_reference
    fn(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard, key)


def reduce_requantize(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key):
    fn = _kernels.reduce_requantize if use_kernels(msgs) else reduce_requantize_reference
    fn(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key)


def reduce_decode(msgs, out, n, bits, group, hadamard, scale):
    fn = _kernels.reduce_decode if use_kernels(msgs) else reduce_decode_reference
    fn(msgs, out, n, bits, group, hadamard, scale)


def encode_delta(master, weights, out, bits, group, key, directly):
    fn = _kernels.encode_delta if use_kernels(master) else encode_delta_reference
    fn(master, weights, out, bits, group, key, directly)


def apply_delta(msgs, weights, bits, group, directly):
    fn = _kernels.apply_delta if use_kernels(msgs) else apply_delta_reference
    fn(msgs, weights, bits, group, directly)
