"""The cross-entropy Triton kernels compile for sm_90 (H100/H200) on a CPU-only host (Triton's compiler and
ptxas need no GPU), with the launchers' tiles, for bf16 and fp32 logits; their PTX reads and writes the
logits with 16-byte accesses when the row stride allows it (what their speed relies on)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megacoat.kernels import cross_entropy as L
from megacoat.kernels.triton import cross_entropy as K

target = GPUTarget("cuda", 90, 32)


def comp(fn, sig, consts, warps):
    full = dict(sig, **{k: "constexpr" for k in consts})
    # pointers, row length and strides divisible by 16: the launcher's specialization at padded vocabularies
    # `valid` (the unpadded vocabulary, e.g. GPT-2's 50257) gets none: the loads must vectorize without it.
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if (t.startswith("*") or t == "i32") and a != "valid"}
    src = ASTSource(fn=fn, signature={a: full[a] for a in fn.arg_names}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": warps}).asm["ptx"]


for x in ("*bf16", "*fp32"):
    block, warps = L.TILES["row_stats"]
    ptx = comp(K.row_stats_kernel, {"x_ptr": x, "tgt_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32", "t_ptr": "*fp32",
                                    "V": "i32", "valid": "i32", "stride": "i32"}, {"BLOCK": block}, warps)
    assert "ld.global.v4.b32" in ptx, ("row_stats", x, "no 16-byte loads")
    block, warps = L.TILES["softmax_grad"]
    ptx = comp(K.softmax_grad_kernel, {"x_ptr": x, "g_ptr": x, "lse_ptr": "*fp32", "tgt_ptr": "*i64", "gl_ptr": "*fp32",
                                       "V": "i32", "valid": "i32", "stride_x": "i32", "stride_g": "i32"},
               {"BLOCK": block}, warps)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, ("softmax_grad", x, "no 16-byte accesses")
    assert "ctaid.y" not in ptx, "softmax_grad: 1-D grid expected"
print("ok")
'''


def test_cross_entropy_kernels_compile_for_sm90():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-5000:]
