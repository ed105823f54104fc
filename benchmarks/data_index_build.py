"""Index building for a synthetic 2-billion-token dataset with 4M documents: time and peak memory.

Only the document lengths feed the index builder, so the lengths array is synthesized directly
(4M lengths summing to exactly 2,000,000,000 tokens) instead of writing 4 GB of tokens. What is
timed is megacoat.data.gpt_dataset.build_gpt_indices: the shuffled document index, the sample
index (C++ or numpy) and the shuffle index, at --seq-length 2048, as one epoch and as 3 epochs.
Each measurement runs in a fresh process pinned to one core, so peak RSS is its own.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data_report  # noqa: E402


def synthetic_lengths(num_docs: int, num_tokens: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=0.0, sigma=1.0, size=num_docs)
    lengths = np.maximum(1, np.floor(raw / raw.sum() * num_tokens)).astype(np.int64)
    lengths[np.argmax(lengths)] += num_tokens - lengths.sum()  # exact total
    return lengths.astype(np.int32)


def measure(backend: str, num_docs: int, num_tokens: int, seq: int, epochs: int) -> dict:
    """Runs in the child process."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import numpy as np

    from megacoat.data import gpt_dataset, helpers

    sizes = synthetic_lengths(num_docs, num_tokens)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    num_samples = (epochs * num_tokens - 1) // seq
    orig = helpers.build_sample_index
    timings = {}

    def timed_sample_index(*a, **k):
        t = time.perf_counter()
        out = orig(*a, backend=backend)
        timings["sample_index_s"] = time.perf_counter() - t
        return out

    helpers.build_sample_index = timed_sample_index
    t0 = time.perf_counter()
    doc, sample, shuffle = gpt_dataset.build_gpt_indices(sizes, np.arange(num_docs, dtype=np.int32), seq, num_samples,
                                                         seed=1234)
    total = time.perf_counter() - t0
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del doc, sample, shuffle
    # Second, untimed run under tracemalloc (numpy reports its buffers to it): the builder's own peak.
    import tracemalloc

    tracemalloc.start()
    doc, sample, shuffle = gpt_dataset.build_gpt_indices(sizes, np.arange(num_docs, dtype=np.int32), seq, num_samples,
                                                         seed=1234)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return dict(backend=backend, epochs=epochs, total_s=total, samples=len(sample) - 1, doc_index_len=len(doc),
                peak_rss_mib=rss_after / 1024, rss_increase_mib=(rss_after - rss_before) / 1024,
                traced_peak_mib=traced_peak / 2**20,
                index_mib=(doc.nbytes + sample.nbytes + shuffle.nbytes) / 2**20, **timings)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-docs", type=int, default=4_000_000)
    p.add_argument("--num-tokens", type=int, default=2_000_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 3])
    p.add_argument("--output", default=time.strftime("benchmarks/results/%Y-%m-%d_data-index-build_cpu.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        backend, epochs = args.child.split(":")
        print(json.dumps(measure(backend, args.num_docs, args.num_tokens, args.seq_length, int(epochs))))
        return
    from megacoat.data import helpers

    backends = ["cpp", "numpy"] if helpers.cpp_available() else ["numpy"]
    rows = []
    for epochs in args.epochs:
        for backend in backends:
            out = subprocess.check_output([sys.executable, __file__, "--child", f"{backend}:{epochs}",
                                           "--num-docs", str(args.num_docs), "--num-tokens", str(args.num_tokens),
                                           "--seq-length", str(args.seq_length)], text=True)
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr)
    text = data_report.header("Data: GPT index building (2B tokens, 4M documents)")
    text += (__doc__.split("\n", 1)[1].strip() + "\n\n"
             f"Dataset: {args.num_docs:,} documents, {args.num_tokens:,} tokens (lognormal lengths), "
             f"seq length {args.seq_length}, one core.\n\n"
             "| backend | epochs | samples | total time (s) | of which sample index (s) | builder peak memory (MiB) | "
             "process peak RSS (MiB) | index arrays (MiB) |\n|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        text += (f"| {r['backend']} | {r['epochs']} | {r['samples']:,} | {r['total_s']:.2f} | "
                 f"{r['sample_index_s']:.2f} | {r['traced_peak_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
                 f"{r['index_mib']:.0f} |\n")
    text += ("\nBuilder peak memory: the most memory allocated at once during build_gpt_indices (tracemalloc, "
             "which numpy and the C++ helper's numpy arrays report to), including the returned arrays, excluding "
             "the 16 MiB lengths input. Process peak RSS includes the interpreter, numpy and synthesizing the "
             "lengths.\n"
             "The rest of the total is numpy's seeded shuffles of the document and shuffle indices "
             "(Megatron's RandomState semantics, the same for both backends). Target: C++ under 20 s on one "
             "core.\n")
    data_report.write(args.output, text)


if __name__ == "__main__":
    main()
