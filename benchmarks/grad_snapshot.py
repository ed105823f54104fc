"""Full-model gradients of one training step, to compare two layouts or code paths parameter by parameter.

    torchrun --nproc-per-node N benchmarks/grad_snapshot.py <pretrain_gpt.py flags> --out FILE.safetensors
    python benchmarks/grad_snapshot.py --compare A.safetensors B.safetensors

The first form builds the trainer from the flags, runs the forward and backward of the first global
batch (no optimizer step), sums the gradients of sequence-parallel parameters over TP (what the
optimizer does before its step), gathers every TP shard into the full tensor and writes them by global
name from rank 0, with the loss and the peak memory in the file's metadata. Data-parallel size must be
1 (each rank then holds its whole gradient: no reduction to imitate). The second form prints the loss
of each file and the parameters whose gradients differ most (relative L2 error): the tool that finds
which layer a layout or an eager/compiled difference breaks.
"""
import argparse
import json
import sys

import torch
import torch.distributed as dist


def _full_gradients(trainer) -> dict:
    from megacoat.parallel.layers import full_from_shards

    ctx = trainer.ctx
    out = {}
    for p in trainer.model.parameters():
        g = p.main_grad.detach().float()
        if getattr(p, "sequence_parallel", False) and ctx.tp_size > 1:
            g = g.clone()
            dist.all_reduce(g, group=ctx.tp_group)
        if p.tensor_model_parallel and ctx.tp_size > 1:
            parts = [torch.empty_like(g) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=ctx.tp_group)
            dim, sizes = p.shard_info
            g = full_from_shards(parts, dim, sizes)
        out[p.global_name] = g.cpu().contiguous()
    return out


def snapshot(argv, out_path: str) -> None:
    from safetensors.torch import save_file

    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer

    cfg = parse_args(argv)
    tr = Trainer(cfg)
    if tr.ctx.dp_size != 1 or tr.ctx.pp_size != 1:
        raise SystemExit(f"grad_snapshot: needs data- and pipeline-parallel size 1 (got DP={tr.ctx.dp_size}, "
                         f"PP={tr.ctx.pp_size}): give as many ranks as --tensor-model-parallel-size")
    micro = tr._next_micro_batches(tr.data_iterators().train)
    tr.optimizer.zero_grad()
    loss = tr.forward_backward(micro)
    opt = tr.optimizer
    if hasattr(opt, "finish_grad_sync"):  # ZeRO (DP=1: its reduce-scatter copies the bucket onto itself)
        opt.finish_grad_sync()
    else:
        opt.grad_buffer.finalize()  # parameters without a gradient read zeros
    grads = _full_gradients(tr)
    peak = torch.cuda.max_memory_allocated(tr.device) / 2 ** 30 if tr.device.type == "cuda" else 0.0
    peaks = torch.tensor([peak], device=tr.device)
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if not dist.is_initialized() or dist.get_rank() == 0:
        meta = {"loss": f"{float(loss):.8f}", "peak_gib": f"{peaks.item():.3f}", "argv": json.dumps(argv)}
        save_file(grads, out_path, metadata=meta)
        print(f"grad_snapshot: loss {float(loss):.6f}, peak {peaks.item():.2f} GiB, {len(grads)} tensors -> {out_path}")
    tr.close()


def compare(a_path: str, b_path: str, top: int = 15) -> list:
    """(relative L2 error, name) of every parameter, worst first; prints the header and the worst `top`."""
    from safetensors import safe_open

    tensors, metas = [], []
    for path in (a_path, b_path):
        with safe_open(path, "pt") as f:
            metas.append(f.metadata())
            tensors.append({k: f.get_tensor(k) for k in f.keys()})
    a, b = tensors
    if set(a) != set(b):
        raise SystemExit(f"grad_snapshot: different parameters: only in A {sorted(set(a) - set(b))[:5]}, "
                         f"only in B {sorted(set(b) - set(a))[:5]}")
    rows = []
    for name in a:
        x, y = a[name].float(), b[name].float()
        if x.shape != y.shape:  # vocabulary padding differs between TP sizes
            rows_ = min(x.shape[0], y.shape[0])
            x, y = x[:rows_], y[:rows_]
        rows.append(((x - y).norm().item() / max(y.norm().item(), 1e-30), name))
    rows.sort(reverse=True)
    for path, m in zip((a_path, b_path), metas):
        print(f"{path}: loss {m.get('loss')}, peak {m.get('peak_gib')} GiB")
    for err, name in rows[:top]:
        print(f"{err:10.3e}  {name}")
    return rows


def main():
    if sys.argv[1:2] == ["--compare"]:
        p = argparse.ArgumentParser()
        p.add_argument("--compare", nargs=2, required=True)
        p.add_argument("--top", type=int, default=15)
        a = p.parse_args()
        compare(*a.compare, top=a.top)
        return
    argv = sys.argv[1:]
    if "--out" not in argv:
        raise SystemExit("grad_snapshot: --out FILE.safetensors is required")
    i = argv.index("--out")
    out = argv[i + 1]
    del argv[i:i + 2]
    snapshot(argv, out)


if __name__ == "__main__":
    main()
