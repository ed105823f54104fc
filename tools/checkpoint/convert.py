#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megacoat (Llama-style and GPT-2-style models).

    python tools/checkpoint/convert.py --load-format hf --load-dir llama-hf --save-format megacoat \
        --save-dir ckpt --target-tensor-parallel-size 2
    python tools/checkpoint/convert.py --load-format megacoat --load-dir ckpt --save-format hf --save-dir llama-hf

megacoat checkpoints load at any TP/DP whatever the target TP: the target only decides how the
weights are split into files (one per TP rank) and the TP recorded in the saved flags.
megacoat -> megacoat writes a weights-only copy at the target TP.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megacoat.checkpoint.format import CheckpointError  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-format", choices=["hf", "megacoat"], required=True)
    p.add_argument("--load-dir", required=True, help="HF model directory, or megacoat --save / iter_* directory.")
    p.add_argument("--save-format", choices=["hf", "megacoat"], required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="Cast the weights (default: keep).")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    from megacoat.checkpoint.hf import _check_pp, hf_to_megacoat, megacoat_to_hf
    from megacoat.checkpoint.model_io import read_model_tensors, write_model_checkpoint
    dtype = DTYPES.get(a.dtype)
    try:
        if a.target_tensor_parallel_size < 1:
            raise CheckpointError("--target-tensor-parallel-size must be >= 1")
        if a.load_format == "hf" and a.save_format == "megacoat":
            out = hf_to_megacoat(a.load_dir, a.save_dir, a.target_tensor_parallel_size,
                                 a.target_pipeline_parallel_size, dtype)
        elif a.load_format == "megacoat" and a.save_format == "hf":
            if a.target_tensor_parallel_size != 1 or a.target_pipeline_parallel_size != 1:
                raise CheckpointError("--target-*-parallel-size applies to megacoat output only")
            out = megacoat_to_hf(a.load_dir, a.save_dir, dtype)
        elif a.load_format == "megacoat" and a.save_format == "megacoat":
            m, vocab, tensors, _ = read_model_tensors(a.load_dir)
            _check_pp(a.target_pipeline_parallel_size, m.num_layers)
            if dtype is not None:
                tensors = {k: v.to(dtype) for k, v in tensors.items()}
            out = write_model_checkpoint(a.save_dir, m, vocab, tensors, tp=a.target_tensor_parallel_size)
        else:
            raise CheckpointError("hf -> hf is not a conversion; copy the directory")
    except (CheckpointError, ValueError) as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
