#!/usr/bin/env python
"""Tokenize raw text into Megatron `.bin/.idx` datasets (flags follow Megatron-LM's tool).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/my --tokenizer-type GPTSentencePieceTokenizer \\
        --tokenizer-model tok.model --append-eod --workers 8
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod

Writes {output-prefix}_{key}_document.bin/.idx per JSON key (uint16 tokens when the
vocabulary has fewer than 65,500 ids, else int32). Inputs: JSONL (one object per line),
plain text with one document per line, or one document per file (--input-format text-files;
--input may then name directories). Malformed lines stop the run with file and line number,
or are skipped and counted with --skip-bad-lines. Output without a token (empty input, or every
line skipped) is written but ends with a warning: training on it is refused.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megacoat.config import int_at_least  # noqa: E402
from megacoat.data.preprocessing import (INPUT_FORMATS, BadInputError, empty_output_warning,  # noqa: E402
                                         expand_inputs, preprocess, run_interruptible)
from megacoat.data.tokenizer import TOKENIZER_TYPES, TokenizerError, unused_tokenizer_flags  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, nargs="+", help="Input file(s) or directories (for text-files).")
    g.add_argument("--input-format", default="auto", choices=INPUT_FORMATS,
                   help="auto: .json/.jsonl(.gz) are JSONL, anything else one document per line.")
    g.add_argument("--input-suffix", nargs="*", default=None,
                   help="With directories: only files ending with these suffixes (e.g. .py .txt).")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to extract (one dataset each).")
    g.add_argument("--skip-bad-lines", action="store_true", help="Skip malformed lines (with text-files: undecodable files) instead of stopping.")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model or HF tokenizer.json / directory.")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json.")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt.")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids are 0..N-1, eod is N.")
    g.add_argument("--append-eod", action="store_true", help="Append the end-of-document token to every document.")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="Writes {prefix}_{key}_document.bin/.idx.")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int_at_least(1), default=1, help="Tokenizer processes.")
    g.add_argument("--log-interval", type=int_at_least(0), default=1000,
                   help="Documents between progress lines when stderr is not a terminal (0: none).")
    g.add_argument("--no-progress-bar", action="store_true", help="Print progress lines instead of a bar.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_interruptible(lambda: run(args), "nothing written (the partial files were removed)")


def run(args) -> int:
    unused = unused_tokenizer_flags(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    vocab_size=args.vocab_size, vocab_file=args.vocab_file, merge_file=args.merge_file)
    if unused:
        print(f"error: {' '.join(unused)} would be ignored by --tokenizer-type {args.tokenizer_type}: leave "
              f"{'them' if len(unused) > 1 else 'it'} out, or choose the tokenizer type that reads "
              f"{'them' if len(unused) > 1 else 'it'}", file=sys.stderr)
        return 2
    try:
        files = expand_inputs(args.input, args.input_suffix)
        if not files:
            print("error: --input matched no files", file=sys.stderr)
            return 2
        result = preprocess(
            files, args.output_prefix, args.tokenizer_type, args.tokenizer_model, args.vocab_size,
            json_keys=args.json_keys, input_format=args.input_format, append_eod=args.append_eod,
            workers=args.workers, skip_bad_lines=args.skip_bad_lines,
            progress=not args.no_progress_bar and sys.stderr.isatty(), log_interval=args.log_interval,
            vocab_file=args.vocab_file, merge_file=args.merge_file)
    except (BadInputError, TokenizerError, OSError, ValueError) as e:  # OSError: e.g. an unwritable output
        print(f"error: {e}", file=sys.stderr)
        return 1
    mb = result.input_bytes / 1e6
    print(f"wrote {result.documents} documents, {result.tokens} tokens from {mb:.1f} MB in {result.seconds:.1f}s "
          f"({mb / max(result.seconds, 1e-9):.2f} MB/s with {args.workers} worker(s)); skipped {result.bad_lines} "
          f"bad line(s)", file=sys.stderr)
    for key, prefix in result.outputs.items():
        print(f"  {key}: {prefix}.bin / {prefix}.idx", file=sys.stderr)
    warning = empty_output_warning(result)
    if warning:  # last, where it is seen; the files are still written (one empty shard of many is no error)
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
