#!/usr/bin/env python
"""The fused RoPE over the QKV output (--rope-fusion) against the torch operations it replaces, compiled by
Inductor as the layers are: forward (q, k rotated, v copied) and backward (the QKV gradient from SDPA-strided
dq, dk, dv), median ms (CUDA events) and the bytes each fused kernel moves against ~4.3 TB/s. Also checks that
the two paths agree (within bf16 rounding), and the backward's amax (for the FP8 QKV linear) is max |dqkv|.

    python benchmarks/rope_bench.py --out /tmp/rope.json [--iters 50] [--sweep]

--sweep also times each kernel under every (rows, groups per program, warps) of a grid (kernels/rope.py TILES).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megacoat.kernels import rope as K  # noqa: E402
from megacoat.model.rope import RotaryEmbedding, apply_rotary  # noqa: E402

from bench_timing import HBM_GBPS, sweep_tiles, timed  # noqa: E402

# (name, s, b, groups, heads per group, d): the 1.36B layer, the 7B layer at micro-batch 2, GQA layers (4 and 8 query
# heads per group), an MQA layer (32 query heads, one group: the launcher's fewer rows per program)
SHAPES = [("1.36B", 2048, 4, 16, 1, 128), ("7B", 2048, 2, 32, 1, 128), ("gqa 32/8", 2048, 2, 8, 4, 128),
          ("gqa 64/8", 2048, 2, 8, 8, 128), ("mqa 32/1", 2048, 2, 1, 32, 128)]


def unfused(qkv, cos, sin):
    """The torch operations of Attention._core without --rope-fusion."""
    s, b, g, slots, d = qkv.shape
    q = qkv[:, :, :, : slots - 2].reshape(s, b, g * (slots - 2), d)
    k = qkv[:, :, :, slots - 2]
    v = qkv[:, :, :, slots - 1].contiguous()
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def close(a, b) -> bool:
    """Within bf16 rounding of the terms (the torch operations may round each product to bf16): a wrong sign,
    half or head differs by O(1)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2 ** -7 * b.abs() + 2 ** -6 * b.abs().max()).all())


REPS = 10  # launches per timed sample: a single ~50 us kernel on an idle GPU times its host launch too
SWEEP = [(r, g, w) for r in (8, 16, 32, 64) for g in (1, 2, 4) for w in (4, 8) if r * 64 // (32 * w) >= 4]


def run_shape(name, s, b, g, qpg, d, iters: int, sweep: bool = False) -> dict:
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(s, b, g, qpg + 2, d, device=dev, generator=gen).to(torch.bfloat16)
    cos, sin = RotaryEmbedding(d, s, 10000.0, device=dev)(torch.arange(s, device=dev).expand(b, s), torch.bfloat16)
    # gradients as SDPA's backward hands them: [b, heads, s, d] tensors, seen as [s, b, heads, d]
    dq = torch.randn(b, g * qpg, s, d, device=dev, generator=gen).to(torch.bfloat16).permute(2, 0, 1, 3)
    dk = torch.randn(b, g, s, d, device=dev, generator=gen).to(torch.bfloat16).permute(2, 0, 1, 3)
    dv = torch.randn(b, g, s, d, device=dev, generator=gen).to(torch.bfloat16).permute(2, 0, 1, 3)
    nbytes = qkv.numel() * 2 * 2  # read the QKV output (or its gradients), write as much

    compiled = torch.compile(unfused)
    x = qkv.detach().requires_grad_(True)

    def torch_fwd():
        return compiled(x, cos, sin)

    def torch_bwd():  # forward + backward (no accumulation into x.grad: that would add a pass)
        return torch.autograd.grad(compiled(x, cos, sin), x, (dq, dk, dv))[0]

    same_fwd = all(close(a, c) for a, c in zip(K.rope_qkv(qkv, cos, sin), torch_fwd()))
    dqkv, amax = K.rope_qkv_backward(dq, dk, dv, cos, sin, True)
    same_bwd = close(dqkv, torch_bwd()) and bool(amax == dqkv.abs().amax().float())
    t = dict(fused_fwd=timed(lambda: K.rope_qkv(qkv, cos, sin), iters, reps=REPS),
             fused_bwd=timed(lambda: K.rope_qkv_backward(dq, dk, dv, cos, sin), iters, reps=REPS),
             fused_bwd_amax=timed(lambda: K.rope_qkv_backward(dq, dk, dv, cos, sin, True), iters, reps=REPS),
             torch_fwd=timed(torch_fwd, iters, reps=REPS), torch_fwd_bwd=timed(torch_bwd, iters, reps=REPS))
    t["torch_bwd_estimate"] = t["torch_fwd_bwd"] - t["torch_fwd"]
    r = dict(shape=name, qkv=list(qkv.shape), same_forward=same_fwd, same_backward=same_bwd,
             ms={k: round(v, 4) for k, v in t.items()},
             fused_fwd_pct_of_hbm=round(100 * nbytes / (t["fused_fwd"] * 1e-3) / 1e9 / HBM_GBPS, 1),
             fused_bwd_pct_of_hbm=round(100 * nbytes / (t["fused_bwd"] * 1e-3) / 1e9 / HBM_GBPS, 1))
    print(json.dumps(r), flush=True)
    if sweep:
        r["sweep"] = sweep_tiles(K.TILES, {"rope_fwd": lambda: K.rope_qkv(qkv, cos, sin),
                                           "rope_bwd": lambda: K.rope_qkv_backward(dq, dk, dv, cos, sin, True)},
                                 SWEEP, iters, reps=REPS)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rope_bench.py times GPU kernels: run it on a CUDA device")
    rows = [run_shape(*shape, iters=args.iters, sweep=args.sweep) for shape in SHAPES]
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
