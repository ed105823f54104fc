"""Preprocessing throughput (MB/s of input text per worker) on the default corpus.

The default corpus is the running interpreter's standard-library .py files (the same file list
megacoat trains on by default). Its SentencePiece model (8000 BPE pieces) is prepared first
(cached). Then tools/preprocess_data.py's engine (megacoat.data.preprocessing.preprocess) runs
on the files in two input forms, JSONL (one {"text": ...} object per file) and one document per
file: one single-threaded process, 2 worker processes (one tokenizer thread each), and the default for
--workers 1 (one process whose SentencePiece batch encoder uses every core).
Throughput = input bytes / wall time; per worker = that / worker processes.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data_report  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cache", default=None, help="Default-corpus cache (default: a fresh temporary directory).")
    p.add_argument("--output", default=time.strftime("benchmarks/results/%Y-%m-%d_data-preprocess_cpu.md"))
    args = p.parse_args()

    from megacoat.data.default_corpus import prepare_default_corpus, stdlib_source_files
    from megacoat.data.preprocessing import preprocess

    tmp = tempfile.mkdtemp(prefix="megacoat_pre_bench")
    try:
        t0 = time.perf_counter()
        corpus = prepare_default_corpus(args.cache or os.path.join(tmp, "cache"))
        prepare_s = time.perf_counter() - t0
        files = stdlib_source_files()
        jsonl = os.path.join(tmp, "stdlib.jsonl")
        with open(jsonl, "w") as f:
            for path in files:
                with open(path, "rb") as src:
                    f.write(json.dumps({"text": src.read().decode("utf-8", errors="replace")}) + "\n")
        text_bytes = sum(os.path.getsize(f) for f in files)
        rows = []
        for fmt, inputs in (("jsonl", [jsonl]), ("text-files", files)):
            # (workers, tokenizer threads per worker): one single-threaded process is the per-worker figure
            for workers, threads in [(1, 1)] + [(w, 1) for w in args.workers if w > 1] + [(1, -1)]:
                r = preprocess(inputs, os.path.join(tmp, f"out_{fmt}_{workers}"), "GPTSentencePieceTokenizer",
                               corpus.tokenizer_model, input_format=fmt, append_eod=True, workers=workers,
                               progress=False, log_interval=0, tokenizer_threads=threads)
                mbps = r.input_bytes / 1e6 / r.seconds
                label = f"{workers}" + (" (in-process, tokenizer on all cores)" if threads == -1 else "")
                rows.append((fmt, label, r.documents, r.input_bytes, r.tokens, r.seconds, mbps, mbps / workers))
                print(rows[-1], file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = data_report.header("Data: preprocessing throughput on the default corpus")
    text += __doc__.split("\n", 1)[1].strip() + "\n\n"
    text += (f"Corpus: {len(files)} files, {text_bytes / 1e6:.1f} MB of source. First-use preparation of the "
             f"default corpus (tokenizer training + writing the dataset, 1 process) took {prepare_s:.1f} s"
             f"{' (cache hit)' if args.cache else ''}.\n\n"
             "| input | workers | documents | input MB | tokens | seconds | MB/s | MB/s per worker |\n"
             "|---|---|---|---|---|---|---|---|\n")
    for fmt, w, docs, nbytes, tokens, sec, mbps, per in rows:
        text += f"| {fmt} | {w} | {docs} | {nbytes / 1e6:.1f} | {tokens:,} | {sec:.2f} | {mbps:.2f} | {per:.2f} |\n"
    text += ("\nThe machine has 2 cores: with 2 workers the main process (reading, parsing results, writing) "
             "competes with the workers for the cores, so per-worker throughput is below the single-process "
             "figure; on a many-core node throughput scales with --workers until the writer saturates.\n")
    data_report.write(args.output, text)


if __name__ == "__main__":
    main()
