"""Static SASS of the fused AdamW kernel (csrc/fused_adamw.cu), counted without a GPU.

Compiles the kernel part of the file (the torch binding left out) for sm_90a with a local CUDA compiler
(nvcc, cuobjdump and nvdisasm on PATH, or under --cuda-root; e.g. the nvidia-cuda-nvcc,
nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm and nvidia-cuda-cccl wheels in a scratch virtual environment),
instantiates every variant for the given formats with fp32 gradients, and prints per kernel: registers,
instructions in all, in the main loop's span (first backward branch target to the branch: the hot path
plus any cold code placed inside it), MUFU and fp32 arithmetic instructions, calls to slow-path
subroutines (IEEE division and square root). What it is for: comparing variants and changes before an
H200 run (nothing here is a timing).

    python benchmarks/fused_adamw_sass.py --formats 0,2,4 [--out counts.json] [--revision REV --variants 4]
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "csrc", "fused_adamw.cu")
TORCH_INCLUDES = ("#include <torch/extension.h>", "#include <c10/cuda/CUDAException.h>",
                  "#include <c10/cuda/CUDAStream.h>")
# Variant<LANES, MIN_BLOCKS, PREFETCH[, FAST_UPDATE[, PIPELINE]]>: older revisions (--revision) have the template
# with three or four parameters.
KERNEL_RE = re.compile(r"adamw_kernelILi(\d)EfLb1ENS_7VariantILi(\d+)ELi(\d)ELb(\d)E(?:Lb(\d)E)?(?:Lb(\d)E)?")
INSTR_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def kernel_source(formats, variants: int, revision: str = "") -> str:
    """The file (at a git revision, or as it is) up to its host code, without torch, plus explicit
    instantiations (fp32 gradients)."""
    if revision:
        text = subprocess.run(["git", "show", f"{revision}:csrc/fused_adamw.cu"], cwd=os.path.dirname(SRC),
                              capture_output=True, text=True, check=True).stdout
    else:
        text = open(SRC).read()
    body = text[: text.index("void check(bool ok")]
    for inc in TORCH_INCLUDES:
        body = body.replace(inc, "")
    inst = "".join(f"template __global__ void adamw_kernel<{f}, float, true, Variant{v}>(const Args);\n"
                   for f in formats for v in range(variants))
    return "#define C10_CUDA_CHECK(x) (x)\n" + body + "\n" + inst + "}  // namespace\n"


def count(sass: str) -> list:
    rows = []
    for fn in re.split(r"\n\s+Function : ", sass)[1:]:
        m = KERNEL_RE.search(fn.split("\n", 1)[0])
        if not m:
            continue
        fmt, lanes, min_blocks, prefetch, fast_update, pipeline = (int(g or 0) for g in m.groups())
        instrs = INSTR_RE.findall(fn)
        ops = collections.Counter(op.split(".")[0] for _, op, _ in instrs)
        addrs = [int(a, 16) for a, _, _ in instrs]
        loop = 0
        for a, op, rest in instrs:  # the widest backward branch: the persistent grid's loop
            t = re.search(r"0x([0-9a-f]+)", rest)
            if op.startswith("BRA") and t and int(t.group(1), 16) < int(a, 16):
                lo, hi = int(t.group(1), 16), int(a, 16)
                loop = max(loop, sum(lo <= x <= hi for x in addrs))
        rows.append({"format": fmt, "lanes": lanes, "min_blocks": min_blocks, "prefetch": prefetch,
                     "fast_update": fast_update, "pipeline": pipeline, "instructions": len(instrs), "loop": loop,
                     "mufu": ops["MUFU"], "fp32": ops["FADD"] + ops["FMUL"] + ops["FFMA"], "calls": ops["CALL"]})
    return sorted(rows, key=lambda r: (r["format"], r["lanes"], r["prefetch"], r["fast_update"], r["pipeline"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="0,2,4", help="format codes of the kernel (0 fp32, 1 bf16, 2 fp8 "
                    "absmax, 3 fp8 expansion powf form, 4 fp8 expansion exp2 form)")
    ap.add_argument("--variants", type=int, default=None, help="how many variants (default: the codec's)")
    ap.add_argument("--cuda-root", default="", help="a directory with bin/nvcc and include/ (default: PATH)")
    ap.add_argument("--revision", default="", help="count the kernel of this git revision (e.g. 1bbaf18; give "
                    "--variants as that revision had them)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    formats = [int(f) for f in args.formats.split(",")]
    variants = args.variants
    if variants is None:
        sys.path.insert(0, os.path.join(HERE, ".."))
        from megacoat.optim.fp8_adam import KERNEL_VARIANTS
        variants = KERNEL_VARIANTS
    env = dict(os.environ)
    inc = []
    if args.cuda_root:
        env["PATH"] = os.path.join(args.cuda_root, "bin") + os.pathsep + env["PATH"]
        inc = ["-I", os.path.join(args.cuda_root, "include")]
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        open(cu, "w").write(kernel_source(formats, variants, args.revision))
        try:
            build = subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                                    "-diag-suppress", "177", *inc, cu, "-o", cubin],
                                   env=env, capture_output=True, text=True)
        except FileNotFoundError:
            sys.exit("nvcc not found: put a CUDA compiler on PATH or pass --cuda-root")
        if build.returncode:
            sys.exit(build.stderr)
        regs = re.findall(r"Compiling entry function '(\S+)'.*?Used (\d+) registers", build.stderr, re.S)
        sass = subprocess.run(["cuobjdump", "-sass", cubin], env=env, capture_output=True, text=True, check=True).stdout
    rows = count(sass)
    reg_of = {}
    for name, r in regs:
        m = KERNEL_RE.search(name)
        if m:
            reg_of[tuple(int(g or 0) for g in m.groups())] = int(r)
    for row in rows:
        row["registers"] = reg_of.get((row["format"], row["lanes"], row["min_blocks"], row["prefetch"],
                                       row["fast_update"], row["pipeline"]))
        print("format {format} lanes {lanes:2d} prefetch {prefetch} fast_update {fast_update} pipeline {pipeline}: "
              "registers {registers}, "
              "instructions {instructions}, loop {loop}, MUFU {mufu}, fp32 {fp32}, calls {calls}".format(**row))
    if args.out:
        json.dump({"source": "csrc/fused_adamw.cu" + (f" at {args.revision}" if args.revision else ""),
                   "arch": "sm_90a", "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
