"""Every SDP4Bit Triton kernel compiles for sm_90 (H100/H200) with the constexpr variants its
launchers use, on a CPU-only host (Triton's compiler and ptxas run without a GPU), and the PTX has
the properties the kernels' speed rests on: vector global loads (no byte-wise ones), no 64-bit integer division,
no float<->int conversion or floor instructions in the quantizer (its floor is one fma.rm and one
add.rm per element, whose bits hold the code; dequantization uses the 1.5*2^23 trick), and no FMA
contraction (bit-exactness with the references): no fma.rn at all."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megacoat.kernels.triton import sdp4bit_kernels as K
from megacoat.kernels import sdp4bit as L

target = GPUTarget("cuda", 90, 32)
u8, f32, bf16, i32 = "*u8", "*fp32", "*bf16", "i32"
ALIGNED = ("src_ptr", "out_ptr", "in_ptr", "master_ptr", "w_ptr", "shard_size", "slice_off", "slice_len", "msg_bytes",
           "n", "m", "msg", "msg_in", "msg_out")  # what Triton specializes as multiples of 16 at launch


PER_THREAD = L.TILE // (L.WARPS * 32)  # elements a thread quantizes: one fma.rm and one add.rm each


def comp(fn, sig, consts, quantizes):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a in ALIGNED}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=target, options={"num_warps": L.WARPS, "enable_fp_fusion": False}).asm["ptx"]
    name = f"{fn.__name__}{consts}"
    assert re.search(r"ld\.global\S*\.v[24]\.", ptx), ("no vector loads", name)
    assert not re.search(r"ld\.global\S*\.[bu](8|16) ", ptx), ("byte-wise loads", name)
    assert not re.search(r"(div|rem)\.[su]64", ptx), ("64-bit integer division", name)
    cvt = r"cvt\.(rn|rz|rm|rp)i?\.[su]32\.f32|cvt\.rn\.f32\.[su]32|cvt\.rmi(\.ftz)?\.f32"
    assert not re.search(cvt, ptx), ("float<->int conversion or floor", name)
    assert "fma.rn.f32" not in ptx, ("FMA contraction", name)
    rounding = (len(re.findall(r"fma\.rm\.f32", ptx)), len(re.findall(r"add\.rm\.f32", ptx)))
    assert rounding == ((PER_THREAD, PER_THREAD) if quantizes else (0, 0)), ("quantizer rounding", name, rounding)
    return ptx


n = 0
for bits in (4, 8):
    for had in (False, True):
        for G in (128, 2048):
            for pack, src in ((4, f32), (8, bf16)):
                comp(K.encode_partitioned_kernel, dict(src_ptr=src, out_ptr=u8, shard_size=i32, slice_off=i32,
                     slice_len=i32, ndest=i32, msg_bytes=i32, k1=i32, k2=i32),
                     dict(BITS=bits, G=G, R=L.TILE // G, HADAMARD=had, PACK=pack, HW=True), True); n += 1
            for out, pack in ((f32, 4), (bf16, 8)):
                comp(K.reduce_decode_kernel, dict(in_ptr=u8, out_ptr=out, nsrc=i32, n=i32, msg=i32, scale="fp32"),
                     dict(BITS=bits, G=G, R=L.TILE // G, HADAMARD=had, OUT_BF16=out == bf16, HW=True, PACK=pack),
                     False)
                n += 1
    for bo, gi, go in ((4, 128, 128), (8, 32, 128), (4, 2048, 128)):
        comp(K.reduce_requantize_kernel, dict(in_ptr=u8, out_ptr=u8, nsrc=i32, n=i32, m=i32, msg_in=i32, msg_out=i32,
             k1=i32, k2=i32), dict(BITS_IN=bits, G_IN=gi, BITS_OUT=bo, G_OUT=go, R=L.TILE // go, PACK=4, HW=True),
             True); n += 1
    for direct in (False, True):
        for w, pack in ((bf16, 8), (f32, 4)):
            comp(K.encode_delta_kernel, dict(master_ptr=f32, w_ptr=w, out_ptr=u8, n_groups=i32, k1=i32, k2=i32),
                 dict(BITS=bits, G=2048, R=L.TILE // 2048, DIRECT=direct, W_BF16=w == bf16, HW=True, PACK=4), True)
            comp(K.apply_delta_kernel, dict(in_ptr=u8, w_ptr=w, n=i32, msg=i32),
                 dict(BITS=bits, G=2048, R=L.TILE // 2048, DIRECT=direct, W_BF16=w == bf16, HW=True, PACK=pack),
                 False)
            n += 2
print("OK", n)
'''


@pytest.mark.slow
def test_sdp4bit_kernels_compile_for_sm90_with_fast_ptx():
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="0")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
