"""Launchers of the SDP4Bit Triton kernels (kernels/triton/sdp4bit_kernels.py).

Same signatures as the references `*_reference` in `megacoat.comm.codecs`, which decides when to
call them (CUDA tensors and Triton importable). Triton is imported lazily: this module imports
without it. Set MEGACOAT_NO_TRITON=1 to force the references. The constants of the stochastic
rounding hash live here (the lower layer) so that both implementations share one definition.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

HASH_C1, HASH_C2 = 0x045D9F3B, 0x119DE1F3
MIN_AMAX = 2.0 ** -96
# Elements per program: ~4096 keeps enough bytes in flight per SM for these bandwidth-bound passes.
TILE = 4096
_OPTS = dict(enable_fp_fusion=False)  # no FMA contraction: bit-identical to the references


@lru_cache(maxsize=None)
def available() -> bool:
    if os.environ.get("MEGACOAT_NO_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def _k():
    from .triton import sdp4bit_kernels
    return sdp4bit_kernels


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _groups_per_program(group: int) -> int:
    return max(1, TILE // group)


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4


def _is_bf16(t: torch.Tensor) -> bool:
    if t.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"SDP4Bit kernels take bf16 or fp32 weights/gradients, got {t.dtype}")
    return t.dtype == torch.bfloat16


def _f32(buf: torch.Tensor) -> torch.Tensor:
    """The fp32 view of a uint8 message buffer (its scales are read/written through it)."""
    return buf.view(torch.float32)


def encode_partitioned(src, out, shard_size, slice_off, slice_len, ndest, nblocks, bits, group, hadamard, key):
    n = nblocks * slice_len
    msg = out.shape[-1]
    n_groups = ndest * n // group
    ng = _groups_per_program(group)
    _k().encode_partitioned_kernel[(_cdiv(n_groups, ng),)](
        src, out, _f32(out), n_groups, shard_size, slice_off, slice_len, ndest, n // group, slice_len // group, msg,
        key[0], key[1], BITS=bits, G=group, NG=ng, HADAMARD=bool(hadamard), num_warps=_warps(ng * group), **_OPTS)


def reduce_requantize(msgs, out, n, bits_in, group_in, bits_out, group_out, ndest, key):
    n_groups = n // group_out
    ng = _groups_per_program(group_out)
    _k().reduce_requantize_kernel[(_cdiv(n_groups, ng),)](
        msgs, _f32(msgs), out, _f32(out), n_groups, msgs.shape[0], n, msgs.shape[-1], out.shape[-1],
        n_groups // ndest, key[0], key[1], BITS_IN=bits_in, G_IN=group_in, BITS_OUT=bits_out, G_OUT=group_out,
        NG=ng, num_warps=_warps(ng * group_out), **_OPTS)


def reduce_decode(msgs, out, n, bits, group, hadamard, scale):
    _k().reduce_decode_kernel[(_cdiv(n, TILE),)](
        msgs, _f32(msgs), out, msgs.shape[0], n, msgs.shape[-1], float(scale), BITS=bits, G=group,
        HADAMARD=bool(hadamard), BLOCK=TILE, OUT_BF16=_is_bf16(out), num_warps=_warps(TILE), **_OPTS)


def encode_delta(master, weights, out, bits, group, key, directly):
    n_groups = master.numel() // group
    ng = _groups_per_program(group)
    _k().encode_delta_kernel[(_cdiv(n_groups, ng),)](
        master, weights, out, _f32(out), n_groups, key[0], key[1], BITS=bits, G=group, NG=ng,
        DIRECT=bool(directly), W_BF16=_is_bf16(weights), num_warps=_warps(ng * group), **_OPTS)


def apply_delta(msgs, weights, bits, group, directly):
    total = weights.numel()
    _k().apply_delta_kernel[(_cdiv(total, TILE),)](
        msgs, _f32(msgs), weights, total, total // msgs.shape[0], msgs.shape[-1], BITS=bits, G=group,
        DIRECT=bool(directly), BLOCK=TILE, W_BF16=_is_bf16(weights), num_warps=_warps(TILE), **_OPTS)
