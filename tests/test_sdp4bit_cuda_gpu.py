"""The CUDA C++ TLq-HS encode (csrc/sdp4bit_encode.cu) against the torch reference on the GPU, bit for
bit: message bytes (codes and scales) equal, for fp32 and bf16 buckets, with and without the
Hadamard transform, every group size it covers, several partitions (ndest x nblocks), slices
whose group count leaves a warp's last 512 elements partly empty, messages whose rows are not
16-byte aligned (4-byte code stores), outliers, all-zero / tiny / Inf / NaN groups. Also: the
Triton kernel gives the same bytes, and the cases the kernel does not cover fall back.

The same for the CUDA reduce + requantize (int8/int4 messages -> fp32 sum -> int4): every group-size
relation it covers, 1..3 sources and destinations, 4-byte and 16-byte code loads and stores, partly
empty warps, zero / tiny / Inf / NaN / outlier groups, the benchmark's shape, fallbacks."""
import pytest
import torch

from megacoat.comm import codecs as C
from megacoat.kernels import sdp4bit as K

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (group, shard_size, slice_off, slice_len, ndest, nblocks)
CASES = [
    (128, 2048, 512, 7 * 128, 2, 2),    # 7 groups per slice: warps straddle shards, last warp part empty
    (128, 1024, 0, 1024, 1, 1),          # one destination, one block
    (128, 1536, 128, 3 * 128, 3, 1),     # 396-byte messages: 4-byte code stores
    (32, 320, 64, 5 * 32, 3, 2),
    (64, 640, 192, 7 * 64, 2, 3),
    (256, 4096, 1024, 5 * 256, 2, 2),
    (512, 4096, 512, 3 * 512, 2, 2),
]


def _bucket(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g) * torch.rand(n, device="cuda", generator=g) ** 4 * 10
    x[::997] *= 300.0  # outliers
    x[: 32 * 28].view(28, 32)[::7] = 0.0  # all-zero Hadamard blocks (whole groups for G = 32)
    return x.to(dtype)


def _special_groups(x, case):
    """The slice's first four groups (in source order): all zero (scale 1), tiny (< 2^-96 even after
    the Hadamard transform: sent as zeros, scale 1), one Inf, one NaN (scale NaN, codes 128)."""
    G, S, off, sl, nd, nb = case
    starts = [k * S + off + j * G for k in range(nd * nb) for j in range(sl // G)][:4]
    y = x.clone()
    y[starts[0]: starts[0] + G] = 0.0
    y[starts[1]: starts[1] + G] = 1e-32
    y[starts[2] + 3] = float("inf")
    y[starts[3] + 5] = float("nan")
    return y
def _run_both(src, case, bits, had, key):
    G, S, off, sl, nd, nb = case
    ref = torch.full((nd, C.message_bytes(nb * sl, bits, G)), 7, dtype=torch.uint8, device="cuda")
    got = torch.full_like(ref, 9)
    C.encode_partitioned_reference(src, ref, S, off, sl, nd, nb, bits, G, had, key)
    ran = K.encode_partitioned_cuda(src, got, S, off, sl, nd, nb, bits, G, had, key)
    return ran, ref, got


def test_extension_builds():
    if K.cuda_extension() is None:
        pytest.fail("the SDP4Bit CUDA extension (csrc/sdp4bit_*) did not build or is disabled (MEGACOAT_NO_CUDA_EXT): "
                    "see the warning above")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("had", [True, False], ids=["hadamard", "plain"])
@pytest.mark.parametrize("case", CASES, ids=[f"G{c[0]}_S{c[1]}_off{c[2]}_sl{c[3]}_{c[4]}x{c[5]}" for c in CASES])
def test_cuda_encode_equals_reference(case, had, dtype):
    if K.cuda_extension() is None:
        pytest.skip("CUDA extension not available")
    G, S, off, sl, nd, nb = case
    key = C.derive_key(G, S, int(had), 3)
    for special in (False, True):
        src = _bucket(nd * nb * S, dtype, seed=G + S)
        if special:
            src = _special_groups(src, case)
        ran, ref, got = _run_both(src, case, 8, had, key)
        assert ran, "the CUDA kernel should cover this case"
        assert torch.equal(ref, got), (case, had, dtype, special, (ref != got).nonzero()[:8].tolist())
        tri = torch.zeros_like(ref)
        K.encode_partitioned_triton(src, tri, S, off, sl, nd, nb, 8, G, had, key)
        assert torch.equal(tri, got), (case, had, dtype, special)
        if special:  # the Inf / NaN groups really were flagged
            n = nb * sl
            scales = got[:, n:].contiguous().view(torch.float32)
            assert torch.isnan(scales).sum() >= 2 and (scales == 1.0).sum() >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_encode_large_2x2(dtype):
    """The benchmark's shape at 4M elements (2 x 2, a slice inside the shard), outliers."""
    if K.cuda_extension() is None:
        pytest.skip("CUDA extension not available")
    L, N, S = 2, 2, 1 << 20
    src = _bucket(L * N * S, torch.float32, seed=5)
    src[12345] = 1e4
    src = src.to(dtype)
    for had in (True, False):
        case = (128, S, 4096, S - 8192, L, N)
        ran, ref, got = _run_both(src, case, 8, had, C.derive_key(5, 8))
        assert ran and torch.equal(ref, got), (dtype, had)


def test_grid_stride_loop_and_dispatch():
    """A capped grid (warps loop over the work) gives the same bytes; the dispatcher uses the CUDA
    kernel; uncovered cases (4-bit codes, G = 2048, a misaligned source view) return False and the
    dispatcher's Triton fallback still matches the reference."""
    if K.cuda_extension() is None:
        pytest.skip("CUDA extension not available")
    G, S, off, sl, nd, nb = 128, 1 << 16, 1024, (1 << 16) - 2048, 2, 2
    src = _bucket(nd * nb * S, torch.float32, seed=11)
    key = C.derive_key(11)
    ref = torch.empty(nd, C.message_bytes(nb * sl, 8, G), dtype=torch.uint8, device="cuda")
    C.encode_partitioned_reference(src, ref, S, off, sl, nd, nb, 8, G, True, key)
    for blocks in (1, 3, 100):
        got = torch.zeros_like(ref)
        assert K.encode_partitioned_cuda(src, got, S, off, sl, nd, nb, 8, G, True, key, max_blocks=blocks)
        assert torch.equal(ref, got), blocks
    got = torch.zeros_like(ref)
    C.encode_partitioned(src, got, S, off, sl, nd, nb, 8, G, True, key)  # the public entry point
    assert torch.equal(ref, got)

    m4 = torch.empty(nd, C.message_bytes(nb * sl, 4, G), dtype=torch.uint8, device="cuda")
    assert not K.encode_partitioned_cuda(src, m4, S, off, sl, nd, nb, 4, G, True, key)
    big = torch.empty(nd, C.message_bytes(nb * sl, 8, 2048), dtype=torch.uint8, device="cuda")
    assert not K.encode_partitioned_cuda(src, big, S, off, sl, nd, nb, 8, 2048, True, key)
    view = torch.empty(nd * nb * S + 1, device="cuda")[1:]  # 4 bytes past a 16-byte boundary
    view.copy_(src)
    assert not K.encode_partitioned_cuda(view, got, S, off, sl, nd, nb, 8, G, True, key)
    got.zero_()
    K.encode_partitioned(view, got, S, off, sl, nd, nb, 8, G, True, key)
    assert torch.equal(ref, got)


# ----------------------------------------------------------------------------------------------------
# Reduce + requantize (TLq-HS between hops): CUDA == torch reference == Triton, byte for byte.

# (ndest, m, nsrc, bits_in, group_in, group_out); m elements per destination, n = ndest * m
RQ_CASES = [
    (2, 7 * 128, 2, 8, 128, 128),     # 7 groups per destination: a warp's last 1024 elements partly empty
    (1, 1024, 1, 8, 128, 128),
    (3, 5 * 128, 3, 8, 128, 128),     # 3 sources: the source loop
    (2, 3 * 256, 2, 8, 32, 256),      # G_IN < G_OUT: 8 input scales per output group
    (2, 1024, 2, 8, 2048, 32),        # G_IN > G_OUT, 32-element output groups (one lane each)
    (3, 9 * 64, 2, 4, 64, 64),        # 4-bit input
    (2, 5 * 512, 3, 4, 128, 512),
    (1, 4 * 128, 2, 4, 256, 128),     # an input group spans two output groups
]


def _rq_messages(case, seed, special):
    """nsrc random messages (uint8 [nsrc, bytes]): random codes, scales spread over decades; `special`:
    input group 0 all-zero codes with scale 0, group 1 tiny (< 2^-96 after dequantization), group 2 an
    Inf scale in source 0, group 3 a NaN scale in the last source, group 5 an outlier scale."""
    nd, m, ns, bi, gi, go = case
    n = nd * m
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = n * bi // 8
    msgs = torch.randint(0, 256, (ns, C.message_bytes(n, bi, gi)), dtype=torch.uint8, device="cuda", generator=g)
    scales = torch.exp(torch.randn(ns, n // gi, device="cuda", generator=g) * 2) * 1e-3
    if special:
        gb = gi * bi // 8  # code bytes per input group
        msgs[:, :gb] = 0x88 if bi == 4 else 128
        scales[:, 0] = 0.0
        scales[:, 1 % (n // gi)] = 1e-32
        scales[0, 2 % (n // gi)] = float("inf")
        scales[-1, 3 % (n // gi)] = float("nan")
        scales[:, 5 % (n // gi)] *= 1e4
    msgs[:, nb:] = scales.contiguous().view(torch.uint8).view(ns, -1)
    return msgs


def _padded(t, align):
    """A copy of t [rows, k] whose rows start `align`-byte aligned (extra zero bytes at the end of each)."""
    k = t.shape[1]
    kp = (k + align - 1) // align * align
    out = torch.zeros(t.shape[0], kp, dtype=t.dtype, device=t.device)
    out[:, :k] = t
    return out


def _run_rq(msgs, case, key, pad_out, src=None, **kw):
    """Reference, CUDA and Triton outputs ([ndest, message bytes] each; buffers prefilled differently so
    that an unwritten byte shows). The kernels read `src` (default msgs: the same messages, maybe in
    padded rows; the reference takes exact rows). pad_out: output rows padded to 16 bytes."""
    src = msgs if src is None else src
    nd, m, ns, bi, gi, go = case
    mb = C.message_bytes(m, 4, go)
    width = (mb + 15) // 16 * 16 if pad_out else mb
    ref = torch.full((nd, width), 7, dtype=torch.uint8, device="cuda")
    got = torch.full_like(ref, 9)
    tri = torch.full_like(ref, 11)
    C.reduce_requantize_reference(msgs, ref[:, :mb], nd * m, bi, gi, 4, go, nd, key)
    ran = K.reduce_requantize_cuda(src, got, nd * m, bi, gi, 4, go, nd, key, **kw)
    K.reduce_requantize_triton(src, tri, nd * m, bi, gi, 4, go, nd, key)
    return ran, ref[:, :mb], got[:, :mb], tri[:, :mb]


@pytest.mark.parametrize("special", [False, True], ids=["random", "special"])
@pytest.mark.parametrize("case", RQ_CASES, ids=[f"d{c[0]}_m{c[1]}_s{c[2]}_b{c[3]}_gi{c[4]}_go{c[5]}" for c in RQ_CASES])
def test_cuda_requant_equals_reference(case, special):
    """Both input layouts (rows as they come, 4-byte code loads where not 16-byte aligned; rows padded to
    16 bytes) and both output layouts, every group-size relation, 1..3 sources and destinations."""
    if K.cuda_extension() is None:
        pytest.skip("CUDA extension not available")
    nd, m, ns, bi, gi, go = case
    key = C.derive_key(nd, m, ns, gi, go)
    msgs = _rq_messages(case, seed=m + gi, special=special)
    for pad_in in (False, True):
        src = _padded(msgs, 16) if pad_in else msgs
        for pad_out in (False, True):
            ran, ref, got, tri = _run_rq(msgs, case, key, pad_out, src=src)
            assert ran, "the CUDA kernel should cover this case"
            assert torch.equal(ref, got), (case, special, pad_in, pad_out, (ref != got).nonzero()[:8].tolist())
            assert torch.equal(tri, got), (case, special, pad_in, pad_out)
    if special:  # the NaN / Inf groups really were flagged; zero and tiny ones sent as zeros
        scales = got[:, m // 2:].contiguous().view(torch.float32)
        assert torch.isnan(scales).sum() >= 1
        if gi >= go and nd * m // gi >= 4:
            assert (scales == 1.0).sum() >= 2 * (gi // go)


def test_cuda_requant_large():
    """The benchmark's shape at 4M elements: 2 int8 messages from the encode (2 x 2, Hadamard, real
    outliers) -> 2 int4 messages; also 3 sources (the loop) and 4-bit input on the same data."""
    if K.cuda_extension() is None:
        pytest.skip("CUDA extension not available")
    L, N, S = 2, 2, 1 << 20
    g = torch.Generator(device="cuda").manual_seed(3)
    grad = torch.randn(L * N * S, device="cuda", generator=g)
    grad[::4097] *= 50
    key = C.derive_key(1, 2, 3)
    m1 = torch.empty(L, C.message_bytes(N * S, 8, 128), dtype=torch.uint8, device="cuda")
    C.encode_partitioned_reference(grad, m1, S, 0, S, L, N, 8, 128, True, key)
    for msgs, bi in ((m1, 8), (torch.cat([m1, m1[:1]]), 8)):
        case = (N, S, msgs.shape[0], bi, 128, 128)
        ran, ref, got, tri = _run_rq(msgs, case, key, False)
        assert ran and torch.equal(ref, got) and torch.equal(tri, got), msgs.shape
    m4 = torch.empty(L, C.message_bytes(N * S, 4, 128), dtype=torch.uint8, device="cuda")
    C.encode_partitioned_reference(grad, m4, S, 0, S, L, N, 4, 128, True, key)
    ran, ref, got, tri = _run_rq(m4, (N, S, L, 4, 128, 128), key, False)
    assert ran and torch.equal(ref, got) and torch.equal(tri, got)


def test_cuda_requant_grid_loop_and_dispatch():
    """A capped grid (warps loop) gives the same bytes; the public entry point uses the CUDA kernel;
    uncovered cases (8-bit output, G_IN 96 or 16, G_OUT 1024, CPU tensors) return False and the
    dispatcher's Triton fallback still matches the reference."""
    if K.cuda_extension() is None:
        pytest.skip("CUDA extension not available")
    case = (2, 40 * 1024, 2, 8, 128, 128)
    key = C.derive_key(9)
    msgs = _rq_messages(case, seed=9, special=True)
    for blocks in (1, 3):
        ran, ref, got, _ = _run_rq(msgs, case, key, True, max_blocks=blocks)
        assert ran and torch.equal(ref, got), blocks
    nd, m = 2, 40 * 1024
    out = torch.zeros(nd, C.message_bytes(m, 4, 128), dtype=torch.uint8, device="cuda")
    C.reduce_requantize(msgs, out, nd * m, 8, 128, 4, 128, nd, key)  # the public entry point
    assert torch.equal(out, ref)

    for (bi, gi, bo, go, n) in ((8, 128, 8, 128, 2048), (8, 96, 4, 128, 1536), (8, 16, 4, 128, 2048),
                                (4, 128, 4, 1024, 4096)):
        src = _rq_messages((2, n // 2, 2, bi, gi, 128), seed=n, special=False)
        ref = torch.zeros(2, C.message_bytes(n // 2, bo, go), dtype=torch.uint8, device="cuda")
        got = torch.zeros_like(ref)
        assert not K.reduce_requantize_cuda(src, got, n, bi, gi, bo, go, 2, key), (bi, gi, bo, go)
        C.reduce_requantize_reference(src, ref, n, bi, gi, bo, go, 2, key)
        K.reduce_requantize(src, got, n, bi, gi, bo, go, 2, key)
        assert torch.equal(ref, got), (bi, gi, bo, go)
    cpu = msgs.cpu()
    assert not K.reduce_requantize_cuda(cpu, out.cpu(), nd * m, 8, 128, 4, 128, nd, key)
