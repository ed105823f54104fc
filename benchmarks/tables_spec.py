"""What each headline table runs and how its runs become rows and targets.

A table is split into parts, each within 10 minutes on one H200 with warm caches (table-c2: on CPU). Every ratio
and target is computed within one part, between runs of the same process on the same machine: a part that needs
a bf16 reference runs its own. A run is a command line (`pretrain_gpt.py ...`, the plain-PyTorch peer, or
torchrun for the 4-rank CPU table) whose per-interval JSON log becomes its metrics (tables_run.py); `analyse_*`
turn the parts' runs into the sections (rows), targets and plots that tables_render.py writes.

Placeholders in a command, filled in when it runs: {corpus} and {tokenizer} (the code corpus of table-c1,
built on the machine that runs it), {log} (the run's JSON log)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# --------------------------------------------------------------------------------------------------- shapes, methods


@dataclass(frozen=True)
class Shape:
    key: str
    label: str
    megacoat: Tuple[str, ...]   # pretrain_gpt.py flags of the model
    peer: Tuple[str, ...]       # the same model in benchmarks/peer_plain_llama.py's flags


SHAPES = {
    "1p36b": Shape("1p36b", "1.36B", ("--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
                                      "--num-attention-heads", "16"),
                   ("--hidden", "2048", "--layers", "24", "--heads", "16", "--ffn", "5632")),
    "7b": Shape("7b", "7B", ("--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
                             "--num-attention-heads", "32"),
                ("--hidden", "4096", "--layers", "32", "--heads", "32", "--ffn", "11008")),
}

# The speed runs: mock data, sequence 2048, vocabulary 32000, untied embeddings, bf16 parameters, no evaluation.
SPEED_FLAGS = ("--seq-length", "2048", "--max-position-embeddings", "2048", "--mock-data", "--vocab-size", "32000",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-4", "--min-lr", "1e-5",
               "--lr-warmup-iters", "5", "--eval-interval", "0", "--eval-iters", "0",
               "--untie-embeddings-and-output-weights", "--bf16")

FP8_STATES = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8")


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    flags: Tuple[str, ...]


def _methods(*items: Method) -> Dict[str, Method]:
    return {m.key: m for m in items}


METHODS = _methods(
    Method("bf16", "bf16", ()),
    Method("tensorwise", "`--fp8-recipe tensorwise`", ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")),
    Method("coat", "`--fp8-recipe coat`", ("--fp8-format", "hybrid", "--fp8-recipe", "coat")),
    Method("coat-fp8states", "coat + FP8 optimizer states", ("--fp8-format", "hybrid", "--fp8-recipe", "coat")
           + FP8_STATES),
    Method("coat-fp8states-bf16grads", "coat + FP8 states + bf16 gradients",
           ("--fp8-format", "hybrid", "--fp8-recipe", "coat") + FP8_STATES + ("--grad-reduce-in-bf16",)),
)

# ------------------------------------------------------------------------------------------------------ runs, parts


@dataclass(frozen=True)
class Run:
    """One command of a part. argv starts with the script (relative to the repository root), run by this Python;
    nproc > 1 runs it under torchrun --standalone."""
    name: str
    label: str
    argv: Tuple[str, ...]
    kind: str = "megacoat"             # megacoat: --log-json records; peer: peer_plain_llama.py's --json line
    warmup_iters: int = 10             # logged intervals ending at or before this iteration are not averaged
    timeout_s: int = 300
    nproc: int = 1
    needs: Tuple[str, ...] = ()        # "torchao" (its rows are skipped where it does not import), "corpus"
    info: Tuple[Tuple[str, object], ...] = ()   # shape, method, micro_batch, global_batch: what the rows show
    save_interval: Optional[int] = None  # resumable: checkpoints every this many steps, and a run cut by the part's
    #                                      time budget continues from the last one when its part runs again there

    def meta(self) -> Dict[str, object]:
        return dict(self.info)


@dataclass(frozen=True)
class LargestBatch:
    """Search for the largest micro-batch (global batch = micro-batch) a method runs at: the memory planner
    (`pretrain_gpt.py --dry-run`) proposes the largest whose estimated peak fits, runs confirm it and the next
    one up (or step down until one runs)."""
    name: str
    label: str
    make: Callable[[int], Run]
    start: int = 2                     # where the search starts without the planner
    limit: int = 64


@dataclass(frozen=True)
class Part:
    name: str
    about: str
    minutes: float                     # estimate, one H200 (table-c2: a 2-core CPU), warm caches
    runs: Tuple[Run, ...] = ()
    searches: Tuple[LargestBatch, ...] = ()
    device: str = "cuda"               # cuda: needs a GPU; cpu: runs anywhere
    prepare: Tuple[str, ...] = ()      # "extensions" (build the CUDA extensions first), "corpus", "torchao"


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    parts: Tuple[Part, ...]
    analyse: Callable[[Dict[str, dict]], dict]
    device: str = "cuda"
    speed: bool = False                # its results are tokens/s: runs with unsteady intervals are flagged

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)


def _megacoat(name: str, shape: Shape, method: Method, mbs: int, gbs: int, iters: int, log_interval: int,
              warmup: int, timeout_s: int = 300) -> Run:
    argv = (("pretrain_gpt.py",) + SPEED_FLAGS + shape.megacoat
            + ("--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(iters),
               "--log-interval", str(log_interval)) + method.flags)
    return Run(name, method.label, argv, warmup_iters=warmup, timeout_s=timeout_s,
               info=(("shape", shape.key), ("method", method.key), ("micro_batch", mbs), ("global_batch", gbs)))


def _peer(name: str, label: str, shape: Shape, mbs: int, iters: int, warmup: int, float8: Optional[str] = None,
          timeout_s: int = 300) -> Run:
    argv = (("benchmarks/peer_plain_llama.py",) + shape.peer
            + ("--mbs", str(mbs), "--compile", "--iters", str(iters), "--warmup", str(warmup)))
    if float8:
        argv += ("--float8", float8)
    return Run(name, label, argv, kind="peer", warmup_iters=warmup, timeout_s=timeout_s,
               needs=("torchao",) if float8 else (),
               info=(("shape", shape.key), ("system", name), ("micro_batch", mbs), ("global_batch", mbs)))


# Iterations of the speed runs: the mean of the logged intervals after `warmup` (compilation and the
# allocator's first steps fall before it). A log line syncs the host with the GPU: every 10 steps at global
# batch 4, every 4 at the longer steps.
A_1P36B_GBS4 = dict(iters=40, log_interval=10, warmup=10)
A_1P36B_GBS32 = dict(iters=16, log_interval=4, warmup=4)
A_7B = dict(iters=16, log_interval=4, warmup=4)
A_7B_LARGEST = dict(iters=8, log_interval=2, warmup=4)


def _speed_part(name: str, about: str, minutes: float, shape: str, mbs: int, gbs: int, it: dict,
                methods: Sequence[str]) -> Part:
    return Part(name, about, minutes,
                runs=tuple(_megacoat(m, SHAPES[shape], METHODS[m], mbs, gbs, **it) for m in methods),
                prepare=("extensions",))


def _largest(method: str) -> LargestBatch:
    m = METHODS[method]
    return LargestBatch(method, m.label,
                        lambda mbs: _megacoat(f"{method}-mbs{mbs}", SHAPES["7b"], m, mbs, mbs, **A_7B_LARGEST))


ALL_METHODS = tuple(METHODS)

TABLE_A_PARTS = (
    _speed_part("1p36b-gbs4", "1.36B, micro-batch 4, global batch 4: every method", 4.5, "1p36b", 4, 4,
                A_1P36B_GBS4, ALL_METHODS),
    _speed_part("1p36b-gbs32", "1.36B, micro-batch 4, global batch 32: every method", 5, "1p36b", 4, 32,
                A_1P36B_GBS32, ALL_METHODS),
    _speed_part("7b-mbs2", "7B, micro-batch 2 (global batch 2): every method", 6, "7b", 2, 2, A_7B, ALL_METHODS),
    Part("7b-largest-fp8states", "7B: the largest micro-batch of bf16, coat + FP8 states, and coat + FP8 states "
         "+ bf16 gradients", 8, searches=tuple(_largest(m) for m in ("bf16", "coat-fp8states",
                                                                      "coat-fp8states-bf16grads")),
         prepare=("extensions",)),
    Part("7b-largest-recipes", "7B: the largest micro-batch of bf16, tensorwise and coat", 7.5,
         searches=tuple(_largest(m) for m in ("bf16", "tensorwise", "coat")), prepare=("extensions",)),
)

# --------------------------------------------------------------------------------------------------- table-c1

# ~125M Llama-style model, sequence 1024, global batch 32 in one micro-batch, 3000 steps (98M tokens) on a code
# corpus of the machine's installed Python packages (tables_run.build_code_corpus), validation every 500 steps.
C1_STEPS = 3000
C1_FLAGS = ("--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072", "--num-attention-heads", "12",
            "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "32",
            "--global-batch-size", "32", "--attention-dropout", "0", "--hidden-dropout", "0", "--bf16",
            "--lr", "6e-4", "--min-lr", "6e-5", "--lr-warmup-iters", "100", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--seed", "1234", "--train-iters", str(C1_STEPS), "--log-interval", "50",
            "--eval-interval", "500", "--eval-iters", "20", "--data-path", "{corpus}",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{tokenizer}")
C1_METHODS = (
    ("bf16", "bf16", ()),
    ("tensorwise", "`--fp8-recipe tensorwise`", METHODS["tensorwise"].flags),
    ("coat", "`--fp8-recipe coat`", METHODS["coat"].flags),
    ("coat-fp8states", "coat + FP8 optimizer states", METHODS["coat-fp8states"].flags),
    ("coat-fp8states-noexpansion", "coat + FP8 states without expansion",
     METHODS["coat-fp8states"].flags + ("--no-optimizer-state-expansion",)),
)
TABLE_C1_PARTS = tuple(
    Part(key, f"~125M, {C1_STEPS} steps on the code corpus: {label}", 7,
         runs=(Run(key, label, ("pretrain_gpt.py",) + C1_FLAGS + flags, warmup_iters=100, timeout_s=580,
                   needs=("corpus",), info=(("method", key),), save_interval=500),),
         prepare=("extensions", "corpus"))
    for key, label, flags in C1_METHODS)

# --------------------------------------------------------------------------------------------------- table-c2

# SDP4Bit on CPU: 4 gloo ranks as 2 nodes x 2 (so TLq-HS runs both levels: 8 bits within a node, 4 between),
# ZeRO with overlap, a 4-layer model on the built-in corpus, 300 steps, validation every 100 (the same 20 batches
# each time). About 1 s a step on 2 busy cores.
C2_STEPS = 300
C2_FLAGS = ("--use-cpu", "--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "384",
            "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-warmup-iters", "30", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
            "--train-iters", str(C2_STEPS), "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "20",
            "--num-workers", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ranks-per-node", "2")
QWD = ("--quantized-weights",)
TLQ_HS = ("--quantized-gradients", "--hadamard-transform")
# (key, label, flags, the method it is an ablation of)
C2_METHODS = (
    ("plain", "plain ZeRO", (), None),
    ("qwd", "qWD (`--quantized-weights`)", QWD, None),
    ("tlq-hs", "TLq-HS (`--quantized-gradients --hadamard-transform`)", TLQ_HS, None),
    ("both", "qWD + TLq-HS", QWD + TLQ_HS, None),
    ("qwd-direct", "weights quantized directly (`--quantize-weights-directly`)", QWD + ("--quantize-weights-directly",),
     "qwd"),
    ("tlq-no-hadamard", "TLq without the Hadamard transform", ("--quantized-gradients",), "tlq-hs"),
    ("tlq-hs-4bit", "TLq-HS, 4 bits at both levels (`--gradient-quantization-bits-intra 4`)",
     TLQ_HS + ("--gradient-quantization-bits-intra", "4"), "tlq-hs"),
)
TABLE_C2_PARTS = tuple(
    Part(key, f"SDP4Bit on CPU, 2 nodes x 2 gloo ranks, {C2_STEPS} steps: {label}", 6,
         runs=(Run(key, label, ("pretrain_gpt.py",) + C2_FLAGS + flags, warmup_iters=10, timeout_s=1500, nproc=4,
                   info=(("method", key), ("ablation_of", of))),),
         device="cpu")
    for key, label, flags, of in C2_METHODS)

# --------------------------------------------------------------------------------------------------- table-d

PEER_1P36B = dict(iters=20, warmup=10)
PEER_7B = dict(iters=10, warmup=6)


def _peers_part(shape: str, mbs: int, it: dict, peer_it: dict, minutes: float) -> Part:
    s = SHAPES[shape]
    runs = tuple(_megacoat(f"megacoat-{m}", s, METHODS[m], mbs, mbs, **it) for m in ("bf16", "tensorwise", "coat"))
    runs += (_peer("plain", "plain PyTorch, compiled, bf16", s, mbs, **peer_it),
             _peer("torchao-tensorwise", "torchao float8 tensorwise, compiled", s, mbs, float8="tensorwise",
                   **peer_it),
             _peer("torchao-rowwise", "torchao float8 rowwise, compiled", s, mbs, float8="rowwise", **peer_it))
    return Part(shape, f"{s.label}, micro-batch {mbs}: megacoat bf16 / tensorwise / coat, plain PyTorch, torchao "
                       "float8 tensorwise and rowwise", minutes, runs=runs, prepare=("extensions", "torchao"))


TABLE_D_PARTS = (_peers_part("1p36b", 4, A_1P36B_GBS4, PEER_1P36B, 5),
                 _peers_part("7b", 2, A_7B, PEER_7B, 7))

# ------------------------------------------------------------------------------------------------------ analysis


SAME_PART = "Each ratio is between runs of one part: one process after another on the same machine."
ACROSS_PARTS = ("Each run is a part of its own; the losses compare across parts: the same seed, data order and "
                "corpus (the merge checks the corpus fingerprint).")


def _col(key: str, title: str, fmt: str) -> Dict[str, str]:
    return {"key": key, "title": title, "fmt": fmt}


# MFU as the training log prints it: against the dense peak of the format the run's GEMMs use (bf16, or FP8
# for the FP8 recipes and torchao's float8), so an FP8 run's MFU is not inflated by the faster format.
MFU_TITLE = "MFU (of the bf16 / FP8 peak)"
SPEED_COLUMNS = [_col("label", "method", "text"), _col("tokens_per_s", "tokens/s", "int"),
                 _col("vs_bf16", "vs bf16", "ratio"), _col("tflops", "TFLOP/s", "float1"), _col("mfu", MFU_TITLE, "pct1"),
                 _col("peak_gib", "peak GiB", "gib")]


def _ok_runs(part: Optional[dict]) -> List[dict]:
    return [r for r in (part or {}).get("runs", []) if r.get("metrics")]


def _metric(run: Optional[dict], key: str) -> Optional[float]:
    return ((run or {}).get("metrics") or {}).get(key)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _target(key: str, what: str, value: Optional[float], threshold: float, op: str, part: str, unit: str) -> dict:
    compare = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b}[op]
    met = None if value is None else compare(value, threshold)
    return {"key": key, "what": what, "value": value, "threshold": threshold, "op": op, "met": met, "part": part,
            "unit": unit}


def _by_method(part: Optional[dict]) -> Dict[str, dict]:
    return {r["info"]["method"]: r for r in _ok_runs(part) if "method" in r.get("info", {})}


def _speed_rows(part: Optional[dict]) -> List[dict]:
    runs = _by_method(part)
    base = _metric(runs.get("bf16"), "tokens_per_s")
    rows = []
    for r in (part or {}).get("runs", []):
        m = r.get("metrics") or {}
        rows.append({"label": r["label"] + ("" if m else f" ({r.get('outcome', 'failed')})"),
                     "tokens_per_s": m.get("tokens_per_s"), "vs_bf16": _ratio(m.get("tokens_per_s"), base),
                     "tflops": m.get("tflops"), "mfu": m.get("mfu"), "peak_gib": m.get("peak_gib")})
    return rows


def all_runs(part: dict) -> List[dict]:
    """Every run a part made: its fixed runs and each largest-micro-batch search's attempts."""
    runs = list(part.get("runs", []))
    for s in part.get("searches", []):
        runs += [a["run"] for a in s.get("attempts", [])]
    return runs


def _largest_rows(part_name: str, part: Optional[dict]) -> List[dict]:
    searches = (part or {}).get("searches", [])
    base = next((s for s in searches if s["name"] == "bf16"), None)
    base_tps = _metric(_largest_run(base), "tokens_per_s")
    rows = []
    for s in searches:
        run = _largest_run(s)
        tried = ", ".join(f"{a['micro_batch']}: {a['outcome']}" for a in s.get("attempts", []))
        rows.append({"label": s["label"], "micro_batch": s.get("largest"),
                     "bar": f"{s['label']}, micro-batch {s.get('largest')} ({part_name.rsplit('-', 1)[-1]})",
                     "tokens_per_s": _metric(run, "tokens_per_s"),
                     "vs_bf16": _ratio(_metric(run, "tokens_per_s"), base_tps), "peak_gib": _metric(run, "peak_gib"),
                     "tried": tried, "part": part_name})
    return rows


def _largest_run(search: Optional[dict]) -> Optional[dict]:
    if not search or search.get("largest") is None:
        return None
    return next((a["run"] for a in search.get("attempts", []) if a["micro_batch"] == search["largest"]
                 and a.get("run", {}).get("metrics")), None)


def analyse_table_a(parts: Dict[str, dict]) -> dict:
    sections, targets = [], []
    titles = {"1p36b-gbs4": "1.36B, micro-batch 4, global batch 4", "1p36b-gbs32": "1.36B, micro-batch 4, global "
              "batch 32", "7b-mbs2": "7B (Llama-2-7B shape), micro-batch 2, global batch 2"}
    for name, title in titles.items():
        rows = _speed_rows(parts.get(name))
        cols = list(SPEED_COLUMNS)
        if name == "7b-mbs2":
            base_peak = _metric(_by_method(parts.get(name)).get("bf16"), "peak_gib")
            for row in rows:
                row["bf16_peak_ratio"] = _ratio(base_peak, row["peak_gib"])
            cols.append(_col("bf16_peak_ratio", "bf16 peak / peak", "ratio"))
        sections.append({"key": name, "title": title, "columns": cols, "rows": rows, "part": name})
    largest_rows = []
    for name in ("7b-largest-fp8states", "7b-largest-recipes"):
        largest_rows += _largest_rows(name, parts.get(name))
    sections.append({"key": "7b-largest", "title": "7B, each method's largest micro-batch (global batch = "
                     "micro-batch); ratios against the bf16 search of the same part",
                     "columns": [_col("label", "method", "text"), _col("micro_batch", "largest micro-batch", "int"),
                                 _col("tokens_per_s", "tokens/s", "int"), _col("vs_bf16", "vs bf16 at its largest",
                                                                                "ratio"),
                                 _col("peak_gib", "peak GiB", "gib"), _col("tried", "micro-batches tried", "text"),
                                 _col("part", "part", "text")],
                     "rows": largest_rows})

    def speed_ratio(part: str, method: str) -> Optional[float]:
        runs = _by_method(parts.get(part))
        return _ratio(_metric(runs.get(method), "tokens_per_s"), _metric(runs.get("bf16"), "tokens_per_s"))

    targets.append(_target("1p36b-gbs4-speed", "coat + FP8 states / bf16 tokens/s, 1.36B, global batch 4",
                           speed_ratio("1p36b-gbs4", "coat-fp8states"), 1.30, ">=", "1p36b-gbs4", "x"))
    targets.append(_target("7b-mbs2-speed", "coat + FP8 states / bf16 tokens/s, 7B, micro-batch 2",
                           speed_ratio("7b-mbs2", "coat-fp8states"), 1.40, ">=", "7b-mbs2", "x"))
    largest = {r["label"]: r for r in _largest_rows("7b-largest-fp8states", parts.get("7b-largest-fp8states"))}
    targets.append(_target("7b-largest-speed", "coat + FP8 states / bf16 tokens/s, 7B, each at its largest "
                           "micro-batch", (largest.get(METHODS["coat-fp8states"].label) or {}).get("vs_bf16"),
                           1.55, ">=", "7b-largest-fp8states", "x"))
    runs = _by_method(parts.get("7b-mbs2"))
    targets.append(_target("7b-mbs2-memory", "peak memory bf16 / (coat + FP8 states + bf16 gradients), 7B, "
                           "micro-batch 2", _ratio(_metric(runs.get("bf16"), "peak_gib"),
                                                   _metric(runs.get("coat-fp8states-bf16grads"), "peak_gib")),
                           1.40, ">=", "7b-mbs2", "x"))
    plots = [_bars("tokens_per_s.png", "tokens/s per method (one GPU)", "tokens/s", sections, "tokens_per_s"),
             _bars("peak_memory.png", "peak memory per method (one GPU)", "peak GiB", sections, "peak_gib")]
    return {"sections": sections, "targets": targets, "targets_note": SAME_PART, "plots": plots}


def _bars(file: str, title: str, ylabel: str, sections: List[dict], key: str) -> dict:
    """One group of bars per section: [bar label, what sets its colour (the method), value] per row."""
    groups = {}
    for s in sections:
        bars = [[r.get("bar", r["label"]), r["label"], r[key]] for r in s["rows"] if r.get(key) is not None]
        if bars:
            groups[s["title"].split(";")[0]] = bars
    return {"kind": "bars", "file": file, "title": title, "ylabel": ylabel, "groups": groups}


def _convergence(parts: Dict[str, dict], methods: Sequence[Tuple[str, str]], base_key: str) -> dict:
    """Rows of final validation loss (and at each evaluation), gap to `base_key`, final training loss."""
    runs = {}
    for key, _ in methods:
        ok = _ok_runs(parts.get(key))
        if ok:
            runs[key] = ok[0]
    evals = sorted({it for r in runs.values() for it, _ in r["metrics"].get("valid", [])})
    base = _metric(runs.get(base_key), "final_valid_loss")
    rows = []
    for key, label in methods:
        r = runs.get(key)
        m = (r or {}).get("metrics", {})
        row = {"label": label if r else f"{label} (not measured)", "key": key,
               "final_valid_loss": m.get("final_valid_loss"), "final_train_loss": m.get("final_train_loss"),
               "gap": (m["final_valid_loss"] / base - 1) if base and m.get("final_valid_loss") is not None else None,
               "tokens_per_s": m.get("tokens_per_s")}
        valid = dict((it, v) for it, v in m.get("valid", []))
        for it in evals:
            row[f"valid_{it}"] = valid.get(it)
        rows.append(row)
    columns = ([_col("label", "run", "text")] + [_col(f"valid_{it}", f"valid @{it}", "loss") for it in evals]
               + [_col("gap", f"final gap vs {base_key}", "gap"), _col("final_train_loss", "train (last 5 logged)",
                                                                       "loss"),
                  _col("tokens_per_s", "tokens/s", "int")])
    curves = {k: runs[k]["log_json"] for k, _ in methods if k in runs and runs[k].get("log_json")}
    return {"rows": rows, "columns": columns, "curves": curves, "runs": runs}


def analyse_table_c1(parts: Dict[str, dict]) -> dict:
    conv = _convergence(parts, [(k, label) for k, label, _ in C1_METHODS], "bf16")
    gap = {r["key"]: r["gap"] for r in conv["rows"]}
    loss = {r["key"]: r["final_valid_loss"] for r in conv["rows"]}
    exp, noexp = loss.get("coat-fp8states"), loss.get("coat-fp8states-noexpansion")
    targets = [
        _target("coat-fp8states-gap", "coat + FP8 states: final validation loss vs bf16", gap.get("coat-fp8states"),
                0.005, "<=", "coat-fp8states", "gap"),
        _target("tensorwise-gap", "tensorwise: final validation loss vs bf16", gap.get("tensorwise"), 0.005, "<=",
                "tensorwise", "gap"),
        _target("expansion", "FP8 states with expansion vs without: final validation loss", None if exp is None
                or noexp is None else exp / noexp - 1, 0.0, "<=", "coat-fp8states-noexpansion", "gap"),
    ]
    section = {"key": "c1", "title": f"~125M Llama-style model, {C1_STEPS} steps, global batch 32, sequence 1024, "
               "validation loss", "columns": conv["columns"], "rows": conv["rows"]}
    plots = [{"kind": "curves", "file": "loss_curves.png", "runs": conv["curves"], "smooth": 5}]
    return {"sections": [section], "targets": targets, "targets_note": ACROSS_PARTS, "plots": plots}


def analyse_table_c2(parts: Dict[str, dict]) -> dict:
    conv = _convergence(parts, [(k, label) for k, label, _, _ in C2_METHODS], "plain")
    loss = {r["key"]: r["final_valid_loss"] for r in conv["rows"]}
    labels = {k: label for k, label, _, _ in C2_METHODS}
    gap = {r["key"]: r["gap"] for r in conv["rows"]}
    targets = [_target("both-gap", "qWD + TLq-HS: final validation loss vs plain", gap.get("both"), 0.003, "<=",
                       "both", "gap")]
    for key, label, _, of in C2_METHODS:
        if of:
            a, b = loss.get(key), loss.get(of)
            # worse = higher loss: the ablation's loss over its method's, minus 1, must be > 0
            targets.append(_target(f"{key}-worse", f"{label} worse than {labels[of]}",
                                   None if a is None or b is None else a / b - 1, 0.0, ">", key, "gap"))
    section = {"key": "c2", "title": f"SDP4Bit on CPU, 4 gloo ranks as 2 nodes x 2, {C2_STEPS} steps, validation "
               "loss", "columns": conv["columns"], "rows": conv["rows"]}
    plots = [{"kind": "curves", "file": "loss_curves.png", "runs": conv["curves"], "smooth": 3}]
    return {"sections": [section], "targets": targets, "targets_note": ACROSS_PARTS, "plots": plots}


# Which peer each megacoat row of table-d is compared with.
D_PAIRS = (("megacoat-bf16", "plain"), ("megacoat-tensorwise", "torchao-tensorwise"),
           ("megacoat-coat", "torchao-tensorwise"), ("megacoat-coat", "torchao-rowwise"))


def _system(run: dict) -> str:
    """A table-d row's name: megacoat's rows say so beside the peers'."""
    return f"megacoat {run['label']}" if run["kind"] == "megacoat" else run["label"]


def analyse_table_d(parts: Dict[str, dict]) -> dict:
    from megacoat.training.throughput import HOPPER_PEAK_TFLOPS  # the peaks the training log's MFU uses
    sections, targets = [], []
    for p in TABLE_D_PARTS:
        part = parts.get(p.name)
        runs = {r["name"]: r for r in (part or {}).get("runs", [])}
        # TFLOP/s of every row by megacoat's FLOP count of the model (the peers count theirs differently): FLOPs
        # per token from megacoat's bf16 run of the same shape.
        mb = runs.get("megacoat-bf16", {}).get("metrics") or {}
        per_token = mb["tflops"] / mb["tokens_per_s"] if mb.get("tflops") and mb.get("tokens_per_s") else None
        rows = []
        for r in (part or {}).get("runs", []):
            m = r.get("metrics") or {}
            if r["kind"] == "megacoat":
                tflops, mfu = m.get("tflops"), m.get("mfu")
            else:
                tflops = m["tokens_per_s"] * per_token if per_token and m.get("tokens_per_s") else None
                peak = HOPPER_PEAK_TFLOPS["fp8" if "--float8" in r.get("command", "") else "bf16"]
                mfu = tflops / peak if tflops else None
            vs = [f"{_ratio(m.get('tokens_per_s'), _metric(runs.get(peer), 'tokens_per_s')):.3f}x {runs[peer]['label']}"
                  for mine, peer in D_PAIRS if mine == r["name"] and _metric(runs.get(peer), "tokens_per_s")
                  and m.get("tokens_per_s")]
            rows.append({"label": _system(r) + ("" if m else f" ({r.get('outcome', 'failed')})"),
                         "tokens_per_s": m.get("tokens_per_s"), "tflops": tflops,
                         "mfu": mfu, "peak_gib": m.get("peak_gib"),
                         "vs": "; ".join(vs)})
        for mine, peer in D_PAIRS:
            a, b = runs.get(mine), runs.get(peer)
            ratio = _ratio(_metric(a, "tokens_per_s"), _metric(b, "tokens_per_s"))
            if ratio is not None:
                targets.append(_target(f"{p.name}-{mine}-vs-{peer}", f"{SHAPES[p.name].label}: {_system(a)} / "
                                       f"{b['label']} tokens/s", ratio, 1.0, ">=", p.name, "x"))
        sections.append({"key": p.name, "title": p.about.split(":")[0], "part": p.name, "rows": rows, "columns": [
            _col("label", "system", "text"), _col("tokens_per_s", "tokens/s", "int"),
            _col("tflops", "TFLOP/s (megacoat's FLOP count)", "float1"), _col("mfu", MFU_TITLE, "pct1"),
            _col("peak_gib", "peak GiB", "gib"), _col("vs", "megacoat / peer", "text")]})
    plots = [_bars("tokens_per_s.png", "tokens/s: megacoat and its peers (one GPU)", "tokens/s", sections,
                   "tokens_per_s"),
             _bars("peak_memory.png", "peak memory: megacoat and its peers (one GPU)", "peak GiB", sections,
                   "peak_gib")]
    return {"sections": sections, "targets": targets, "targets_note": SAME_PART, "plots": plots}


TABLES = {
    "table-a": Table("table-a", "COAT speed and memory at 1.36B and 7B", TABLE_A_PARTS, analyse_table_a,
                     speed=True),
    "table-c1": Table("table-c1", "COAT convergence on a code corpus (~125M)", TABLE_C1_PARTS, analyse_table_c1),
    "table-c2": Table("table-c2", "SDP4Bit convergence on CPU (2 nodes x 2 gloo ranks)", TABLE_C2_PARTS,
                      analyse_table_c2, device="cpu"),
    "table-d": Table("table-d", "megacoat against plain PyTorch and torchao float8", TABLE_D_PARTS,
                     analyse_table_d, speed=True),
}

# ------------------------------------------------------------------------------------------------ fewer steps


def _set_flag(argv: Tuple[str, ...], flag: str, value: Callable[[int], int]) -> Tuple[str, ...]:
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        out[i + 1] = str(value(int(out[i + 1])))
    return tuple(out)


def with_steps(run: Run, steps: int) -> Run:
    """The run cut to `steps` training steps (a smoke check of the plumbing, never a table's numbers): evaluation,
    logging, warm-up and learning-rate warm-up shrink to fit."""
    argv = run.argv
    if run.kind == "peer":
        argv = _set_flag(_set_flag(argv, "--iters", lambda _: steps), "--warmup", lambda w: min(w, max(1, steps // 2)))
        return replace(run, argv=argv, warmup_iters=min(run.warmup_iters, max(1, steps // 2)))
    argv = _set_flag(argv, "--train-iters", lambda _: steps)
    argv = _set_flag(argv, "--log-interval", lambda n: max(1, min(n, steps // 5)))
    argv = _set_flag(argv, "--eval-interval", lambda n: min(n, steps) if n else 0)
    argv = _set_flag(argv, "--eval-iters", lambda n: min(n, 2))
    argv = _set_flag(argv, "--lr-warmup-iters", lambda n: min(n, max(1, steps // 5)))
    return replace(run, argv=argv, warmup_iters=min(run.warmup_iters, max(0, steps // 2)),
                   save_interval=run.save_interval and min(run.save_interval, max(1, steps // 2)))


def with_steps_search(search: LargestBatch, steps: int) -> LargestBatch:
    return replace(search, make=lambda mbs, _make=search.make: with_steps(_make(mbs), steps))
