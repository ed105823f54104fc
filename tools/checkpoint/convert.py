#!/usr/bin/env python
r"""Convert checkpoints between Hugging Face, Megatron-LM and megacoat.

    python tools/checkpoint/convert.py --load-format hf --load-dir llama-hf --save-format megacoat \
        --save-dir ckpt --target-tensor-parallel-size 2
    python tools/checkpoint/convert.py --load-format megacoat --load-dir ckpt --save-format hf --save-dir llama-hf

Megatron-LM (megatron-core GPTModel, local or TransformerEngine layer spec):
    python tools/checkpoint/convert.py --load-format megatron --load-dir megatron-ckpt --save-format megacoat \
        --save-dir ckpt [--carry-iteration] [--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR]
    python tools/checkpoint/convert.py --load-format megacoat --load-dir ckpt --save-format megatron \
        --save-dir megatron-ckpt --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
Reads Megatron's `torch` format (iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt, any TP/PP) and its
`torch_dist` format (no megatron-core needed); writes the `torch` format. The model flags come
from the checkpoint's saved args. See docs/migrating-from-megatron.md.

A megacoat checkpoint imported from Megatron goes back with the layer spec it came with (local or
TransformerEngine names) unless --megatron-transformer-impl says otherwise; the spec written is printed.

megacoat checkpoints load at any TP/DP whatever the target TP: the target only decides how the
weights are split into files (one per TP rank) and the TP recorded in the saved flags.
megacoat -> megacoat writes a weights-only copy at the target TP.

A --save-dir that already holds a checkpoint (a tracker, iter_* or release directories) or a Hugging
Face model is refused unless --force is given. Even with --force a checkpoint directory is never
rewound: writing an iteration older than the newest one there is refused (its tracker would move
backwards and the next --load would restart that run). The --save-dir is never the --load-dir.
Outputs are published whole: a checkpoint by renaming its finished directory, a Hugging Face model
by moving its finished files in with config.json last (a forced replacement removes the old model's
weights, tokenizer and generation settings), so an interrupted conversion never looks complete.
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megacoat.api import DTYPES  # noqa: E402
from megacoat.checkpoint import CheckpointError  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-format", choices=["hf", "megacoat", "megatron"], required=True)
    p.add_argument("--load-dir", required=True, help="HF model directory, or megacoat --save / iter_* directory.")
    p.add_argument("--save-format", choices=["hf", "megacoat", "megatron"], required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="Cast the weights (default: keep).")
    p.add_argument("--force", action="store_true",
                   help="Write into a --save-dir that already holds a checkpoint or model (never to an iteration "
                        "older than the newest one there).")
    g = p.add_argument_group("Megatron-LM")
    g.add_argument("--carry-iteration", action="store_true",
                   help="Keep the iteration and consumed samples (default: start at 0; Megatron gets a 'release' "
                        "checkpoint).")
    g.add_argument("--megatron-transformer-impl", choices=["transformer_engine", "local"], default=None,
                   help="Layer spec whose parameter names the Megatron checkpoint gets (its --transformer-impl). "
                        "Default: the spec the checkpoint was imported from Megatron with, else transformer_engine.")
    g.add_argument("--true-vocab-size", type=int, default=None,
                   help="Vocabulary size without Megatron's padding (default: the tokenizer's).")
    g.add_argument("--tokenizer-type", default=None, help="Tokenizer to copy into the converted checkpoint "
                   "(default: the one in the Megatron args, when its files exist here).")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids 0..N-1, eod N.")
    return p.parse_args(argv)


def convert(a, dtype) -> str:
    """Dispatch to the conversion the formats name; returns what was written."""
    from megacoat.convert import (TokenizerFlags, hf_to_megacoat, megacoat_to_hf, megacoat_to_megacoat,
                                  megacoat_to_megatron, megatron_to_megacoat)
    if a.load_format == "megatron" and a.save_format == "megacoat":
        if a.megatron_transformer_impl:
            raise CheckpointError("--megatron-transformer-impl applies to megacoat -> Megatron; the layer spec of "
                                  "a Megatron checkpoint is read from its parameter names and args")
        tok = TokenizerFlags(a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file, a.vocab_size)
        out = megatron_to_megacoat(a.load_dir, a.save_dir, a.target_tensor_parallel_size, dtype, tok,
                                   a.true_vocab_size, a.carry_iteration, force=a.force,
                                   pp=a.target_pipeline_parallel_size)
    elif a.load_format == "megacoat" and a.save_format == "megatron":
        out = megacoat_to_megatron(a.load_dir, a.save_dir, a.target_tensor_parallel_size,
                                   a.target_pipeline_parallel_size, dtype, a.megatron_transformer_impl,
                                   a.carry_iteration, force=a.force)
    elif "megatron" in (a.load_format, a.save_format):
        raise CheckpointError("Megatron checkpoints convert to and from megacoat; go through megacoat for "
                              f"{a.load_format} -> {a.save_format}")
    elif a.load_format == "hf" and a.save_format == "megacoat":
        out = hf_to_megacoat(a.load_dir, a.save_dir, a.target_tensor_parallel_size,
                             a.target_pipeline_parallel_size, dtype, force=a.force)
    elif a.load_format == "megacoat" and a.save_format == "hf":
        if a.target_tensor_parallel_size != 1 or a.target_pipeline_parallel_size != 1:
            raise CheckpointError("--target-*-parallel-size applies to megacoat output only")
        out = megacoat_to_hf(a.load_dir, a.save_dir, dtype, force=a.force)
    elif a.load_format == "megacoat" and a.save_format == "megacoat":
        out = megacoat_to_megacoat(a.load_dir, a.save_dir, a.target_tensor_parallel_size,
                                   a.target_pipeline_parallel_size, dtype, force=a.force)
    else:
        raise CheckpointError("hf -> hf is not a conversion; copy the directory")
    return out


def remove_unused_save_dir(save_dir: str, lock) -> None:
    """A --save-dir that this failed conversion created is removed again where it holds nothing but its lock file
    (e.g. after a mistyped --load-dir): no empty directory named like an output stays behind. Called while this
    run holds the directory's lock, so no other run writes there; os.rmdir leaves a directory anything has entered."""
    from megacoat.checkpoint.ownership import LOCK_FILE
    with contextlib.suppress(OSError):
        if lock is not None and os.listdir(save_dir) == [LOCK_FILE]:
            os.remove(os.path.join(save_dir, LOCK_FILE))
        os.rmdir(save_dir)


def main(argv=None) -> int:
    a = parse(argv)
    from megacoat.checkpoint.ownership import SaveDirLock
    dtype = DTYPES.get(a.dtype)
    created = not os.path.exists(a.save_dir)
    try:
        for flag, size in (("tensor", a.target_tensor_parallel_size), ("pipeline", a.target_pipeline_parallel_size)):
            if size < 1:
                raise CheckpointError(f"--target-{flag}-parallel-size must be >= 1")
        megatron_only = [f for f, v in (("--carry-iteration", a.carry_iteration),
                                        ("--megatron-transformer-impl", a.megatron_transformer_impl)) if v]
        if megatron_only and "megatron" not in (a.load_format, a.save_format):
            raise CheckpointError(f"{', '.join(megatron_only)} apply to Megatron conversions only")
        from_megatron_only = [f for f, v in (("--true-vocab-size", a.true_vocab_size),
                                             ("--tokenizer-type", a.tokenizer_type),
                                             ("--tokenizer-model", a.tokenizer_model), ("--vocab-file", a.vocab_file),
                                             ("--merge-file", a.merge_file), ("--vocab-size", a.vocab_size))
                              if v is not None]
        if from_megatron_only and a.load_format != "megatron":
            raise CheckpointError(f"{', '.join(from_megatron_only)} apply to --load-format megatron only (a megacoat "
                                  "checkpoint or Hugging Face model brings its own tokenizer and vocabulary size)")
        for flag, path in (("--load-dir", a.load_dir), ("--save-dir", a.save_dir)):
            if not path:
                raise CheckpointError(f"{flag} is empty: name a directory")
        if os.path.exists(a.save_dir) and not os.path.isdir(a.save_dir):
            raise CheckpointError(f"--save-dir {a.save_dir} is a file, not a directory; choose a directory")
        if os.path.realpath(a.save_dir) == os.path.realpath(a.load_dir):
            raise CheckpointError(f"--save-dir {a.save_dir} is the --load-dir: the conversion would write over (or "
                                  "mix its files with) its input; choose a new --save-dir")
        # A training run's directory is written by one run at a time: a live run's lock refuses the conversion.
        lock = SaveDirLock(a.save_dir, "conversion", flag="--save-dir") \
            if a.save_format in ("megacoat", "megatron") else None
        with lock or contextlib.nullcontext():
            try:
                out = convert(a, dtype)
            except (CheckpointError, ValueError, OSError):
                if created:
                    remove_unused_save_dir(a.save_dir, lock)
                raise
    except (CheckpointError, ValueError) as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk: every output is written aside and published only when complete
        where = f" ({e.filename})" if e.filename else ""
        print(f"convert.py: error: {e.strerror or e}{where}; no incomplete output was published: fix the cause "
              "and convert again", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
