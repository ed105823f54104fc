"""Launchers of the SDP4Bit Triton kernels (kernels/triton/sdp4bit_kernels.py).

Same signatures as the references `*_reference` in `megacoat.comm.codecs`, which decides when to
call them (CUDA tensors and Triton importable). Triton is imported lazily: this module imports
without it. Set MEGACOAT_NO_TRITON=1 to force the references. `encode_partitioned` and
`reduce_requantize` run the CUDA C++ kernels of csrc/sdp4bit_encode.cu and csrc/sdp4bit_requantize.cu where
they load and cover the case (MEGACOAT_NO_CUDA_EXT=1: Triton). The constants of the stochastic
rounding hash live here (the lower layer) so that both implementations share one definition.
"""
from __future__ import annotations

import functools
import os

import torch

from . import triton_available

HASH_C1, HASH_C2 = 0x045D9F3B, 0x119DE1F3
MIN_AMAX = 2.0 ** -96
# Elements per program: 8K keeps enough bytes in flight per SM for these bandwidth-bound passes
# (8 warps: 32 elements per thread); a tile is [TILE / C, C] with C the group size.
TILE = 8192
WARPS = 8
_OPTS = dict(enable_fp_fusion=False)  # no FMA contraction: bit-identical to the references


def available() -> bool:
    """Triton kernels can run (devices are checked by callers)."""
    return triton_available()


def _k():
    from .triton import sdp4bit_kernels
    return sdp4bit_kernels


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _rows(group: int) -> int:
    return max(1, TILE // group)


def _hw() -> bool:
    """The kernels' HW flag: compiled for the GPU, so they may use instructions the interpreter lacks (the
    bf16 rounding cvt: it truncates bf16 casts; inline PTX fma.rm / add.rm for the quantizer's floor)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def _is_bf16(t: torch.Tensor) -> bool:
    if t.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"SDP4Bit kernels take bf16 or fp32 weights/gradients, got {t.dtype}")
    return t.dtype == torch.bfloat16


def _check_msg(buf: torch.Tensor) -> torch.Tensor:
    """Kernels read scales as fp32 and 4-bit codes as 2/4-byte words: 4-byte aligned messages."""
    if buf.shape[-1] % 4 or buf.data_ptr() % 4:
        raise ValueError(f"message buffers must hold a multiple of 4 bytes at a 4-byte aligned address, got "
                         f"{buf.shape[-1]} bytes at {buf.data_ptr()}")
    return buf


def _pack(t: torch.Tensor) -> int:
    """Elements per 4-bit code word: as many as one 16-byte access of the fp32/bf16 data holds."""
    return 4 if t.element_size() == 4 else 8


def cuda_extension():
    """The CUDA C++ encode and reduce-requantize (csrc/sdp4bit_*.cu), or None: not built, no GPU or
    MEGACOAT_NO_CUDA_EXT=1 (the Triton kernels run)."""
    from .cuda_ext import load_extension
    return load_extension("sdp4bit")  # cached


def encode_partitioned_cuda(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard, key,
                            max_blocks=0) -> bool:
    """The CUDA kernel where it covers the case (8-bit codes, groups of 32..512, 16-byte aligned
    fp32/bf16 sources, CUDA tensors): True if it ran, False if the caller must run another."""
    if bits != 8 or not src.is_cuda:
        return False
    ext = cuda_extension()
    if ext is None:
        return False
    return bool(ext.encode_partitioned(src, _check_msg(out), shard_size, slice_off, slice_len, ndest, nblocks, bits,
                                       group, bool(hadamard), key[0], key[1], max_blocks))


def encode_partitioned(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard, key):
    """The CUDA kernel where it applies (same bytes; faster Hadamard), else the Triton one."""
    if not encode_partitioned_cuda(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard,
                                   key):
        encode_partitioned_triton(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard,
                                  key)


def encode_partitioned_triton(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard, key):
    r = _rows(group)
    _k().encode_partitioned_kernel[(_cdiv(slice_len // group, r), nblocks, ndest)](
        src, _check_msg(out), shard_size, slice_off, slice_len, ndest, out.shape[-1], key[0], key[1],
        BITS=bits, G=group, R=r, HADAMARD=bool(hadamard), PACK=_pack(src), HW=_hw(), num_warps=WARPS, **_OPTS)


# The reduce-requantize's grid: at most this many blocks per SM (its warps then loop over units). On the H200,
# 256M elements: 0.107-0.108 ms at 8-32 per SM against 0.113 ms uncapped (the grid sweep of
# `benchmarks/sdp4bit_bench.py --out OUT.json`). 0 = uncapped.
REQUANTIZE_BLOCKS_PER_SM = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def reduce_requantize_cuda(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key,
                           max_blocks=None) -> bool:
    """The CUDA kernel where it covers the case (4-bit output, int8/int4 input, output groups of 32..512,
    input groups a power of two >= 32, CUDA tensors): True if it ran, False if the caller must run another.
    max_blocks: the grid cap (0 = uncapped; None = REQUANTIZE_BLOCKS_PER_SM per SM)."""
    if bits_out != 4 or not msgs.is_cuda:
        return False
    ext = cuda_extension()
    if ext is None or not hasattr(ext, "reduce_requantize"):  # an older build of the extension
        return False
    if max_blocks is None:
        max_blocks = REQUANTIZE_BLOCKS_PER_SM * _sm_count(msgs.device.index if msgs.device.index is not None
                                                            else torch.cuda.current_device())
    return bool(ext.reduce_requantize(_check_msg(msgs), _check_msg(out), n, bits_in, group_in, bits_out, group_out,
                                      ndest, key[0], key[1], max_blocks))


def reduce_requantize(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key):
    """The CUDA kernel where it applies (same bytes; 0.123 ms vs Triton's 0.216 for 256M elements on an H200,
    `benchmarks/sdp4bit_bench.py`), else the Triton one (it covers the cases the CUDA kernel does not)."""
    if not reduce_requantize_cuda(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key):
        reduce_requantize_triton(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key)


def reduce_requantize_triton(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key):
    m = n // ndest
    r = _rows(group_out)
    _k().reduce_requantize_kernel[(_cdiv(m // group_out, r), ndest)](
        _check_msg(msgs), _check_msg(out), msgs.shape[0], n, m, msgs.shape[-1], out.shape[-1], key[0], key[1],
        BITS_IN=bits_in, G_IN=group_in, BITS_OUT=bits_out, G_OUT=group_out, R=r, PACK=4, HW=_hw(), num_warps=WARPS,
        **_OPTS)


def reduce_decode(msgs, out, n, bits, group, hadamard, scale):
    r = _rows(group)
    _k().reduce_decode_kernel[(_cdiv(n // group, r),)](
        _check_msg(msgs), out, msgs.shape[0], n, msgs.shape[-1], float(scale), BITS=bits, G=group, R=r,
        HADAMARD=bool(hadamard), OUT_BF16=_is_bf16(out), HW=_hw(), PACK=_pack(out), num_warps=WARPS,
        **_OPTS)


def encode_delta(master, weights, out, bits, group, key, directly):
    n_groups = master.numel() // group
    r = _rows(group)
    _k().encode_delta_kernel[(_cdiv(n_groups, r),)](
        master, weights, _check_msg(out), n_groups, key[0], key[1], BITS=bits, G=group, R=r,
        DIRECT=bool(directly), W_BF16=_is_bf16(weights), HW=_hw(), PACK=_pack(master), num_warps=WARPS,
        **_OPTS)


def apply_delta(msgs, weights, bits, group, directly):
    nsrc = msgs.shape[0]
    n = weights.numel() // nsrc
    r = _rows(group)
    _k().apply_delta_kernel[(_cdiv(n // group, r), nsrc)](
        _check_msg(msgs), weights, n, msgs.shape[-1], BITS=bits, G=group, R=r, DIRECT=bool(directly),
        W_BF16=_is_bf16(weights), HW=_hw(), PACK=_pack(weights), num_warps=WARPS, **_OPTS)
