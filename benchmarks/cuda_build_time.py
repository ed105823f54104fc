#!/usr/bin/env python
"""First-use build time of megacoat's CUDA extensions (csrc/), as a fresh machine sees it.

Each extension is loaded through its public entry point (the one training calls) in a fresh Python process
with an empty TORCH_EXTENSIONS_DIR, so torch's JIT build compiles everything; the time of that call is
printed per extension, one after the other (as a run meets them) or all at once (--parallel). --root runs the
entry points of another checkout (e.g. `git worktree add /tmp/before REV`), so two revisions compare on the
same machine. Needs a CUDA GPU, a CUDA build of torch and nvcc.

    python benchmarks/cuda_build_time.py [--root /tmp/before] [--parallel] [--out build_time.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from provenance import source_commit  # noqa: E402
# The entry points, the same at every revision: each returns the extension module or None.
ENTRY = {"fused_adamw": "from megacoat.optim.fp8_adam import fused_extension as load",
         "sdp4bit": "from megacoat.kernels.sdp4bit import cuda_extension as load",
         "fp8_gemm": "from megacoat.kernels.fp8_gemm import cuda_extension as load"}
PROBE = r"""
import importlib, json, sys, time, warnings
{entry}
try:
    importlib.import_module("megacoat._{name}")
    prebuilt = True  # built by setup.py: nothing to compile
except ImportError:
    prebuilt = False
t0 = time.time()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = load()
import megacoat
print(json.dumps({{"name": "{name}", "seconds": time.time() - t0, "built": module is not None, "prebuilt": prebuilt,
                  "megacoat": megacoat.__file__, "warnings": [str(w.message)[:300] for w in caught]}}))
"""


def start(name: str, root: str, cache: str) -> subprocess.Popen:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=cache, PYTHONPATH=root)
    return subprocess.Popen([sys.executable, "-c", PROBE.format(entry=ENTRY[name], name=name)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, name: str, root: str) -> dict:
    out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"name": name, "error": err[-2000:]}
    row = json.loads(lines[-1])
    if not row["megacoat"].startswith(root):
        row["error"] = f"imported megacoat from {row['megacoat']}, not from {root}"
    row["messages"] = [line for line in err.splitlines() if line.startswith("megacoat:")]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.dirname(HERE), help="the checkout whose extensions are built")
    ap.add_argument("--parallel", action="store_true", help="build the three at once (default: one after another)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    commit = source_commit(root)[:7]  # an exported snapshot names its commit in a COMMIT file
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    res = {"root": root, "commit": commit, "cpus": os.cpu_count(), "MAX_JOBS": os.environ.get("MAX_JOBS"),
           "nvcc": nvcc[-1] if nvcc else None, "parallel": args.parallel, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.time()
        if args.parallel:
            procs = {name: start(name, root, cache) for name in ENTRY}
            rows = [finish(p, name, root) for name, p in procs.items()]
        else:
            rows = [finish(start(name, root, cache), name, root) for name in ENTRY]
        res["total_s"] = time.time() - t0  # includes each process's imports
    res["extensions"] = rows
    for row in rows:
        if "error" in row:
            print(f"{row['name']:12s} FAILED: {row['error'][-500:]}", flush=True)
        else:
            print(f"{row['name']:12s} {row['seconds']:7.1f} s  built {row['built']}" +
                  ("  (prebuilt by setup.py: nothing compiled)" if row["prebuilt"] else ""), flush=True)
    print(f"{'total':12s} {res['total_s']:7.1f} s wall ({'in parallel' if args.parallel else 'one after another'}, "
          f"{res['cpus']} CPUs, commit {commit})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
