"""The peer baseline: what plain PyTorch reaches on the same GPU, measured side by side with megacoat.

A plain PyTorch Llama-style model (RMSNorm, RoPE, SwiGLU, SDPA), fp32 parameters with bf16
autocast and fused AdamW, random tokens; optionally torch.compile per block, optionally torchao's
float8 training (`--float8`). It is a yardstick, not part of the library.

    python benchmarks/peer_plain_llama.py --compile --iters 30
"""
import argparse
import json
import os
import time

# The allocator setting megacoat's pretrain_gpt.py (and torchtitan's launcher) use, so that the peer is not
# measured with more fragmentation than megacoat; an allocator configuration of the caller's own wins. Written
# out here, not imported: the peer is plain PyTorch.
if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.heads, self.hd = heads, h // heads
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, self.hd).unbind(2)

        def rope(t):
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        q, k = rope(q), rope(k)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        g, u = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, vocab, h, layers, heads, ffn, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(h, eps=1e-5)
        self.out = nn.Linear(h, vocab, bias=False)
        hd = h // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(torch.arange(seq).float(), inv)
        e = torch.cat([f, f], -1)
        self.register_buffer("cos", e.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", e.sin()[None, :, None, :], persistent=False)

    def forward(self, tokens, labels):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--float8", choices=["tensorwise", "rowwise"], default=None,
                    help="torchao float8 training of the block linears (output layer stays bf16): the FP8 peer")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Llama(a.vocab, a.hidden, a.layers, a.heads, a.ffn, a.seq).to(dev)
    if a.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(a.float8),
                                   module_filter_fn=lambda mod, fqn: fqn != "out")
    if a.compile:
        for blk in model.blocks:
            blk.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n_params = sum(p.numel() for p in model.parameters())
    times = []
    for it in range(a.warmup + a.iters):
        tokens = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if it >= a.warmup:
            times.append(time.perf_counter() - t0)
    dt = sum(times) / len(times)
    tok_s = a.mbs * a.seq / dt
    matmul = a.layers * (4 * a.hidden ** 2 + 3 * a.hidden * a.ffn) + a.vocab * a.hidden
    flops_tok = 6 * matmul + 6 * a.seq * a.hidden * a.layers
    res = dict(run="peer plain PyTorch" + (f" + torchao float8 {a.float8}" if a.float8 else "")
               + (" + compile" if a.compile else " eager"), params=n_params,
               tokens_per_s=tok_s, tflops=flops_tok * tok_s / 1e12, step_ms=dt * 1e3,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30, loss=loss.item())
    print(json.dumps(res))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
