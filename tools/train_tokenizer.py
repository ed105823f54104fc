#!/usr/bin/env python
"""Train a SentencePiece tokenizer on the same inputs tools/preprocess_data.py reads.

    python tools/train_tokenizer.py --input corpus.jsonl --output-model tok.model --vocab-size 32000
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/c \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod

The model has unk 0, bos 1, eos 2 (end of document), pad 3. By default it is lossless
(no normalization, whitespace kept, byte fallback), which suits code and any language.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megacoat.data.preprocessing import (INPUT_FORMATS, BadInputError, BadLines, batches, expand_inputs,  # noqa: E402
                                         parse_record, read_records, run_interruptible)
from megacoat.data.tokenizer_training import train_sentencepiece  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="Input file(s) or directories.")
    p.add_argument("--input-format", default="auto", choices=INPUT_FORMATS)
    p.add_argument("--input-suffix", nargs="*", default=None, help="With directories: only these file suffixes.")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-model", required=True, help="Path of the .model file to write.")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--no-byte-fallback", action="store_true", help="Map unknown characters to <unk> instead of bytes.")
    p.add_argument("--normalize", action="store_true",
                   help="NFKC-normalize and collapse whitespace (SentencePiece's default; not lossless).")
    p.add_argument("--max-input-bytes", type=int, default=256 << 20, help="Train on at most this much text.")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-bad-lines", action="store_true")
    return p.parse_args(argv)


def texts(files, input_format, json_keys, bad_lines: BadLines):
    """The texts of the records; a malformed one goes to `bad_lines` (which stops the run or counts it)."""
    for batch in batches(read_records(files, input_format)):
        for record in batch:
            try:
                yield from parse_record(record, input_format, json_keys).values()
            except BadInputError as e:
                bad_lines(str(e))


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_interruptible(lambda: run(args), f"no model written ({args.output_model} is as it was)")


def run(args) -> int:
    bad_lines = BadLines(args.skip_bad_lines, lambda message: print(message, file=sys.stderr))
    try:
        files = expand_inputs(args.input, args.input_suffix)
        if not files:
            print("error: --input matched no files", file=sys.stderr)
            return 2
        if os.path.realpath(args.output_model) in {os.path.realpath(f) for f in files}:  # it would be overwritten
            print(f"error: --output-model {args.output_model} is one of the --input files: name a new file",
                  file=sys.stderr)
            return 2
        try:
            train_sentencepiece(texts(files, args.input_format, args.json_keys, bad_lines), args.output_model,
                                vocab_size=args.vocab_size, model_type=args.model_type,
                                character_coverage=args.character_coverage, byte_fallback=not args.no_byte_fallback,
                                byte_budget=args.max_input_bytes, num_threads=args.threads,
                                lossless=not args.normalize)
        finally:  # before an error: every line skipped is a reason for "no text to train on"
            if bad_lines.count and bad_lines.skip:
                print(f"skipped {bad_lines.count} bad line(s)", file=sys.stderr)
    except (BadInputError, FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import sentencepiece as spm
    pieces = spm.SentencePieceProcessor(model_file=args.output_model).get_piece_size()
    print(f"wrote {args.output_model} ({pieces} pieces)", file=sys.stderr)
    if pieces < args.vocab_size:  # SentencePiece stops early (no hard limit) when the text holds no more pieces
        print(f"warning: the model has {pieces} pieces, fewer than --vocab-size {args.vocab_size}: the text holds "
              "no more; train on more text for a larger vocabulary", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
