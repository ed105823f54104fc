"""Triton kernels of SDP4Bit's communication codecs (qWD and TLq-HS).

Numerics are those of the torch references in `megacoat.comm.codecs` (the specification), bit for
bit: the same counter-based hash for stochastic rounding, the same butterfly order of the 32-point
Hadamard transform, IEEE division (`div_rn`) for the two per-group divisions, the same order of
fp32 additions. Launch with `enable_fp_fusion=False` so that no multiply-add is contracted into an
FMA (the references round after every operation).

Message of n elements at k bits with groups of G (see codecs.message_bytes): n*k/8 bytes of codes
(code = q + 2^(k-1); 4-bit: element 2i in the low nibble of byte i, 2i+1 in the high one), then
n/G fp32 scales. Kernels get each message buffer three times, as uint8 (8-bit codes), as int32
(4-bit codes: one word = 8 elements, element 8w + j in bits 4j..4j+3) and as fp32 (scales).

Speed (all passes are bandwidth-bound on an H200 if the per-element work stays small):
- every tile is [rows, C] with one quantization group (or a whole number of them) per row, so a
  group's absmax is one tl.max along axis 1 and its scale one load/store per row;
- the grids are 2-D/3-D (tile, source/destination, block): no integer division per element;
- 4-bit codes move as int32 words ([rows, C/8] loads/stores, unpacked with shifts in registers);
- the absmax is an integer max over the fp32 bits (|x| bits order like |x|; Inf/NaN are the
  values >= 0x7F800000), rounding is floor(x * inv + f) - 1 from an fma and an add both rounded
  toward -inf (`fma.rm`, `add.rm` as inline PTX: the add's low mantissa bits are the code), and
  codes become floats again by the 1.5*2^23 trick: no float<->int conversion instructions. Under
  the interpreter (no inline PTX) the same integer comes from a round-to-nearest fma, a floor and
  the sign of a second fma;
- one 32-bit hash gives the random offsets of two elements (16 bits each).
"""
import triton
import triton.language as tl

# Stochastic-rounding hash constants (odd, < 2^31 so that the torch reference can multiply in int64).
_C1 = tl.constexpr(0x045D9F3B)
_C2 = tl.constexpr(0x119DE1F3)
_MIN_AMAX_BITS = tl.constexpr(0x0F800000)  # fp32 bits of 2^-96: smaller groups are sent as zeros
_INF_BITS = tl.constexpr(0x7F800000)
_ONE_BITS = tl.constexpr(0x3F800000)
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + MAGIC holds round(v) in its low mantissa bits
_MAGIC_BITS = tl.constexpr(0x4B400000)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * _C1
    x = x ^ (x >> 15)
    x = x * _C2
    x = x ^ (x >> 16)
    return x


@triton.jit
def rounding_offsets(e0, k1, k2, R: tl.constexpr, C: tl.constexpr):
    """f = 1 + u, u the stochastic-rounding offsets in (0, 1), of the [R, C] tile whose row i holds
    stream indices e0[i] .. e0[i] + C - 1 (e0 even). Pair p = e // 2 is hashed once (input
    (((p >> 4) ^ k1) + k2) << 4 | (p & 15)): element 2p takes the low 16 bits, 2p + 1 the high ones;
    f = 1.bits16|1 in fp32, exact."""
    p = ((e0 >> 1)[:, None] + tl.arange(0, C // 2)[None, :]).to(tl.uint32)
    h = _mix32(((((p >> 4) ^ k1.to(tl.uint32)) + k2.to(tl.uint32)) << 4) | (p & 15))
    lo = ((h << 7) & 0x7FFF80) | 0x3F800040
    hi = ((h >> 9) & 0x7FFF80) | 0x3F800040
    return tl.reshape(tl.join(lo, hi), (R, C)).to(tl.float32, bitcast=True)


@triton.jit
def _fma_rm(x, y, z):
    """fl_down(x * y + z), one rounding toward -inf (PTX fma.rm.f32)."""
    return tl.inline_asm_elementwise("fma.rm.f32 $0, $1, $2, $3;", "=f,f,f,f", [x, y, z], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _code_rm(v, QMAX: tl.constexpr):
    """floor(v) + QMAX for v in (-2^22, 2^22): the bits of fl_down(v + 1.5 * 2^23 + QMAX) minus those of 1.5 * 2^23
    (the sum stays in [2^23, 2^24), where the fp32 spacing is 1)."""
    if QMAX == 7:
        w = tl.inline_asm_elementwise("add.rm.f32 $0, $1, 0f4B400007;", "=f,f", [v], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        tl.static_assert(QMAX == 127, "4- or 8-bit codes")
        w = tl.inline_asm_elementwise("add.rm.f32 $0, $1, 0f4B40007F;", "=f,f", [v], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return w.to(tl.int32, bitcast=True) - _MAGIC_BITS


@triton.jit
def quantize_rows(x, f, QMAX: tl.constexpr, HW: tl.constexpr):
    """Symmetric stochastic int quantization of each row (one group) of x [R, G] with offsets f = 1 + u.

    Returns (codes int32 = q + QMAX + 1 in [1, 2 QMAX + 1], fp32 scale per row). A group holding
    Inf/NaN gets scale NaN and codes of q = 0 (dequantizes to NaN: the non-finite check fires).
    q = floor(x * inv + f) - 1 exactly. HW (compiled for the GPU): an fma and an add rounded toward
    -inf (rounding down never crosses the floor). Else (the interpreter has no inline PTX): v =
    fma(x, inv, f) rounds once, so floor(v) is the exact floor unless v rounded up onto an integer,
    which the exact sign of fma(x, inv, f - floor(v)) reveals (f - floor(v) is exact: a multiple of
    2^-17 below 2^8)."""
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_b = tl.max(a, axis=1)
    bad = amax_b >= _INF_BITS
    pos = (amax_b >= _MIN_AMAX_BITS) & (amax_b < _INF_BITS)
    amax = tl.where(pos, amax_b, _ONE_BITS).to(tl.float32, bitcast=True)
    qmax = amax * 0.0 + QMAX  # as an fp32 tensor (amax is finite)
    scale = tl.where(pos, tl.math.div_rn(amax, qmax), 1.0)
    inv = tl.broadcast_to(tl.where(pos, tl.math.div_rn(qmax, amax), 0.0)[:, None], x.shape)
    if HW:
        c = _code_rm(_fma_rm(x, inv, f), QMAX)
    else:
        fl = tl.floor(tl.fma(x, inv, f))
        below = tl.fma(x, inv, f - fl) < 0.0
        c = (fl + _MAGIC).to(tl.int32, bitcast=True) - (_MAGIC_BITS - QMAX) - below.to(tl.int32)
    c = tl.where(bad[:, None], QMAX + 1, c)
    return c, tl.where(bad, float("nan"), scale)


@triton.jit
def dequantize(c, scale, BITS: tl.constexpr):
    """(codes - 2^(BITS-1)) * scale in fp32; the int -> float step exactly, without a conversion."""
    OFF: tl.constexpr = 1 << (BITS - 1)
    q = (c + (_MAGIC_BITS - OFF)).to(tl.float32, bitcast=True) - _MAGIC
    return q * scale


@triton.jit
def _word_ptr(msg_ptr, PACK: tl.constexpr):
    """4-bit codes move as words of PACK elements: int16 (PACK 4) or int32 (PACK 8); element
    PACK*w + j sits in bits 4j..4j+3 of word w (the same bytes as nibble pairs, little-endian)."""
    if PACK == 4:
        return msg_ptr.to(tl.pointer_type(tl.int16))
    else:
        return msg_ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def _pack4(c, R: tl.constexpr, C: tl.constexpr):
    """[R, C] 4-bit codes -> [R, C/4] words. Splits of in-register pairs (no data movement)."""
    e0, e1 = tl.split(tl.reshape(c, (R, C // 4, 2, 2)))  # b0 = 0 / 1, last dim b1
    n0, n2 = tl.split(e0)
    n1, n3 = tl.split(e1)
    return n0 | (n1 << 4) | (n2 << 8) | (n3 << 12)


@triton.jit
def _pack8(c, R: tl.constexpr, C: tl.constexpr):
    """[R, C] 4-bit codes -> [R, C/8] words."""
    x0, x1 = tl.split(tl.reshape(c, (R, C // 8, 2, 2, 2)))  # b0 = 0 / 1, dims [b2, b1]
    x00, x01 = tl.split(x0)
    x10, x11 = tl.split(x1)
    n0, n4 = tl.split(x00)
    n2, n6 = tl.split(x01)
    n1, n5 = tl.split(x10)
    n3, n7 = tl.split(x11)
    return (n0 | (n1 << 4) | (n2 << 8) | (n3 << 12)) | ((n4 << 16) | (n5 << 20) | (n6 << 24) | (n7 << 28))


@triton.jit
def _unpack(w, R: tl.constexpr, C: tl.constexpr, PACK: tl.constexpr):
    """[R, C/PACK] words -> [R, C] 4-bit codes (int32). Joins build in-register pairs."""
    if PACK == 4:
        w = w.to(tl.int32)
        y = tl.join(tl.join(w & 15, (w >> 8) & 15), tl.join((w >> 4) & 15, (w >> 12) & 15))
    else:
        lo = tl.join(tl.join(w & 15, (w >> 16) & 15), tl.join((w >> 8) & 15, (w >> 24) & 15))
        hi = tl.join(tl.join((w >> 4) & 15, (w >> 20) & 15), tl.join((w >> 12) & 15, (w >> 28) & 15))
        y = tl.join(lo, hi)
    return tl.reshape(y, (R, C))


@triton.jit
def store_codes(c, msg_ptr, byte0, rmask, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr,
                PACK: tl.constexpr):
    """Codes c [R, C]; row i's codes start at byte byte0[i] (int64 [R]) of the message."""
    if BITS == 8:
        tl.store(msg_ptr + byte0[:, None] + tl.arange(0, C)[None, :], c.to(tl.uint8), mask=rmask[:, None])
    else:
        if PACK == 4:
            w = _pack4(c, R, C).to(tl.int16)
        else:
            w = _pack8(c, R, C)
        offs = (byte0 // (PACK // 2))[:, None] + tl.arange(0, C // PACK)[None, :]
        tl.store(_word_ptr(msg_ptr, PACK) + offs, w, mask=rmask[:, None])


@triton.jit
def load_codes(msg_ptr, byte0, rmask, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr):
    """Codes int32 [R, C] of the rows whose codes start at byte byte0[i]."""
    if BITS == 8:
        return tl.load(msg_ptr + byte0[:, None] + tl.arange(0, C)[None, :], mask=rmask[:, None], other=128).to(tl.int32)
    else:
        offs = (byte0 // (PACK // 2))[:, None] + tl.arange(0, C // PACK)[None, :]
        return _unpack(tl.load(_word_ptr(msg_ptr, PACK) + offs, mask=rmask[:, None], other=0), R, C, PACK)


@triton.jit
def load_dequant(msg_ptr, scale_ptr, e0, rmask, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                 PACK: tl.constexpr):
    """Dequantized [R, C] tile of one message: row i = elements e0[i] .. e0[i] + C - 1 (C | e0[i]);
    scale_ptr points at the message's scales. One scale load per row when groups hold whole rows."""
    c = load_codes(msg_ptr, e0 * BITS // 8, rmask, R, C, BITS, PACK)
    if G >= C:
        sc = tl.load(scale_ptr + e0 // G, mask=rmask, other=0.0)[:, None]
    else:
        sc = tl.load(scale_ptr + (e0[:, None] + tl.arange(0, C)[None, :]) // G, mask=rmask[:, None], other=0.0)
    return dequantize(c, sc, BITS)


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
def hadamard_tile(x, R: tl.constexpr, C: tl.constexpr):
    """Hadamard of every 32 consecutive elements of a [R, C] tile (C % 32 == 0)."""
    y = fwht32(tl.reshape(x, (R * C // 32, 32)), R * C // 32)
    return tl.reshape(y, (R, C))


@triton.jit
def round_bf16(x, HW: tl.constexpr):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. HW: the GPU's cvt.rn; else on
    the bits (the Triton interpreter truncates bf16 casts). Both give the same finite values."""
    if HW:
        return x.to(tl.bfloat16).to(tl.float32)
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _f32(msg_ptr):
    return msg_ptr.to(tl.pointer_type(tl.float32))


@triton.jit
def encode_partitioned_kernel(src_ptr, out_ptr, shard_size, slice_off, slice_len, ndest, msg_bytes, k1, k2,
                              BITS: tl.constexpr, G: tl.constexpr, R: tl.constexpr, HADAMARD: tl.constexpr,
                              PACK: tl.constexpr, HW: tl.constexpr):
    """Partition-ordered (optionally Hadamard-transformed) quantize + pack of one bucket slice.
    Grid (tiles of R groups per slice, nblocks, ndest): tile t of block b for destination d."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    d = tl.program_id(2)
    n = tl.num_programs(1) * slice_len  # elements per message (code bytes: (n // 8) * BITS, no int32 overflow)
    rows = t * R + tl.arange(0, R)
    rmask = rows < slice_len // G
    pos0 = b.to(tl.int64) * slice_len + rows * G  # first element of each row within message d
    src0 = (b * ndest + d).to(tl.int64) * shard_size + slice_off
    x = tl.load(src_ptr + src0 + (rows * G)[:, None] + tl.arange(0, G)[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    if HADAMARD:
        x = hadamard_tile(x, R, G)
    r = rounding_offsets(d.to(tl.int64) * n + pos0, k1, k2, R, G)  # stream index: position in partition order
    c, scale = quantize_rows(x, r, (1 << (BITS - 1)) - 1, HW)
    msg = out_ptr + d.to(tl.int64) * msg_bytes
    store_codes(c, msg, pos0 * BITS // 8, rmask, R, G, BITS, PACK)
    tl.store(_f32(msg + (n // 8) * BITS) + pos0 // G, scale, mask=rmask)


@triton.jit
def reduce_requantize_kernel(in_ptr, out_ptr, nsrc, n, m, msg_in, msg_out, k1, k2, BITS_IN: tl.constexpr,
                             G_IN: tl.constexpr, BITS_OUT: tl.constexpr, G_OUT: tl.constexpr, R: tl.constexpr,
                             PACK: tl.constexpr, HW: tl.constexpr):
    """Sum of nsrc dequantized messages of n elements (fp32, in source order) -> requantized into
    n / m messages of m elements. Grid (tiles of R output groups per destination, destinations)."""
    t = tl.program_id(0)
    d = tl.program_id(1)
    rows = t * R + tl.arange(0, R)
    rmask = rows < m // G_OUT
    pos0 = rows.to(tl.int64) * G_OUT  # within destination d's message
    e0 = d.to(tl.int64) * m + pos0  # within the summed n elements (also the stream index; int64: n may pass 2^31)
    # fp32 sum in source order; the reference's 0 + first term equals the first term (never -0)
    acc = load_dequant(in_ptr, _f32(in_ptr + (n // 8) * BITS_IN), e0, rmask, R, G_OUT, BITS_IN, G_IN, PACK)
    for _ in range(nsrc - 1):  # the pointer advances one message per source (64-bit pointer arithmetic)
        in_ptr += msg_in
        acc = acc + load_dequant(in_ptr, _f32(in_ptr + (n // 8) * BITS_IN), e0, rmask, R, G_OUT, BITS_IN, G_IN, PACK)
    r = rounding_offsets(e0, k1, k2, R, G_OUT)
    c, scale = quantize_rows(acc, r, (1 << (BITS_OUT - 1)) - 1, HW)
    msg = out_ptr + d.to(tl.int64) * msg_out
    store_codes(c, msg, pos0 * BITS_OUT // 8, rmask, R, G_OUT, BITS_OUT, PACK)
    tl.store(_f32(msg + (m // 8) * BITS_OUT) + pos0 // G_OUT, scale, mask=rmask)


@triton.jit
def reduce_decode_kernel(in_ptr, out_ptr, nsrc, n, msg, scale, BITS: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
                         HADAMARD: tl.constexpr, OUT_BF16: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr):
    """out = (inverse-Hadamard of) the fp32 sum of nsrc dequantized messages, times `scale`."""
    t = tl.program_id(0)
    rows = t * R + tl.arange(0, R)
    rmask = rows < n // G
    e0 = rows.to(tl.int64) * G
    acc = load_dequant(in_ptr, _f32(in_ptr + (n // 8) * BITS), e0, rmask, R, G, BITS, G, PACK)
    for _ in range(nsrc - 1):
        in_ptr += msg
        acc = acc + load_dequant(in_ptr, _f32(in_ptr + (n // 8) * BITS), e0, rmask, R, G, BITS, G, PACK)
    if HADAMARD:
        acc = hadamard_tile(acc, R, G)
    y = acc * scale
    if OUT_BF16:
        y = round_bf16(y, HW)
    tl.store(out_ptr + e0[:, None] + tl.arange(0, G)[None, :], y.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def encode_delta_kernel(master_ptr, w_ptr, out_ptr, n_groups, k1, k2, BITS: tl.constexpr, G: tl.constexpr,
                        R: tl.constexpr, DIRECT: tl.constexpr, W_BF16: tl.constexpr, HW: tl.constexpr,
                        PACK: tl.constexpr):
    """qWD: quantize + pack (weight-dtype(master) - w), or weight-dtype(master) itself (DIRECT)."""
    t = tl.program_id(0)
    rows = t * R + tl.arange(0, R)
    rmask = rows < n_groups
    e0 = rows.to(tl.int64) * G
    e = e0[:, None] + tl.arange(0, G)[None, :]
    x = tl.load(master_ptr + e, mask=rmask[:, None], other=0.0)
    if W_BF16:
        x = round_bf16(x, HW)
    if not DIRECT:
        x = x - tl.load(w_ptr + e, mask=rmask[:, None], other=0.0).to(tl.float32)
    r = rounding_offsets(e0, k1, k2, R, G)
    c, scale = quantize_rows(x, r, (1 << (BITS - 1)) - 1, HW)
    store_codes(c, out_ptr, e0 * BITS // 8, rmask, R, G, BITS, PACK)
    tl.store(_f32(out_ptr + n_groups * (G * BITS // 8)) + rows, scale, mask=rmask)


@triton.jit
def apply_delta_kernel(in_ptr, w_ptr, n, msg, BITS: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
                       DIRECT: tl.constexpr, W_BF16: tl.constexpr, HW: tl.constexpr, PACK: tl.constexpr):
    """qWD: w[s*n + i] += dequant(message s)[i] (rounded to the weight dtype), or = it (DIRECT).
    Grid (tiles of R groups, sources): the packed deltas are read once."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    rows = t * R + tl.arange(0, R)
    rmask = rows < n // G
    e0 = rows.to(tl.int64) * G
    in_ptr += s.to(tl.int64) * msg
    delta = load_dequant(in_ptr, _f32(in_ptr + (n // 8) * BITS), e0, rmask, R, G, BITS, G, PACK)
    offs = s.to(tl.int64) * n + e0[:, None] + tl.arange(0, G)[None, :]
    if DIRECT:
        w = delta
    else:
        w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32) + delta
    if W_BF16:
        w = round_bf16(w, HW)
    tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=rmask[:, None])
