"""Running a table's commands: one run (its log and metrics), the largest-micro-batch search, and what a part
prepares first (the CUDA extensions, the code corpus, torchao from a carried wheel).

Every command runs in a child process of its own (a new session, so that a timeout ends torchrun's workers
too); the process running the table never creates a CUDA context."""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tables_spec import LargestBatch, Run, all_runs

# The corpus must hold this many tokens: 3000 steps of 32 x 1024 tokens read 98M, so at most 2.5 epochs.
MIN_CORPUS_TOKENS = 40_000_000
OOM_SIGNS = ("out of GPU memory", "OutOfMemoryError", "CUDA out of memory")
# Variables of an enclosing launch that would make a run think it is one rank of a larger job.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
KEEP_LOG_HEAD, KEEP_LOG_TAIL = 40, 300   # lines of a run's output kept in its .log


@dataclass
class Context:
    """What the runs of one part share."""
    root: str                                # repository root (the runs' working directory)
    out: str                                 # the table's result folder
    part: str
    device: str = "cuda"
    python: str = sys.executable
    deadline: float = math.inf               # time.monotonic() by which the part must end
    corpus: Optional[dict] = None            # build_code_corpus()
    torchao_path: Optional[str] = None       # "" when torchao imports as installed; None when it does not
    scratch: Optional[str] = None            # checkpoints of resumable runs (Run.save_interval), outside `out`
    key: str = ""                            # names this table, commit and step count among the checkpoints there
    fresh: bool = False                      # resumable runs start over (their checkpoints are removed first)
    notes: List[str] = field(default_factory=list)

    def env(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.root, self.torchao_path, env.get("PYTHONPATH")) if p)
        # One GPU, no NVLink multicast; later runs of the same shapes reuse the compiled graphs.
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1"),
                     ("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "inductor_cache"))):
            env.setdefault(k, v)
        if self.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")   # several ranks share the cores
        return env

    def relative(self, path: str) -> str:
        """`path` relative to the result folder (how part files name their raw files)."""
        return os.path.relpath(path, self.out).replace(os.sep, "/")


def display_path(path: str, root: str) -> str:
    """A path as a command shown to a reader gives it: relative to the repository root when inside it."""
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel.replace(os.sep, "/")


def command_line(run: Run, python: str = "python", fill: Optional[Dict[str, str]] = None) -> List[str]:
    argv = [a.format(**fill) if fill and "{" in a else a for a in run.argv]
    if run.nproc > 1:
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(run.nproc)] + argv
    return [python] + argv


def shell(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


# ------------------------------------------------------------------------------------------------------ metrics


def _mean(values: List[Optional[float]]) -> Optional[float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def summarise_log(records: List[dict], warmup_iters: int, final_window: int = 5) -> Optional[dict]:
    """Metrics of a pretrain_gpt.py --log-json log: the means over the logged intervals that end after
    `warmup_iters` (the last interval where none does), the peak memory of any interval, the losses."""
    steps = [r for r in records if "lm_loss" in r and "tokens_per_s" in r]
    if not steps:
        return None
    warm = [r for r in steps if r["iteration"] > warmup_iters] or steps[-1:]
    valid = [[r["iteration"], r["valid_loss"]] for r in records if "valid_loss" in r]
    train = [r["lm_loss"] for r in steps if r["lm_loss"] is not None and math.isfinite(r["lm_loss"])]
    peaks = [r.get("peak_mem_gib") for r in steps if r.get("peak_mem_gib") is not None]
    return {
        "tokens_per_s": _mean([r["tokens_per_s"] for r in warm]),
        "tflops": _mean([r.get("tflops_per_gpu") for r in warm]),
        "mfu": _mean([r.get("mfu") for r in warm]),
        "step_ms": None if _mean([r.get("time_per_iter_s") for r in warm]) is None
        else 1e3 * _mean([r.get("time_per_iter_s") for r in warm]),
        "peak_gib": max(peaks) if peaks else None,
        "intervals": len(warm),
        "iterations": steps[-1]["iteration"],
        "final_train_loss": _mean(train[-final_window:]),
        "final_valid_loss": valid[-1][1] if valid else None,
        "valid": valid,
        "comm_bytes_per_iter": steps[-1].get("comm_bytes_per_iter") or {},
    }


# A run whose logged intervals after warm-up differ by more than this is flagged: its mean hides a stall (a
# compile-cache miss, another process) that a second measurement would not repeat.
UNSTEADY = 0.05


def interval_spread(records: List[dict], intervals: int) -> Optional[Tuple[float, float]]:
    """(slowest, fastest) tokens/s of the last `intervals` logged intervals (those summarise_log averaged)."""
    rates = [r["tokens_per_s"] for r in records if "lm_loss" in r and "tokens_per_s" in r][-intervals:]
    rates = [v for v in rates if v is not None and math.isfinite(v) and v > 0]
    return (min(rates), max(rates)) if len(rates) >= 2 else None


def unsteady_runs(parts: Dict[str, dict], out: str) -> List[str]:
    """One line for each megacoat run in `parts` whose averaged intervals differ by more than UNSTEADY, read
    from its raw log in the result folder `out`."""
    lines = []
    for name, part in parts.items():
        for run in all_runs(part):
            m = run.get("metrics") or {}
            if run.get("kind") != "megacoat" or not run.get("log_json") or not m.get("intervals"):
                continue
            spread = interval_spread(read_json_lines(os.path.join(out, run["log_json"])), m["intervals"])
            if spread and spread[1] / spread[0] - 1 > UNSTEADY:
                lines.append(f"`{name}` / `{run['name']}`: the intervals it averages range from {spread[0]:,.0f} to "
                             f"{spread[1]:,.0f} tokens/s ({spread[1] / spread[0] - 1:+.1%}), a one-off stall or a "
                             f"busy machine; `--redo --part {name}` measures it again")
    return lines


def summarise_peer(records: List[dict]) -> Optional[dict]:
    """Metrics of benchmarks/peer_plain_llama.py's --json line (its own timing already skips its warm-up)."""
    if not records or "tokens_per_s" not in records[-1]:
        return None
    r = records[-1]
    return {"tokens_per_s": r["tokens_per_s"], "tflops_own_count": r.get("tflops"), "step_ms": r.get("step_ms"),
            "peak_gib": r.get("peak_gib"), "final_train_loss": r.get("loss")}


def read_json_lines(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a killed run
    return records


def is_out_of_memory(output: str) -> bool:
    return any(sign in output for sign in OOM_SIGNS)


def _trim(output: str) -> str:
    lines = output.splitlines()
    if len(lines) <= KEEP_LOG_HEAD + KEEP_LOG_TAIL:
        return output
    cut = len(lines) - KEEP_LOG_HEAD - KEEP_LOG_TAIL
    return "\n".join(lines[:KEEP_LOG_HEAD] + [f"[... {cut} lines left out ...]"] + lines[-KEEP_LOG_TAIL:]) + "\n"


# --------------------------------------------------------------------------------------------------- processes


def run_process(argv: Sequence[str], cwd: str, env: Dict[str, str], timeout: float) -> Tuple[Optional[int], str]:
    """(exit status or None when it timed out, output). The child gets a session of its own so that a timeout
    ends the whole process group (torchrun and its workers)."""
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, _ = proc.communicate()
        return None, out or ""


def execute(run: Run, ctx: Context, runner=run_process) -> dict:
    """Run one command; its output goes to raw/<part>/<name>.log, its JSON log to raw/<part>/<name>.jsonl."""
    raw = os.path.join(ctx.out, "raw", ctx.part)
    os.makedirs(raw, exist_ok=True)
    log_json, text_log = os.path.join(raw, f"{run.name}.jsonl"), os.path.join(raw, f"{run.name}.log")
    for stale in (log_json, text_log):
        if os.path.exists(stale):
            os.remove(stale)
    fill = {}
    if ctx.corpus:
        fill = {"corpus": ctx.corpus["prefix"], "tokenizer": ctx.corpus["tokenizer"]}
    checkpoints = None
    if run.save_interval and ctx.scratch:
        # The log is kept beside the checkpoints while the run is unfinished: a resumed run appends to it.
        checkpoints = os.path.join(ctx.scratch, f"{ctx.key}-{ctx.part}-{run.name}")
        if ctx.fresh or not os.path.exists(os.path.join(checkpoints, "latest_checkpointed_iteration.txt")):
            shutil.rmtree(checkpoints, ignore_errors=True)
            if os.path.exists(checkpoints + ".jsonl"):
                os.remove(checkpoints + ".jsonl")
        os.makedirs(ctx.scratch, exist_ok=True)
    logged = checkpoints + ".jsonl" if checkpoints else log_json
    argv = command_line(run, ctx.python, fill) + (["--log-json", logged] if run.kind == "megacoat"
                                                  else ["--json", logged])
    if checkpoints:
        argv += ["--save", checkpoints, "--load", checkpoints, "--save-interval", str(run.save_interval),
                 "--save-retain", "1"]
    shown = ["python"] + [display_path(a, ctx.root) if os.path.isabs(a) else a for a in argv[1:]]
    result = {"name": run.name, "label": run.label, "kind": run.kind, "info": run.meta(), "command": shell(shown),
              "returncode": None, "seconds": 0.0, "metrics": None, "log": ctx.relative(text_log),
              "log_json": ctx.relative(log_json)}
    if "torchao" in run.needs and ctx.torchao_path is None:
        result["outcome"] = "skipped: torchao does not import here"
        return result
    if "corpus" in run.needs and not ctx.corpus:
        result["outcome"] = "skipped: no code corpus"
        return result
    left = ctx.deadline - time.monotonic()
    if left < 30:
        result["outcome"] = "skipped: the part's time budget is spent"
        return result
    t0 = time.monotonic()
    code, output = runner(argv, ctx.root, ctx.env(), min(run.timeout_s, left))
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["returncode"] = code
    with open(text_log, "w") as f:
        f.write(_trim(output))
    if checkpoints and os.path.exists(logged):
        shutil.copyfile(logged, log_json)
        if code == 0:  # finished: nothing to resume
            shutil.rmtree(checkpoints, ignore_errors=True)
            os.remove(logged)
        elif code is None:
            result["resumable_from"] = checkpoints
    records = read_json_lines(log_json)
    metrics = summarise_log(records, run.warmup_iters) if run.kind == "megacoat" else summarise_peer(records)
    if code == 0 and metrics:
        result["outcome"], result["metrics"] = "ok", metrics
    elif code is None:
        result["outcome"] = f"timed out after {result['seconds']:.0f} s"
    elif is_out_of_memory(output):
        result["outcome"] = "out of memory"
    else:
        result["outcome"] = f"failed (exit {code})"
        result["error"] = [line for line in output.splitlines() if line.strip()][-5:]
    if not records and os.path.exists(log_json):
        os.remove(log_json)
    if not os.path.exists(log_json):
        result["log_json"] = None
    return result


# ---------------------------------------------------------------------------------------- the largest micro-batch

_PEAK = re.compile(r"peak with this configuration \(estimate\).*?:\s*([\d.]+) GiB")
_DROPS = re.compile(r"drops the kept FP8 weight copies \(([\d.]+) GiB\) where the run can use less than ([\d.]+) GiB")


def planned_peak(dry_run_output: str, capacity_gib: float) -> Optional[float]:
    """The planner's estimated peak (GiB, the largest rank's) for a GPU of `capacity_gib` usable memory: where
    --fp8-weight-cache auto would drop the FP8 weight copies there, without them. None if there is no estimate."""
    peaks = []
    for line in dry_run_output.splitlines():
        m = _PEAK.search(line)
        if not m:
            continue
        peak = float(m.group(1))
        d = _DROPS.search(line)
        if d and capacity_gib < float(d.group(2)):
            peak -= float(d.group(1))
        peaks.append(peak)
    return max(peaks) if peaks else None


def planner_candidate(peak_at: Callable[[int], Optional[float]], capacity_gib: float, start: int = 2,
                      limit: int = 64) -> Optional[int]:
    """The largest micro-batch in [1, limit] whose estimated peak fits `capacity_gib` (estimates grow with the
    micro-batch: doubling from `start`, then bisection), 0 when none fits, None when the planner gave none."""
    lo, hi, mb = 0, None, min(start, limit)
    while True:
        p = peak_at(mb)
        if p is None:
            return None
        if p > capacity_gib:
            hi = mb
            break
        lo = mb
        if mb >= limit:
            return limit
        mb = min(mb * 2, limit)
    if lo == 0:  # `start` itself does not fit: the largest below it that does
        for m in range(hi - 1, 0, -1):
            p = peak_at(m)
            if p is None:
                return None
            if p <= capacity_gib:
                return m
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = peak_at(mid)
        if p is None:
            return None
        if p <= capacity_gib:
            lo = mid
        else:
            hi = mid
    return lo


def search_largest(attempt: Callable[[int], dict], first: int, limit: int = 64) -> dict:
    """Runs from micro-batch `first` up while they run, or down until one runs. attempt(mb) -> a run result
    (execute()) whose outcome is "ok", "out of memory" or anything else (which stops the search).
    -> {"largest": mb or None, "attempts": [{"micro_batch", "outcome", "run"}], "stopped": why or None}."""
    attempts = []

    def tried(mb: int) -> str:
        run = attempt(mb)
        attempts.append({"micro_batch": mb, "outcome": run.get("outcome", "failed"), "run": run})
        return attempts[-1]["outcome"]

    largest, stopped, mb = None, None, max(1, first)
    outcome = tried(mb)
    if outcome == "ok":
        largest = mb
        while mb < limit:
            mb += 1
            outcome = tried(mb)
            if outcome != "ok":
                stopped = None if outcome == "out of memory" else outcome
                break
            largest = mb
    elif outcome == "out of memory":
        while mb > 1:
            mb -= 1
            outcome = tried(mb)
            if outcome == "ok":
                largest = mb
                break
            if outcome != "out of memory":
                stopped = outcome
                break
    else:
        stopped = outcome
    return {"largest": largest, "attempts": attempts, "stopped": stopped}


def gpu_capacity_gib(memory_gib: float) -> float:
    """What one process can allocate on a GPU of `memory_gib` (nvidia-smi's total): about 1% goes to the CUDA
    context and the driver (139.1 of 140.4 GiB on an H200)."""
    return round(memory_gib * 0.99, 2)


def run_search(search: LargestBatch, ctx: Context, capacity_gib: Optional[float], runner=run_process) -> dict:
    planner_log = []

    def peak_at(mb: int) -> Optional[float]:
        if time.monotonic() > ctx.deadline - 60:
            return None
        argv = command_line(search.make(mb), ctx.python) + ["--dry-run"]
        code, output = runner(argv, ctx.root, ctx.env(), 120)
        peak = planned_peak(output, capacity_gib) if code == 0 and capacity_gib else None
        planner_log.append({"micro_batch": mb, "estimated_peak_gib": peak})
        return peak

    candidate = planner_candidate(peak_at, capacity_gib, search.start, search.limit) if capacity_gib else None
    first = candidate if candidate else search.start
    result = search_largest(lambda mb: execute(search.make(mb), ctx, runner), first, search.limit)
    result.update(name=search.name, label=search.label, capacity_gib=capacity_gib, planner_candidate=candidate,
                  planner=planner_log)
    return result


# ------------------------------------------------------------------------------------------- what parts prepare


def build_extensions(ctx: Context, timeout: float = 480) -> dict:
    """Compile the three CUDA extensions at once, before any run meets them (a run would otherwise build them
    inside its timing, one after the other). Cached by torch: quick once built."""
    from cuda_build_time import ENTRY
    t0 = time.monotonic()
    procs = {name: subprocess.Popen([ctx.python, "-c", f"{entry}\nprint(load() is not None)"], cwd=ctx.root,
                                    env=ctx.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, entry in ENTRY.items()}
    built = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            built[name] = out.strip().splitlines()[-1:] == ["True"]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            built[name] = False
    return {"seconds": round(time.monotonic() - t0, 1), "built": built}


def site_packages(python: str) -> List[str]:
    out = subprocess.run([python, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
                         capture_output=True, text=True, timeout=60)
    return [d for d in json.loads(out.stdout) if os.path.isdir(d)]


def _fingerprint(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


_WROTE = re.compile(r"wrote (\d+) documents, (\d+) tokens")


def corpus_command(python: str, inputs: Sequence[str], tokenizer: str, prefix: str, workers: int) -> List[str]:
    return [python, "tools/preprocess_data.py", "--input", *inputs, "--input-format", "text-files",
            "--input-suffix", ".py", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer,
            "--append-eod", "--output-prefix", prefix, "--workers", str(workers), "--no-progress-bar",
            "--skip-bad-lines"]


def build_code_corpus(ctx: Context, directory: str, min_tokens: int = MIN_CORPUS_TOKENS) -> dict:
    """The code corpus of table-c1: every .py file of this Python's installed packages (site-packages),
    tokenized by tools/preprocess_data.py with the built-in corpus's SentencePiece model. Built once per machine
    under `directory` and reused; its fingerprint (the index's hash) lets the merge check that every part read the
    same corpus."""
    os.makedirs(directory, exist_ok=True)
    stamp = os.path.join(directory, "corpus.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            corpus = json.load(f)
        if os.path.exists(corpus["prefix"] + ".bin") and os.path.exists(corpus["tokenizer"]):
            return dict(corpus, reused=True)
    t0 = time.monotonic()
    code, out = run_process([ctx.python, "-c", "from megacoat.data.default_corpus import prepare_default_corpus\n"
                             "print(prepare_default_corpus(progress=False).tokenizer_model)"],
                            ctx.root, ctx.env(), 600)
    if code != 0:
        raise RuntimeError("the built-in corpus's tokenizer could not be prepared:\n" + out[-2000:])
    tokenizer = out.strip().splitlines()[-1]
    inputs = site_packages(ctx.python)
    out_prefix = os.path.join(directory, "sitepackages")
    argv = corpus_command(ctx.python, inputs, tokenizer, out_prefix, min(16, os.cpu_count() or 1))
    code, out = run_process(argv, ctx.root, ctx.env(), 900)
    m = _WROTE.search(out)
    if code != 0 or not m:
        raise RuntimeError("tools/preprocess_data.py failed on the installed packages:\n" + out[-2000:])
    docs, tokens = int(m.group(1)), int(m.group(2))
    if tokens < min_tokens:
        raise RuntimeError(f"the code corpus has {tokens:,} tokens, fewer than the {min_tokens:,} table-c1 needs: "
                           f"install more Python packages on this machine or pass --corpus-dir with a larger one")
    prefix = out_prefix + "_text_document"
    corpus = {"prefix": prefix, "tokenizer": tokenizer, "documents": docs, "tokens": tokens,
              "fingerprint": _fingerprint(prefix + ".idx"), "bin_bytes": os.path.getsize(prefix + ".bin"),
              "inputs": inputs, "seconds": round(time.monotonic() - t0, 1),
              "command": shell(["python"] + argv[1:])}
    with open(stamp, "w") as f:
        json.dump(corpus, f, indent=1)
    return dict(corpus, reused=False)


_IMPORT_TORCHAO = "import torchao, torchao.float8; print(torchao.__version__)"


def torchao_wheels(root: str) -> List[str]:
    """Wheels under .whl/ (any depth), newest version first."""
    def version(path: str) -> Tuple:
        v = os.path.basename(path).split("-")[1]
        return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+]", v))
    return sorted(glob.glob(os.path.join(root, ".whl", "**", "torchao-*.whl"), recursive=True), key=version,
                  reverse=True)


def setup_torchao(ctx: Context) -> Tuple[Optional[str], str]:
    """(PYTHONPATH entry, what was found): "" where torchao's float8 already imports, a folder where a carried
    wheel (.whl/**/torchao-*.whl) was unpacked and imports with this torch, None where neither."""
    env = ctx.env()
    code, out = run_process([ctx.python, "-c", _IMPORT_TORCHAO], ctx.root, env, 120)
    if code == 0:
        return "", f"torchao {out.strip().splitlines()[-1]} (installed)"
    tried = []
    for wheel in torchao_wheels(ctx.root):
        target = os.path.join(tempfile.gettempdir(), "megacoat-torchao", os.path.basename(wheel)[:-4])
        if not os.path.isdir(target):
            code, out = run_process([ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                                     target, wheel], ctx.root, env, 300)
            if code != 0:
                tried.append(f"{os.path.basename(wheel)}: pip failed")
                continue
        env_t = dict(env, PYTHONPATH=os.pathsep.join([target, env["PYTHONPATH"]]))
        code, out = run_process([ctx.python, "-c", _IMPORT_TORCHAO], ctx.root, env_t, 120)
        if code == 0:
            return target, f"torchao {out.strip().splitlines()[-1]} ({os.path.basename(wheel)})"
        tried.append(f"{os.path.basename(wheel)}: {(out.strip().splitlines() or ['no output'])[-1][:200]}")
    return None, ("torchao's float8 does not import here and no wheel under .whl/ imports with this torch"
                  + (f" ({'; '.join(tried)})" if tried else "") + ": the torchao rows are skipped")
