"""Static SASS of the fused AdamW kernel (csrc/fused_adamw.cu), counted without a GPU.

Compiles the kernels (the file includes no torch header; its binding is fused_adamw_binding.cpp) for sm_90a
with a local CUDA compiler (nvcc, cuobjdump and nvdisasm on PATH, or under --cuda-root; e.g. the
nvidia-cuda-nvcc, nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm and nvidia-cuda-cccl wheels in a scratch virtual
environment) and prints per kernel (moment format x gradient dtype, each in the configuration its format runs,
csrc/fused_adamw.cu ConfigFor): registers, instructions in all, in the main loop's span (first backward branch
target to the branch: the hot path plus any cold code placed inside it), MUFU and fp32 arithmetic
instructions, calls to slow-path subroutines (IEEE division and square root). What it is for: comparing
changes to the kernel before a GPU run (nothing here is a timing); --revision counts the kernel of another
git revision of the same layout.

    python benchmarks/fused_adamw_sass.py [--formats 0,2,4] [--out counts.json] [--revision REV]
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
CSRC = os.path.join(HERE, "..", "csrc")
FILES = ("fused_adamw.cu", "fused_adamw.h")
# adamw_kernel<FMT, G, Config<LANES, MIN_BLOCKS, FAST_UPDATE, PIPELINE>> as mangled by nvcc
KERNEL_RE = re.compile(r"adamw_kernelILi(\d)E(f|13__nv_bfloat16)NS\w*?6ConfigILi(\d+)ELi(\d)ELb(\d)ELb(\d)E")
INSTR_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
FIELDS = ("format", "grad", "lanes", "min_blocks", "fast_update", "pipeline")


def _fields(match) -> tuple:
    fmt, grad, lanes, min_blocks, fast_update, pipeline = match.groups()
    return int(fmt), "bf16" if "bfloat16" in grad else "fp32", int(lanes), int(min_blocks), int(fast_update), \
        int(pipeline)


def write_sources(tmp: str, revision: str = "") -> str:
    """The kernel's files (as they are, or at a git revision) in tmp; returns the .cu path."""
    for name in FILES:
        if revision:
            text = subprocess.run(["git", "show", f"{revision}:csrc/{name}"], cwd=CSRC, capture_output=True,
                                  text=True, check=True).stdout
        else:
            text = open(os.path.join(CSRC, name)).read()
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    return os.path.join(tmp, FILES[0])


def count(sass: str) -> list:
    rows = []
    for fn in re.split(r"\n\s+Function : ", sass)[1:]:
        m = KERNEL_RE.search(fn.split("\n", 1)[0])
        if not m:
            continue
        instrs = INSTR_RE.findall(fn)
        ops = collections.Counter(op.split(".")[0] for _, op, _ in instrs)
        addrs = [int(a, 16) for a, _, _ in instrs]
        loop = 0
        for a, op, rest in instrs:  # the widest backward branch: the persistent grid's loop
            t = re.search(r"0x([0-9a-f]+)", rest)
            if op.startswith("BRA") and t and int(t.group(1), 16) < int(a, 16):
                lo, hi = int(t.group(1), 16), int(a, 16)
                loop = max(loop, sum(lo <= x <= hi for x in addrs))
        row = dict(zip(FIELDS, _fields(m)))
        row.update({"instructions": len(instrs), "loop": loop, "mufu": ops["MUFU"],
                    "fp32": ops["FADD"] + ops["FMUL"] + ops["FFMA"], "calls": ops["CALL"]})
        rows.append(row)
    return sorted(rows, key=lambda r: (r["format"], r["grad"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="0,1,2,4", help="format codes of the kernel to print (0 fp32, 1 bf16, "
                    "2 fp8 absmax, 4 fp8 with expansion in the exp2/log2 form)")
    ap.add_argument("--cuda-root", default="", help="a directory with bin/nvcc and include/ (default: PATH)")
    ap.add_argument("--revision", default="", help="count the kernel of this git revision")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    formats = {int(f) for f in args.formats.split(",")}
    env = dict(os.environ)
    inc = []
    if args.cuda_root:
        env["PATH"] = os.path.join(args.cuda_root, "bin") + os.pathsep + env["PATH"]
        inc = ["-I", os.path.join(args.cuda_root, "include")]
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = write_sources(tmp, args.revision), os.path.join(tmp, "k.cubin")
        try:
            build = subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                                    "-Xptxas", "-v", *inc, cu, "-o", cubin], env=env, capture_output=True, text=True)
        except FileNotFoundError:
            sys.exit("nvcc not found: put a CUDA compiler on PATH or pass --cuda-root")
        if build.returncode:
            sys.exit(build.stderr)
        regs = re.findall(r"Compiling entry function '(\S+)'.*?Used (\d+) registers", build.stderr, re.S)
        try:
            sass = subprocess.run(["cuobjdump", "-sass", cubin], env=env, capture_output=True, text=True,
                                  check=True).stdout
        except FileNotFoundError:
            sys.exit("cuobjdump not found: put the CUDA binary utilities on PATH or pass --cuda-root")
    rows = [r for r in count(sass) if r["format"] in formats]
    reg_of = {_fields(m): int(r) for name, r in regs for m in [KERNEL_RE.search(name)] if m}
    for row in rows:
        row["registers"] = reg_of.get(tuple(row[f] for f in FIELDS))
        print("format {format} {grad} grads, lanes {lanes:2d} fast_update {fast_update} pipeline {pipeline}: "
              "registers {registers}, instructions {instructions}, loop {loop}, MUFU {mufu}, fp32 {fp32}, "
              "calls {calls}".format(**row))
    if args.out:
        json.dump({"source": "csrc/fused_adamw.cu" + (f" at {args.revision}" if args.revision else ""),
                   "arch": "sm_90a", "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
