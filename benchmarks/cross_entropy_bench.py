#!/usr/bin/env python
"""The language-model loss on one GPU: forward + backward of the vocabulary-parallel cross entropy
(parallel/cross_entropy.py) at the 1.36B shape (8192 tokens x 32000 vocabulary, bf16 logits), through
the fused Triton kernels, through the torch references (the path without Triton), and through torch's
F.cross_entropy on fp32-upcast logits (what a plain PyTorch model does). Per path: median ms (CUDA
events), the memory the pass adds at its peak over the logits (the gradient included), and for the kernels
the bytes they move against ~4.3 TB/s. Also checks that the three losses and gradients agree.

    python benchmarks/cross_entropy_bench.py --out /tmp/ce.json [--tokens 8192 --vocab 32000] [--tiles]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megacoat.kernels import cross_entropy as K  # noqa: E402
from megacoat.parallel import cross_entropy as CE  # noqa: E402
from megacoat.parallel.context import ParallelContext  # noqa: E402

from bench_timing import HBM_GBPS, sweep_tiles, timed  # noqa: E402


def fwd_bwd(path: str, logits: torch.Tensor, target: torch.Tensor, group):
    x = logits.detach().requires_grad_(True)
    if path == "torch_fp32":
        loss = F.cross_entropy(x.float().view(-1, x.shape[-1]), target.view(-1), reduction="none")
    else:
        loss = CE.vocab_parallel_cross_entropy(x, target, group, fused=path == "kernels")
    loss.sum().backward()
    return loss.detach(), x.grad


def run_path(path: str, logits, target, group, iters: int) -> dict:
    loss, grad = fwd_bwd(path, logits, target, group)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(path, logits, target, group)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    ms = timed(lambda: fwd_bwd(path, logits, target, group), iters)
    return {"ms": ms, "peak_extra_GiB": extra / 2 ** 30}, loss, grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiles", action="store_true", help="also sweep each kernel's (BLOCK, num_warps) and report the "
                    "fastest (kernels/cross_entropy.py TILES)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    n, v = args.tokens, args.vocab
    logits = (torch.randn(n, 1, v, device="cuda") * 3).bfloat16()
    target = torch.randint(0, v, (n, 1), device="cuda")
    group = ParallelContext.single().tp_group
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": n, "vocab": v,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "paths": {}}
    outs = {}
    for path in ("kernels", "reference", "torch_fp32"):
        res["paths"][path], loss, grad = run_path(path, logits, target, group, args.iters)
        outs[path] = (loss.float().view(-1), grad.float())
        print(f"{path:12s} fwd+bwd {res['paths'][path]['ms']:.3f} ms, peak extra "
              f"{res['paths'][path]['peak_extra_GiB']:.2f} GiB", flush=True)
    ref_loss, ref_grad = outs["torch_fp32"]
    for path in ("kernels", "reference"):
        loss, grad = outs[path]
        res["paths"][path]["max_loss_rel_diff_vs_torch"] = ((loss - ref_loss).abs() / ref_loss.abs()).max().item()
        res["paths"][path]["max_grad_abs_diff_vs_torch"] = (grad - ref_grad).abs().max().item()
    # The two kernels alone: stats read the bf16 logits once, the gradient reads them and writes bf16.
    x = logits.view(n, v)
    tgt = target.view(-1)
    m, s, t = K.row_stats(x, tgt, v)
    lse = m + s.log()
    gl = torch.ones(n, device="cuda")
    for name, fn, nbytes in (("row_stats", lambda: K.row_stats(x, tgt, v), 2 * n * v),
                             ("softmax_grad", lambda: K.softmax_grad(x, lse, tgt, v, gl), 4 * n * v),
                             ("copy of the logits", lambda: x.clone(), 4 * n * v)):
        ms = timed(fn, args.iters)
        res[name] = {"ms": ms, "bytes": nbytes, "frac_of_hbm": nbytes / ms / 1e6 / HBM_GBPS}
        print(f"{name:20s} {ms * 1e3:8.1f} us  {100 * res[name]['frac_of_hbm']:.0f}% of HBM", flush=True)
    if args.tiles:
        grid = [(b, w) for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]
        res["tiles"] = sweep_tiles(K.TILES, {"row_stats": lambda: K.row_stats(x, tgt, v),
                                             "softmax_grad": lambda: K.softmax_grad(x, lse, tgt, v, gl)},
                                   grid, args.iters)
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
