"""Triton kernels of SDP4Bit's communication codecs (qWD and TLq-HS).

Numerics are those of the torch references in `megacoat.comm.codecs` (the specification), bit for
bit: the same counter-based hash for stochastic rounding, the same butterfly order of the 32-point
Hadamard transform, IEEE division (`div_rn`) for the two per-group divisions, the same order of
fp32 additions. Launch with `enable_fp_fusion=False` so that no multiply-add is contracted into an
FMA (the references round after every operation).

Message of n elements at k bits with groups of G (see codecs.message_bytes): n*k/8 bytes of codes
(code = q + 2^(k-1); 4-bit: element 2i in the low nibble of byte i, 2i+1 in the high one), then
n/G fp32 scales. Kernels get each message buffer twice, as uint8 and as an fp32 view of the same
memory (message sizes are multiples of 4 bytes).
"""
import triton
import triton.language as tl

# Stochastic-rounding hash constants (odd, < 2^31 so that the torch reference can multiply in int64).
_C1 = tl.constexpr(0x045D9F3B)
_C2 = tl.constexpr(0x119DE1F3)
# Groups whose |max| is below this are sent as zeros: keeps qmax / amax finite (no denormal blow-up).
_MIN_AMAX = tl.constexpr(2.0 ** -96)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * _C1
    x = x ^ (x >> 15)
    x = x * _C2
    x = x ^ (x >> 16)
    return x


@triton.jit
def uniform01(idx, k1, k2):
    """u in [0, 1) with 24 random bits from (key, element index); idx: uint32 tensor."""
    h = _mix32(_mix32(idx ^ k1.to(tl.uint32)) ^ k2.to(tl.uint32))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, H: tl.constexpr):
    """One stage: (x_i, x_i+H) -> (x_i + x_i+H, x_i - x_i+H) within blocks of 2H of each 32-row."""
    v = tl.permute(tl.reshape(x, (ROWS, 16 // H, 2, H)), (0, 1, 3, 2))
    a, b = tl.split(v)
    v = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(v, (ROWS, 32))


@triton.jit
def fwht32(x, ROWS: tl.constexpr):
    """Unnormalised Sylvester Hadamard transform of each row of x [ROWS, 32] (butterflies h=1..16)."""
    x = _butterfly(x, ROWS, 1)
    x = _butterfly(x, ROWS, 2)
    x = _butterfly(x, ROWS, 4)
    x = _butterfly(x, ROWS, 8)
    return _butterfly(x, ROWS, 16)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Done on the bits because the
    Triton interpreter truncates bf16 casts; a cast of the result is then exact everywhere."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(x, BF16: tl.constexpr):
    """Round fp32 x to the destination dtype (bf16 or fp32), returned in fp32."""
    if BF16:
        x = round_bf16(x)
    return x


@triton.jit
def hadamard_tile(x, R: tl.constexpr, C: tl.constexpr):
    """Hadamard of every 32 consecutive elements of a [R, C] tile (C % 32 == 0)."""
    y = fwht32(tl.reshape(x, (R * C // 32, 32)), R * C // 32)
    return tl.reshape(y, (R, C))


@triton.jit
def quantize_rows(x, idx, k1, k2, QMAX: tl.constexpr):
    """Symmetric stochastic int quantization of each row (one group) of x [R, G].

    Returns (q as int32 in [-QMAX, QMAX], fp32 scale per row). Non-finite groups get scale NaN
    and codes 0, so that they dequantize to NaN and the optimizer's non-finite check still fires.
    """
    finite = (x == x) & (tl.abs(x) < float("inf"))
    xa = tl.where(finite, tl.abs(x), 0.0)
    amax = tl.max(xa, axis=1)
    bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    pos = amax >= _MIN_AMAX
    safe = tl.where(pos, amax, 1.0)
    qmax = safe * 0.0 + QMAX  # as an fp32 tensor (safe is finite)
    scale = tl.where(pos, tl.math.div_rn(safe, qmax), 1.0)
    inv = tl.where(pos, tl.math.div_rn(qmax, safe), 0.0)
    y = tl.where(finite, x, 0.0) * inv[:, None]
    lo = tl.floor(y)
    u = uniform01(idx, k1, k2)
    q = lo + tl.where(u < (y - lo), 1.0, 0.0)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    scale = tl.where(bad, float("nan"), scale)
    return q.to(tl.int32), scale


@triton.jit
def store_codes(q, out_ptr, byte0, R: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, mask):
    """q [R, G] int32; byte0 [R]: first byte of each row's codes; mask [R]."""
    OFF: tl.constexpr = 1 << (BITS - 1)
    c = q + OFF
    if BITS == 8:
        offs = byte0[:, None] + tl.arange(0, G)[None, :]
        tl.store(out_ptr + offs, c.to(tl.uint8), mask=mask[:, None])
    else:
        lo, hi = tl.split(tl.reshape(c, (R, G // 2, 2)))
        offs = byte0[:, None] + tl.arange(0, G // 2)[None, :]
        tl.store(out_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=mask[:, None])


@triton.jit
def load_dequant(msg_ptr, msg_f32_ptr, e, n, mask, BITS: tl.constexpr, G: tl.constexpr):
    """Dequantized elements e (int64 tensor, any shape) of one message of n elements."""
    OFF: tl.constexpr = 1 << (BITS - 1)
    if BITS == 8:
        c = tl.load(msg_ptr + e, mask=mask, other=OFF).to(tl.int32)
    else:
        b = tl.load(msg_ptr + e // 2, mask=mask, other=0).to(tl.int32)
        c = (b >> ((e % 2) * 4).to(tl.int32)) & 15
    s = tl.load(msg_f32_ptr + (n * BITS // 32) + e // G, mask=mask, other=0.0)
    return (c - OFF).to(tl.float32) * s


@triton.jit
def encode_partitioned_kernel(src_ptr, out_ptr, out_f32_ptr, n_groups, shard_size, slice_off, slice_len, ndest,
                              groups_per_dest, groups_per_block, msg_bytes, k1, k2,
                              BITS: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, HADAMARD: tl.constexpr):
    """Partition-ordered (optionally Hadamard-transformed) quantize + pack of one bucket slice."""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * NG + tl.arange(0, NG)
    gmask = g < n_groups
    d = g // groups_per_dest
    r = g % groups_per_dest
    b = r // groups_per_block
    og = r % groups_per_block
    base = (b * ndest + d) * shard_size + slice_off + og * G
    lanes = tl.arange(0, G)
    x = tl.load(src_ptr + base[:, None] + lanes[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    if HADAMARD:
        x = hadamard_tile(x, NG, G)
    idx = (g[:, None] * G + lanes[None, :]).to(tl.uint32)
    q, scale = quantize_rows(x, idx, k1, k2, (1 << (BITS - 1)) - 1)
    store_codes(q, out_ptr, d * msg_bytes + r * (G * BITS // 8), NG, G, BITS, gmask)
    tl.store(out_f32_ptr + d * (msg_bytes // 4) + groups_per_dest * (G * BITS // 32) + r, scale, mask=gmask)


@triton.jit
def reduce_requantize_kernel(in_ptr, in_f32_ptr, out_ptr, out_f32_ptr, n_groups, nsrc, n, msg_in, msg_out,
                             groups_per_dest, k1, k2, BITS_IN: tl.constexpr, G_IN: tl.constexpr,
                             BITS_OUT: tl.constexpr, G_OUT: tl.constexpr, NG: tl.constexpr):
    """Sum of nsrc dequantized messages (fp32, in source order) -> requantized, split over destinations."""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * NG + tl.arange(0, NG)
    gmask = g < n_groups
    e = g[:, None] * G_OUT + tl.arange(0, G_OUT)[None, :]
    emask = gmask[:, None] & (e < n)
    acc = tl.zeros((NG, G_OUT), dtype=tl.float32)
    for s in range(nsrc):
        acc = acc + load_dequant(in_ptr + s * msg_in, in_f32_ptr + s * (msg_in // 4), e, n, emask, BITS_IN, G_IN)
    q, scale = quantize_rows(acc, e.to(tl.uint32), k1, k2, (1 << (BITS_OUT - 1)) - 1)
    d = g // groups_per_dest
    r = g % groups_per_dest
    store_codes(q, out_ptr, d * msg_out + r * (G_OUT * BITS_OUT // 8), NG, G_OUT, BITS_OUT, gmask)
    tl.store(out_f32_ptr + d * (msg_out // 4) + groups_per_dest * (G_OUT * BITS_OUT // 32) + r, scale, mask=gmask)


@triton.jit
def reduce_decode_kernel(in_ptr, in_f32_ptr, out_ptr, nsrc, n, msg, scale, BITS: tl.constexpr, G: tl.constexpr,
                         HADAMARD: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    """out = (inverse-Hadamard of) the fp32 sum of nsrc dequantized messages, times `scale`."""
    pid = tl.program_id(0)
    e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(nsrc):
        acc = acc + load_dequant(in_ptr + s * msg, in_f32_ptr + s * (msg // 4), e, n, mask, BITS, G)
    if HADAMARD:
        acc = tl.reshape(fwht32(tl.reshape(acc, (BLOCK // 32, 32)), BLOCK // 32), (BLOCK,))
    tl.store(out_ptr + e, to_dtype(acc * scale, OUT_BF16).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def encode_delta_kernel(master_ptr, w_ptr, out_ptr, out_f32_ptr, n_groups, k1, k2, BITS: tl.constexpr,
                        G: tl.constexpr, NG: tl.constexpr, DIRECT: tl.constexpr, W_BF16: tl.constexpr):
    """qWD: quantize + pack (weight-dtype(master) - w), or weight-dtype(master) itself (DIRECT)."""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * NG + tl.arange(0, NG)
    gmask = g < n_groups
    e = g[:, None] * G + tl.arange(0, G)[None, :]
    m = tl.load(master_ptr + e, mask=gmask[:, None], other=0.0)
    x = to_dtype(m, W_BF16)
    if not DIRECT:
        x = x - tl.load(w_ptr + e, mask=gmask[:, None], other=0.0).to(tl.float32)
    q, scale = quantize_rows(x, e.to(tl.uint32), k1, k2, (1 << (BITS - 1)) - 1)
    store_codes(q, out_ptr, g * (G * BITS // 8), NG, G, BITS, gmask)
    tl.store(out_f32_ptr + n_groups * (G * BITS // 32) + g, scale, mask=gmask)


@triton.jit
def apply_delta_kernel(in_ptr, in_f32_ptr, w_ptr, total, n, msg, BITS: tl.constexpr, G: tl.constexpr,
                       DIRECT: tl.constexpr, BLOCK: tl.constexpr, W_BF16: tl.constexpr):
    """qWD: w[s*n + i] += dequant(message s)[i] (rounded to the weight dtype), or = it (DIRECT)."""
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = t < total
    s = t // n
    e = t % n
    delta = load_dequant(in_ptr + s * msg, in_f32_ptr + s * (msg // 4), e, n, mask, BITS, G)
    if DIRECT:
        w = delta
    else:
        w = tl.load(w_ptr + t, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(w_ptr + t, to_dtype(w, W_BF16).to(w_ptr.dtype.element_ty), mask=mask)
