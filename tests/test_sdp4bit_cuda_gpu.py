"""The CUDA C++ TLq-HS encode (csrc/sdp4bit_encode.cu) against the torch reference on the GPU, bit for
bit: message bytes (codes and scales) equal, for fp32 and bf16 buckets, with and without the
Hadamard transform, every group size it covers, several partitions (ndest x nblocks), slices
whose group count leaves a warp's last 512 elements partly empty, messages whose rows are not
16-byte aligned (4-byte code stores), outliers, all-zero / tiny / Inf / NaN groups. Also: the
Triton kernel gives the same bytes, and the cases the kernel does not cover fall back."""
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
        pytest.fail("csrc/sdp4bit_encode.cu did not build or is disabled (MEGACOAT_NO_CUDA_EXT / "
                    "MEGACOAT_SDP4BIT_NO_CUDA): see the warning above")


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
