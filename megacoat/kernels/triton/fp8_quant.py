"""Triton FP8 quantizers: amax, per-tensor cast (+ fused transposed copy), 1x16 groups.

Numerics are those of `megacoat.precision.fp8` (the reference), bit for bit on hardware:
- per-tensor scale `s = div_rn(amax + EPS, FMAX)` (IEEE division, once per program), group scales
  the same then rounded *up* to bf16 (stored as bf16: half the bytes; rounding up keeps |x|/s <= FMAX);
- codes `q = sat(x * r)` with `r = div_rn(1, s)` (one multiply per element instead of a division;
  the reference uses the same reciprocal), clamp to +-FMAX, then the cast (cvt.rn.satfinite, RNE).
The per-tensor amax is reduced in the kernel that reads the tensor (one atomic max per program into a
zeroed fp32 scalar: max is exact in any order), so a quantization is one launch after its producer.
The `@triton.jit` helpers at the top are shared with the fused activation kernels (fp8_act.py).
Every kernel masks its edges, so any shape works.

1x16 tiles (quantize/dequantize here, the element-wise kernels of fp8_act.py) are 4-D,
[rows, groups, SPLIT, 16 // SPLIT]: with SPLIT = 2 each thread holds 8 contiguous elements (one
16-byte bf16 load, warps read 512 contiguous bytes per instruction, every operand of a kernel gets
the same layout, so no shared-memory conversion) and a group's max is one shuffle between the two
threads of the group; with SPLIT = 1 a thread holds a whole group (two 16-byte loads 32 bytes apart,
one 16-byte store of codes). The grid is 1-D with the group blocks fastest, so consecutive programs
read consecutive memory (a 2-D grid with the row blocks in x has every wave read one narrow column
strip of the whole tensor: HBM pages opened for 512 bytes, the 1x16 quantizer at half a copy's speed).
"""
import triton
import triton.language as tl


@triton.jit
def sat_cast(v, FMAX: tl.constexpr, out_dtype: tl.constexpr):
    """fp32 values already multiplied by the reciprocal scale -> fp8 codes (saturating)."""
    return tl.clamp(v, -FMAX, FMAX).to(out_dtype)


@triton.jit
def tensor_scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr):
    """Just-in-time per-tensor scale, bit-identical to the reference's IEEE (amax + EPS) / FMAX."""
    return tl.math.div_rn(amax + EPS, FMAX)


@triton.jit
def round_up_bf16(s):
    """Positive finite fp32 -> the smallest bf16 value >= it (returned as fp32, exact in bf16)."""
    bits = s.to(tl.int32, bitcast=True)
    return ((bits + 65535) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def group_scale(gmax, FMAX: tl.constexpr, EPS: tl.constexpr):
    """1x16 group scales from the groups' max |x| -> (scale rounded up to bf16, its IEEE reciprocal):
    the per-group operations of every 1x16 quantizer, whatever its tile."""
    scale = round_up_bf16(tensor_scale(gmax, FMAX, EPS))
    return scale, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def quantize_groups_store(v, rows, groups, lanes, mask, gmask, q_ptr, s_ptr, stride_q, stride_s,
                          FMAX: tl.constexpr, EPS: tl.constexpr):
    """v: fp32 tile [BM, BG, 16] (masked lanes hold 0), gmask [BM, BG] the groups that exist (from the
    row and group counts: reducing `mask` instead costs a warp reduction per group). Stores 1x16
    codes and bf16 group scales."""
    scale, inv = group_scale(tl.max(tl.abs(v), axis=2), FMAX, EPS)
    q = sat_cast(v * inv[:, :, None], FMAX, q_ptr.dtype.element_ty)
    cols = groups[None, :, None] * 16 + lanes[None, None, :]
    tl.store(q_ptr + rows[:, None, None] * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + rows[:, None] * stride_s + groups[None, :], scale.to(s_ptr.dtype.element_ty), mask=gmask)


@triton.jit
def atomic_max_amax(amax_ptr, v):
    """amax_ptr (a zeroed fp32 scalar) = max(it, v) for v >= 0 (an amax): one int32 atomic max on the
    bits (non-negative floats order as their bits; Triton's float atomic max issues this one too for
    v >= 0, plus a min.u32 for negative v and a barrier around each), relaxed: the kernel boundary
    orders it for the consumer, and acq_rel costs a MEMBAR.GPU and an L1 invalidation per program."""
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), v.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def cast_tile(amax_ptr, scale_ptr, M, N, FMAX: tl.constexpr, EPS: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr):
    """This program's [BM, BN] tile of a per-tensor cast over a 2-D grid (row blocks, column blocks) of an
    [M, N] tensor -> (the reciprocal scale from the amax scalar, rows [BM] int64, cols [BN], mask [BM, BN]).
    Program (0, 0) stores the scale."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    scale = tensor_scale(tl.load(amax_ptr), FMAX, EPS)
    inv = tl.math.div_rn(1.0, scale)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(scale_ptr, scale)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    return inv, rows, cols, (rows[:, None] < M) & (cols[None, :] < N)


@triton.jit
def group_tile(M, K, G, BM: tl.constexpr, BG: tl.constexpr, SPLIT: tl.constexpr):
    """This program's [BM, BG, SPLIT, 16 // SPLIT] tile of a 1-D grid over (row blocks, group blocks),
    group blocks fastest. -> (rows [BM] int64, groups [BG], cols [1, BG, SPLIT, 16 // SPLIT],
    mask [BM, BG, SPLIT, 16 // SPLIT], gmask [BM, BG]: the groups that exist)."""
    pid = tl.program_id(0)
    ng = tl.cdiv(G, BG)
    pid_m = pid // ng
    pid_g = pid - pid_m * ng
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    groups = pid_g * BG + tl.arange(0, BG)
    cols = (groups[None, :, None, None] * 16 + tl.arange(0, SPLIT)[None, None, :, None] * (16 // SPLIT)
            + tl.arange(0, 16 // SPLIT)[None, None, None, :])
    rmask = rows < M
    mask = rmask[:, None, None, None] & (cols < K)
    gmask = rmask[:, None] & (groups[None, :] < G)
    return rows, groups, cols, mask, gmask


@triton.jit
def quantize_groups_store4(v, rows, groups, cols, mask, gmask, q_ptr, s_ptr, stride_q, stride_s,
                           FMAX: tl.constexpr, EPS: tl.constexpr):
    """`quantize_groups_store` on a [BM, BG, SPLIT, 16 // SPLIT] tile (see `group_tile`); masked
    lanes hold 0. The same operations per group (max, div_rn twice, round-up), per element (one
    multiply, clamp, cast)."""
    scale, inv = group_scale(tl.max(tl.max(tl.abs(v), axis=3), axis=2), FMAX, EPS)
    q = sat_cast(v * inv[:, :, None, None], FMAX, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None, None, None] * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + rows[:, None] * stride_s + groups[None, :], scale.to(s_ptr.dtype.element_ty), mask=gmask)


@triton.jit
def amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out (zeroed fp32 scalar) = max(out, max |x|) over ITERS blocks of BLOCK elements per program. The
    loop is unrolled so that the ITERS loads are all issued before the first max waits for its data."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    atomic_max_amax(out_ptr, tl.max(acc, axis=0))


@triton.jit
def cast_kernel(x_ptr, amax_ptr, scale_ptr, q_ptr, qt_ptr, M, K, stride_x,
                FMAX: tl.constexpr, EPS: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr,
                BK: tl.constexpr, ROWWISE: tl.constexpr = True):
    """q[m, k] = sat(x[m, k] * r) (unless not ROWWISE: a backward that needs only the transposed copy);
    with TRANSPOSE also qt[k, m] (qt is [K, M] row-major, written from the same registers through
    tl.trans). The scale comes from the amax scalar; program (0, 0) stores it."""
    inv, rows, cols, mask = cast_tile(amax_ptr, scale_ptr, M, K, FMAX, EPS, BM, BK)
    xb = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if ROWWISE:
        q = sat_cast(xb.to(tl.float32) * inv, FMAX, q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        # Transpose the 16-bit input tile (shared memory moves 2-byte words, not single bytes) and
        # cast again: the same multiply and cast, so the codes equal q's.
        qt = sat_cast(tl.trans(xb).to(tl.float32) * inv, FMAX, qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], qt, mask=tl.trans(mask))


@triton.jit
def quantize_1x16_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_x, FMAX: tl.constexpr, EPS: tl.constexpr,
                         BM: tl.constexpr, BG: tl.constexpr, SPLIT: tl.constexpr):
    """1-D grid of cdiv(M, BM) * cdiv(G, BG) programs (see `group_tile`)."""
    rows, groups, cols, mask, gmask = group_tile(M, K, G, BM, BG, SPLIT)
    v = tl.load(x_ptr + rows[:, None, None, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    quantize_groups_store4(v, rows, groups, cols, mask, gmask, q_ptr, s_ptr, K, G, FMAX, EPS)


@triton.jit
def dequantize_1x16_kernel(q_ptr, s_ptr, y_ptr, M, K, G, BM: tl.constexpr, BG: tl.constexpr, SPLIT: tl.constexpr):
    rows, groups, cols, mask, gmask = group_tile(M, K, G, BM, BG, SPLIT)
    off = rows[:, None, None, None] * K + cols
    q = tl.load(q_ptr + off, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows[:, None] * G + groups[None, :], mask=gmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, (q * s[:, :, None, None]).to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- many tensors in one launch
# The FP8 weight refresh after each optimizer step quantizes every linear weight: per weight an amax and
# a cast (~200 launches and their host time at 1.36B) become two launches over descriptor tables (the
# weights' addresses as int64, one row per program), with the same per-element operations as the
# one-tensor kernels above (same codes, same scales, bit for bit).


@triton.jit
def _as_ptr(table_ptr, t, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """Entry t of an address table as a pointer. ALIGNED: every address is a multiple of 16 bytes (said to
    the compiler, which then vectorizes the loads and stores as it does for tensor arguments)."""
    ptr = tl.load(table_ptr + t).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _dim(table_ptr, t, ALIGNED: tl.constexpr):
    v = tl.load(table_ptr + t)
    if ALIGNED:
        v = tl.multiple_of(v, 16)
    return v


@triton.jit
def multi_amax_kernel(x_table, numel_table, prog_tensor, prog_block, out_ptr, X_DTYPE: tl.constexpr,
                      BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr):
    """out[t] (zeroed fp32) = max |x_t| for every tensor t; program p reads ITERS blocks of BLOCK elements
    of tensor prog_tensor[p] from block prog_block[p] on."""
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    first = tl.load(prog_block + pid).to(tl.int64)
    n = _dim(numel_table, t, ALIGNED)
    x_ptr = _as_ptr(x_table, t, X_DTYPE, ALIGNED)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (first + i) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    atomic_max_amax(out_ptr + t, tl.max(acc, axis=0))


@triton.jit
def multi_cast_kernel(x_table, q_table, qt_table, scale_table, m_table, k_table, prog_tensor, prog_tile,
                      amax_ptr, X_DTYPE: tl.constexpr, Q_DTYPE: tl.constexpr, FMAX: tl.constexpr,
                      EPS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ALIGNED: tl.constexpr):
    """`cast_kernel` (both layouts) of contiguous 2-D tensor prog_tensor[p], tile prog_tile[p] (row-major
    over its BM x BK tiles), scale from amax[t]; the tensor's first tile stores its scale. ALIGNED: every
    address is 16-byte aligned and every dim a multiple of 16 (without it the accesses are not vectorized:
    on an H200 that took 3.8 ms for the 1.36B model's weights, ~2.7x a copy's time)."""
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    tile = tl.load(prog_tile + pid)
    M = _dim(m_table, t, ALIGNED)
    K = _dim(k_table, t, ALIGNED)
    nk = tl.cdiv(K, BK)
    pid_m = tile // nk
    pid_k = tile - pid_m * nk
    scale = tensor_scale(tl.load(amax_ptr + t), FMAX, EPS)
    inv = tl.math.div_rn(1.0, scale)
    if tile == 0:
        tl.store(_as_ptr(scale_table, t, tl.float32, False), scale)
    rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    xb = tl.load(_as_ptr(x_table, t, X_DTYPE, ALIGNED) + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
    q = sat_cast(xb.to(tl.float32) * inv, FMAX, Q_DTYPE)
    tl.store(_as_ptr(q_table, t, Q_DTYPE, ALIGNED) + rows[:, None] * K + cols[None, :], q, mask=mask)
    qt = sat_cast(tl.trans(xb).to(tl.float32) * inv, FMAX, Q_DTYPE)
    tl.store(_as_ptr(qt_table, t, Q_DTYPE, ALIGNED) + cols[:, None].to(tl.int64) * M + rows[None, :], qt,
             mask=tl.trans(mask))
