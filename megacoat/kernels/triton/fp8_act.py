"""Fused Triton kernels of the FP8 activation path (reference: megacoat/precision/activations.py).

Tiles are [rows, groups, 16] (norms) or [rows, groups, SPLIT, 16 // SPLIT] (element-wise kernels:
1-D grid, group blocks fastest; see `group_tile` in fp8_quant.py) so that the 1x16 group scales of
the saved E4M3 copies come out of the same registers that compute the op; masked lanes hold 0 and
never raise a group's amax.
Forward kernels also reduce the per-tensor amax of their output (as rounded to its dtype: exactly
what the following per-tensor cast reads) into a zeroed fp32 scalar, one atomic max per program,
so the consumer's cast needs no amax pass and no extra launch. Group scales are bf16 (rounded up).
"""
import triton
import triton.language as tl

from .fp8_quant import atomic_max_amax, cast_tile, group_tile, quantize_groups_store, quantize_groups_store4, sat_cast

GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi); globals in jit code must be constexpr


@triton.jit
def _tile(rows, groups, lanes, M, K):
    cols = groups[None, :, None] * 16 + lanes[None, None, :]
    mask = (rows[:, None, None] < M) & (cols < K)
    return cols, mask


@triton.jit
def _tile_amax(y, mask):
    return tl.max(tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=2), axis=1)


@triton.jit
def _amax4(y):
    """max |y| of a 4-D tile whose masked lanes hold f(0) = 0 (SiLU, GELU, SwiGLU and their gradients
    of zero loads are exactly 0, so no mask is needed). Flattened first (a view of the registers; max
    is exact in any order): one in-thread pass, one warp reduction, one across warps, not one per axis."""
    a = tl.abs(y.to(tl.float32))
    return tl.max(tl.reshape(a, (a.numel,)), axis=0)


@triton.jit
def norm_fwd_kernel(x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, y_ptr, q_ptr, qs_ptr, rstd_ptr, mean_ptr, amax_ptr,
                    M, K, G, eps, HAS_RES: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    FMAX: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BR + tl.arange(0, BR)
    groups = tl.arange(0, BG)
    lanes = tl.arange(0, 16)
    cols, mask = _tile(rows, groups, lanes, M, K)
    off = rows[:, None, None] * K + cols
    x = tl.load(x_ptr + off, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + off, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the bf16 stream, rounded as torch's add
        tl.store(s_ptr + off, s, mask=mask)
        sf = s.to(tl.float32)
    else:
        sf = x.to(tl.float32)
    gmask = (rows[:, None] < M) & (groups[None, :] < G)
    quantize_groups_store(sf, rows, groups, lanes, mask, gmask, q_ptr, qs_ptr, K, G, FMAX, EPS)
    rmask = rows < M
    if RMS:
        c = sf
    else:
        mean = tl.sum(tl.sum(sf, axis=2), axis=1) / K
        c = tl.where(mask, sf - mean[:, None, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=rmask)
    var = tl.sum(tl.sum(c * c, axis=2), axis=1) / K
    # eps arrives as fp64 when inductor launches the kernel (a Python float): add it in fp32, as torch does.
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + tl.cast(eps, tl.float32)))
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    cmask = cols < K
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = c * rstd[:, None, None] * w
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    yb = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + off, yb, mask=mask)
    atomic_max_amax(amax_ptr, tl.max(_tile_amax(yb, mask), axis=0))


@triton.jit
def norm_bwd_kernel(dy_ptr, q_ptr, qs_ptr, rstd_ptr, mean_ptr, w_ptr, dres_ptr, dx_ptr, dw_ptr, db_ptr, amax_ptr, M, K,
                    G, rows_per_prog, RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                    AMAX: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr, STAGES: tl.constexpr = 1):
    """Each program walks `rows_per_prog` rows and writes one row of weight/bias-gradient partials.
    HAS_RES: dx also gets the residual stream's gradient `dres` (added in fp32, one rounding): the
    separate add of the two bf16 gradients would cost another pass over both. AMAX: max |dx| (as
    rounded) into the zeroed fp32 scalar amax_ptr: the amax of the gradient the producing FP8 linear
    casts, which then needs no amax pass of its own. STAGES: software-pipelined row loop (the next
    rows' loads issued before this row's reductions wait)."""
    pid = tl.program_id(0)
    groups = tl.arange(0, BG)
    lanes = tl.arange(0, 16)
    cols1 = groups[:, None] * 16 + lanes[None, :]
    w = tl.load(w_ptr + cols1, mask=cols1 < K, other=0.0).to(tl.float32)[None, :, :]
    dw_acc = tl.zeros([BG, 16], dtype=tl.float32)
    db_acc = tl.zeros([BG, 16], dtype=tl.float32)
    amax_acc = tl.zeros([BR, BG, 16], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = start + rows_per_prog
    for r0 in tl.range(0, rows_per_prog, BR, num_stages=STAGES):
        rows = start + r0 + tl.arange(0, BR)
        rmask = (rows < M) & (rows < end)
        cols = cols1[None, :, :]
        mask = rmask[:, None, None] & (cols < K)
        off = rows[:, None, None] * K + cols
        q = tl.load(q_ptr + off, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(qs_ptr + rows[:, None] * G + groups[None, :], mask=rmask[:, None] & (groups[None, :] < G),
                    other=0.0).to(tl.float32)
        x = q * s[:, :, None]
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if RMS:
            xhat = x * rstd[:, None, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None, None]) * rstd[:, None, None], 0.0)
        g = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        gw = g * w
        c2 = tl.sum(tl.sum(gw * xhat, axis=2), axis=1) / K
        dx = gw - xhat * c2[:, None, None]
        if not RMS:
            dx = dx - (tl.sum(tl.sum(gw, axis=2), axis=1) / K)[:, None, None]
        dx = dx * rstd[:, None, None]
        if HAS_RES:
            dx = dx + tl.load(dres_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dxb = dx.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + off, dxb, mask=mask)
        if AMAX:  # (LayerNorm's dx is not 0 in masked lanes: its mean term)
            amax_acc = tl.maximum(amax_acc, tl.where(mask, tl.abs(dxb.to(tl.float32)), 0.0))
        dw_acc += tl.sum(g * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(g, axis=0)
    pmask = cols1 < K
    tl.store(dw_ptr + pid * K + cols1, dw_acc, mask=pmask)
    if HAS_BIAS:
        tl.store(db_ptr + pid * K + cols1, db_acc, mask=pmask)
    if AMAX:
        atomic_max_amax(amax_ptr, tl.max(tl.reshape(amax_acc, (amax_acc.numel,)), axis=0))


@triton.jit
def _act(x, KIND: tl.constexpr):
    if KIND == 0:  # silu
        return x * tl.sigmoid(x)
    else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = (x + 0.044715 * x * x * x) * GELU_C  # tensor first: constexpr * tensor breaks the interpreter
        return 0.5 * x * (2.0 * tl.sigmoid(2.0 * z))


@triton.jit
def _act_grad(x, KIND: tl.constexpr):
    if KIND == 0:
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    else:
        t = 2.0 * tl.sigmoid((x + 0.044715 * x * x * x) * GELU_C * 2.0) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (1.0 + 3 * 0.044715 * x * x) * GELU_C


@triton.jit
def swiglu_fwd_kernel(h_ptr, p_ptr, q_ptr, qs_ptr, amax_ptr, M, F, G, FMAX: tl.constexpr, EPS: tl.constexpr,
                      BM: tl.constexpr, BG: tl.constexpr, SPLIT: tl.constexpr):
    """h [M, 2F] = [gate; up] -> p = silu(gate) * up [M, F]; saved codes [M, 2, F], scales [M, 2, G]."""
    rows, groups, cols, mask, gmask = group_tile(M, F, G, BM, BG, SPLIT)
    r4 = rows[:, None, None, None]
    off = r4 * (2 * F) + cols
    gate = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + off + F, mask=mask, other=0.0).to(tl.float32)
    quantize_groups_store4(gate, rows, groups, cols, mask, gmask, q_ptr, qs_ptr, 2 * F, 2 * G, FMAX, EPS)
    quantize_groups_store4(up, rows, groups, cols, mask, gmask, q_ptr + F, qs_ptr + G, 2 * F, 2 * G, FMAX, EPS)
    p = (gate * tl.sigmoid(gate) * up).to(p_ptr.dtype.element_ty)
    tl.store(p_ptr + r4 * F + cols, p, mask=mask)
    atomic_max_amax(amax_ptr, _amax4(p))


@triton.jit
def _swiglu_grads(g, gate, up):
    """(dgate, dup) in fp32 of p = silu(gate) * up: one expression for every SwiGLU backward kernel, so that
    they round the same values."""
    sig = tl.sigmoid(gate)
    dgate = g * up * sig * (1.0 + gate * (1.0 - sig))
    dup = g * gate * sig
    return dgate, dup


@triton.jit
def swiglu_bwd_kernel(dp_ptr, q_ptr, qs_ptr, dh_ptr, amax_ptr, M, F, G, BM: tl.constexpr, BG: tl.constexpr,
                      SPLIT: tl.constexpr, STORE: tl.constexpr = True):
    """dh = [dgate; dup] from the saved FP8 gate and up; also max |dh| (as rounded to dh's dtype) into
    amax_ptr: dh is the preceding FP8 linear's output gradient, which it casts per tensor (no amax pass).
    STORE=False: only the amax (dh_ptr gives the dtype; `swiglu_bwd_cast_kernel` then makes the codes)."""
    rows, groups, cols, mask, gmask = group_tile(M, F, G, BM, BG, SPLIT)
    r4 = rows[:, None, None, None]
    off2 = r4 * (2 * F) + cols
    soff = rows[:, None] * (2 * G) + groups[None, :]
    gate = tl.load(q_ptr + off2, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(qs_ptr + soff, mask=gmask, other=0.0).to(tl.float32)[:, :, None, None]
    up = tl.load(q_ptr + off2 + F, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(qs_ptr + soff + G, mask=gmask, other=0.0).to(tl.float32)[:, :, None, None]
    g = tl.load(dp_ptr + r4 * F + cols, mask=mask, other=0.0).to(tl.float32)
    dgate, dup = _swiglu_grads(g, gate, up)
    dgate = dgate.to(dh_ptr.dtype.element_ty)
    dup = dup.to(dh_ptr.dtype.element_ty)
    if STORE:
        tl.store(dh_ptr + off2, dgate, mask=mask)
        tl.store(dh_ptr + off2 + F, dup, mask=mask)
    atomic_max_amax(amax_ptr, _amax4(tl.maximum(tl.abs(dgate.to(tl.float32)), tl.abs(dup.to(tl.float32)))))


@triton.jit
def swiglu_bwd_cast_kernel(dp_ptr, q_ptr, qs_ptr, amax_ptr, scale_ptr, gq_ptr, gqt_ptr, M, F, G,
                           FMAX: tl.constexpr, EPS: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    """The SwiGLU's input gradient dh = [dgate; dup] [M, 2F] (the values `swiglu_bwd_kernel` rounds to dh's
    dtype, which is dp's), cast per tensor with the scale of amax_ptr (max |dh|, from that kernel's STORE=False
    pass) to FP8 codes in both layouts the FP8 linear's backward reads: gq [M, 2F] and gqt [2F, M]. dh itself is
    never written (23% fewer bytes than the bf16 dh and a cast; the pair is bound by instruction issue as much as
    by HBM: 4-6% faster on the H200). 2-D grid over (row blocks, blocks of BF gate columns); program (0, 0)
    stores the scale."""
    inv, rows, cols, mask = cast_tile(amax_ptr, scale_ptr, M, F, FMAX, EPS, BM, BF)
    off2 = rows[:, None] * (2 * F) + cols[None, :]
    # The group scales: one load per 16 columns, broadcast over the group's columns in registers.
    groups = tl.program_id(1) * (BF // 16) + tl.arange(0, BF // 16)
    smask = (rows[:, None] < M) & (groups[None, :] < G)
    soff = rows[:, None] * (2 * G) + groups[None, :]
    s_gate = tl.reshape(tl.broadcast_to(tl.load(qs_ptr + soff, mask=smask, other=0.0).to(tl.float32)[:, :, None],
                                        (BM, BF // 16, 16)), (BM, BF))
    s_up = tl.reshape(tl.broadcast_to(tl.load(qs_ptr + soff + G, mask=smask, other=0.0).to(tl.float32)[:, :, None],
                                      (BM, BF // 16, 16)), (BM, BF))
    gate = tl.load(q_ptr + off2, mask=mask, other=0.0).to(tl.float32) * s_gate
    up = tl.load(q_ptr + off2 + F, mask=mask, other=0.0).to(tl.float32) * s_up
    g = tl.load(dp_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dgate, dup = _swiglu_grads(g, gate, up)
    dgate = dgate.to(dp_ptr.dtype.element_ty)
    dup = dup.to(dp_ptr.dtype.element_ty)
    out_ty = gq_ptr.dtype.element_ty
    tl.store(gq_ptr + off2, sat_cast(dgate.to(tl.float32) * inv, FMAX, out_ty), mask=mask)
    tl.store(gq_ptr + off2 + F, sat_cast(dup.to(tl.float32) * inv, FMAX, out_ty), mask=mask)
    # Transposed as 16-bit values (shared memory moves 2-byte words), then the same multiply and cast.
    tmask = tl.trans(mask)
    tl.store(gqt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :],
             sat_cast(tl.trans(dgate).to(tl.float32) * inv, FMAX, out_ty), mask=tmask)
    tl.store(gqt_ptr + (cols + F)[:, None].to(tl.int64) * M + rows[None, :],
             sat_cast(tl.trans(dup).to(tl.float32) * inv, FMAX, out_ty), mask=tmask)


@triton.jit
def act_fwd_kernel(h_ptr, y_ptr, q_ptr, qs_ptr, amax_ptr, M, K, G, KIND: tl.constexpr, FMAX: tl.constexpr,
                   EPS: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, SPLIT: tl.constexpr):
    rows, groups, cols, mask, gmask = group_tile(M, K, G, BM, BG, SPLIT)
    off = rows[:, None, None, None] * K + cols
    x = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
    quantize_groups_store4(x, rows, groups, cols, mask, gmask, q_ptr, qs_ptr, K, G, FMAX, EPS)
    y = _act(x, KIND).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + off, y, mask=mask)
    atomic_max_amax(amax_ptr, _amax4(y))


@triton.jit
def act_bwd_kernel(dy_ptr, q_ptr, qs_ptr, dh_ptr, M, K, G, KIND: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr,
                   SPLIT: tl.constexpr):
    rows, groups, cols, mask, gmask = group_tile(M, K, G, BM, BG, SPLIT)
    off = rows[:, None, None, None] * K + cols
    s = tl.load(qs_ptr + rows[:, None] * G + groups[None, :], mask=gmask, other=0.0).to(tl.float32)
    x = tl.load(q_ptr + off, mask=mask, other=0.0).to(tl.float32) * s[:, :, None, None]
    g = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(dh_ptr + off, (g * _act_grad(x, KIND)).to(dh_ptr.dtype.element_ty), mask=mask)
