#!/usr/bin/env python
"""Megatron-LM <-> megacoat conversion: speed, bytes, exactness, and logits vs megatron-core.

    python benchmarks/megatron_convert_bench.py --out megatron_convert.json
    python benchmarks/megatron_convert_bench.py --smoke --out /tmp/m.json      # CPU check of the script

Parts (each runs on its own; a failure is recorded in the JSON and the others go on):
- convert: a Megatron `torch` checkpoint of a Llama-shaped model (bf16, TP=2, PP=2, written the way
  Megatron shards it) -> megacoat -> Megatron TP=4 -> megacoat; seconds, bytes read + written, host
  GB/s next to a plain file copy of the same bytes (conversion is host and disk work: the GPU's
  4300 GB/s is not its ceiling), and exact equality after the round trip.
- logits (CUDA + megatron-core): megatron-core's GPTModel forward on the GPU vs megacoat's after
  conversion, fp32 and bf16: max |diff|, argmax agreement, forward times (CUDA events).
"""
import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from provenance import source_commit  # noqa: E402

import torch  # noqa: E402


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def part_convert(a, work):
    from megacoat.checkpoint.model_io import read_model_tensors
    from megacoat.config import ModelConfig, resolve_model_defaults
    from megacoat.convert.megatron import megacoat_to_megatron, megatron_to_megacoat
    from megacoat.convert.megatron_model import args_from_model_config, megacoat_to_megatron as names_to_megatron
    from megacoat.convert.megatron_torch import write_torch_checkpoint
    m = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
                    group_query_attention=True, num_query_groups=a.groups, seq_length=2048,
                    normalization="RMSNorm", activation="swiglu", untie_embeddings_and_output_weights=True)
    resolve_model_defaults(m)
    vocab, padded = a.vocab, -(-a.vocab // 256) * 256
    g = torch.Generator().manual_seed(0)
    from megacoat.checkpoint.model_io import _parameter_skeleton
    tensors = {name: (torch.randn(p.shape if "word_emb" not in name and "output" not in name
                                  else (vocab, p.shape[1]), generator=g) * 0.02).to(torch.bfloat16)
               for name, p in _parameter_skeleton(m, vocab)}
    full = names_to_megatron(m, padded, tensors)
    args = args_from_model_config(m, padded, 2, 2, "transformer_engine", {"true_vocab_size": vocab})
    src = os.path.join(work, "mlm")
    t0 = time.perf_counter()
    write_torch_checkpoint(src, full, m.num_layers, 2, 2, {"args": args, "checkpoint_version": 3.0, "iteration": 0},
                           gated=True, tied=False, spec="transformer_engine", iteration=100)
    t_make = time.perf_counter() - t0
    src_bytes = _dir_bytes(src)
    quiet = lambda s: None  # noqa: E731
    t0 = time.perf_counter()
    mc = megatron_to_megacoat(src, os.path.join(work, "mc"), carry_iteration=True, log=quiet)
    t_in = time.perf_counter() - t0
    mc_bytes = _dir_bytes(os.path.join(work, "mc"))
    t0 = time.perf_counter()
    megacoat_to_megatron(mc, os.path.join(work, "back"), tp=4, pp=1, carry_iteration=True, log=quiet)
    t_out = time.perf_counter() - t0
    back_bytes = _dir_bytes(os.path.join(work, "back"))
    mc2 = megatron_to_megacoat(os.path.join(work, "back"), os.path.join(work, "mc2"), log=quiet)
    t1, t2 = read_model_tensors(mc)[2], read_model_tensors(mc2)[2]
    exact = set(t1) == set(t2) and all(torch.equal(t1[k], t2[k]) for k in t1) and \
        all(torch.equal(t1[k], tensors[k]) for k in tensors)
    big = max((os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs), key=os.path.getsize)
    t0 = time.perf_counter()
    shutil.copyfile(big, os.path.join(work, "copy.bin"))
    with open(os.path.join(work, "copy.bin"), "rb+") as f:
        os.fsync(f.fileno())
    t_copy = time.perf_counter() - t0
    params = sum(t.numel() for t in tensors.values())
    return {"params": params, "layers": m.num_layers, "hidden": m.hidden_size, "dtype": "bf16",
            "megatron_bytes": src_bytes, "megacoat_bytes": mc_bytes, "megatron_tp4_bytes": back_bytes,
            "write_megatron_tp2pp2_s": t_make,
            "megatron_to_megacoat_s": t_in, "megatron_to_megacoat_GBps": (src_bytes + mc_bytes) / t_in / 1e9,
            "megacoat_to_megatron_tp4_s": t_out, "megacoat_to_megatron_GBps": (mc_bytes + back_bytes) / t_out / 1e9,
            "file_copy_GBps": 2 * os.path.getsize(big) / t_copy / 1e9, "round_trip_exact": exact}


def part_logits(a, work):
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    import megacoat
    from megacoat.convert.megatron import megatron_to_megacoat
    from megacoat.convert.megatron_model import args_from_model_config
    from megacoat.convert.megatron_torch import write_torch_checkpoint
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    L, H, heads, groups, ffn, vocab, seq = a.logit_layers, a.logit_hidden, a.logit_heads, a.logit_groups, \
        a.logit_ffn, a.vocab, a.seq
    cfg = TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=heads, num_query_groups=groups,
                            ffn_hidden_size=ffn, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    padded = -(-vocab // 128) * 128
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded,
                     max_sequence_length=seq, position_embedding_type="rope", rotary_base=500000,
                     share_embeddings_and_output_weights=False).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    full = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    from megacoat.config import ModelConfig
    m = ModelConfig(num_layers=L, hidden_size=H, ffn_hidden_size=ffn, num_attention_heads=heads,
                    group_query_attention=True, num_query_groups=groups, seq_length=seq, rotary_base=500000,
                    untie_embeddings_and_output_weights=True)
    from megacoat.config import resolve_model_defaults
    resolve_model_defaults(m)
    args = args_from_model_config(m, padded, 1, 1, "local", {"true_vocab_size": vocab})
    src = os.path.join(work, "logits_mlm")
    write_torch_checkpoint(src, full, L, 2, 1, {"args": args, "checkpoint_version": 3.0, "iteration": 0},
                           gated=True, tied=False, spec="local", iteration=None)
    out = megatron_to_megacoat(src, os.path.join(work, "logits_mc"), log=lambda s: None)
    tokens = torch.randint(0, vocab, (a.batch, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand_as(tokens)
    res = {"layers": L, "hidden": H, "heads": heads, "groups": groups, "seq": seq, "batch": a.batch}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        try:
            theirs_model = model.cuda().to(dtype)
            ours_model = megacoat.load_model(out, device="cuda", dtype=dtype)

            def timed(fn):
                with torch.no_grad():
                    y = fn()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(5):
                        fn()
                    e.record()
                    torch.cuda.synchronize()
                return y.float(), s.elapsed_time(e) / 5

            theirs, t_theirs = timed(lambda: theirs_model(tokens, pos, None)[..., :vocab])
            ours, t_ours = timed(lambda: ours_model(tokens))
            d = (ours - theirs).abs()
            res[name] = {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(),
                         "logit_absmax": theirs.abs().max().item(),
                         "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
                         "megatron_core_forward_ms": t_theirs, "megacoat_forward_ms": t_ours}
        except Exception as e:  # noqa: BLE001 - record and go on
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args()
    big = dict(layers=16, hidden=2048, ffn=5632, heads=16, groups=8, vocab=32000, logit_layers=4, logit_hidden=1024,
               logit_heads=16, logit_groups=4, logit_ffn=2816, seq=1024, batch=4)
    small = dict(layers=4, hidden=64, ffn=96, heads=8, groups=4, vocab=300, logit_layers=2, logit_hidden=64,
                 logit_heads=4, logit_groups=2, logit_ffn=96, seq=32, batch=2)
    for k, v in (small if a.smoke else big).items():
        setattr(a, k, v)
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "smoke": a.smoke}
    results["commit"] = source_commit()
    work = a.work or tempfile.mkdtemp(prefix="megatron_bench_")
    for name, fn in (("convert", part_convert), ("logits", part_logits)):
        t0 = time.perf_counter()
        try:
            results[name] = fn(a, work)
        except Exception as e:  # noqa: BLE001 - one failing part must not stop the others
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        results[name]["wall_s"] = time.perf_counter() - t0
        print(name, json.dumps(results[name], indent=1, default=str), flush=True)
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
