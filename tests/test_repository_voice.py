"""The repository speaks of the project only.

Code, tests, docs and scripts say what the code does and why; a measured figure names the benchmark
that measures it. They carry no numbering of the periods or runs in which the work was done, no
issue or round numbers, no references to documents or paths outside the repository, and no words
about how the GPU machines were obtained. Result files under benchmarks/results/ are named by what
they hold (`<date>_<topic>_<hardware>`), not by the run that produced them.

Each pattern below was checked against the tree for false positives: variable names such as
`s1`, `s64`, `S2`, `sm_90`, `e4m3`, `round(x, 2)`, `start_new_session`, the C++ "helper" and the
profiler's "lead trace" do not match.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve()

# Directories searched recursively, and single files / globs.
TEXT_DIRS = ("megacoat", "csrc", "tests", "docs", "scripts", "tools")
TEXT_GLOBS = ("benchmarks/*.py", "README.md")
SKIP_DIRS = {"__pycache__", ".pytest_cache"}
SKIP_SUFFIXES = {".pt", ".pyc", ".so", ".o", ".safetensors", ".bin", ".npy", ".idx"}

# (pattern, flags, why it is a process word). This file is not searched: it spells what it forbids.
# A space in a pattern also matches a line break with the next line's comment marker (`#`, `//`, `*`), so
# "session\n    # N" matches like "session N"; " ?" is an optional such gap.
TEXT_PATTERNS = [
    # "session N", "sessions N and M", "Session N's": a numbered work period.
    (r"\bsessions? \d+", re.I, "a numbered work period"),
    # "this session", "the session's ...": the period the work was done in, not a property of the code
    # (`start_new_session` does not match: `_` is a word character).
    (r"\b(?:this|that|the|each|next|previous|one|a later|an earlier) session\b", re.I, "a work period"),
    # "sN call M", "sNcallM", "sN calls M and K", "sNhelper": a work period and call id.
    (r"\bs\d{1,2}(?: ?calls? ?\d+|helper)", re.I, "a work-period/call id"),
    # "2026-12-02_s16_h200.md", "_s4_tp_...": a work-period id inside a result file name.
    (r"\d_s\d{1,2}[_.]", 0, "a work-period id in a file name"),
    # "2026-12-01 s10", "(the H200, s10)": a short work-period id after a date or a GPU.
    (r"(?:\b\d{4}-\d\d-\d\d|\bH[12]00|\bCPU),? s\d{1,2}\b", 0, "a short work-period id"),
    # "call N", "call-N", "calls N, M", "callN_x4_report": a numbered run on a borrowed machine.
    (r"\bcalls?(?:-| ?)\d+", re.I, "a numbered call"),
    # "issue N", "Issues N (qWD) and M", "issue #N".
    (r"\bissues? ?#?\d+", re.I, "an issue number"),
    # "the issue asks", "this issue", "the issue beside": a filed work item (not "instruction issue").
    (r"\b(?:the|this|that|an|each|every) issues?\b(?! (?:slots?|rate|width|order))", re.I, "a filed work item"),
    # "round N", "round-N kernels", "ROUNDN_MS", "roundN_ms" (not "round(", "rounds", "round-off").
    (r"\bround(?:[_-]| ?)\d+", re.I, "a round number"),
    # "this round's quantizer", "the previous round": a round of work (not the verb: "values that round up",
    # nor a GEMM tuner's "fastest round").
    (r"\b(?:this|next|previous|last|an earlier|a later) round\b(?! (?:up|down|to|off|half))", re.I,
     "a round of work"),
    # "DESIGN x.y", "DESIGN.md", "DESIGN's": the plan document lives outside the repository.
    (r"\bDESIGN\b", 0, "a document outside the repository"),
    # a sibling "shared" folder: outside the repository.
    (r"\.\./shared\b", 0, "a path outside the repository"),
    # "/work/main/...", "/root/...", "/home/...": an absolute path on one machine (not "/tmp/...", which
    # usage examples use as a scratch directory, nor "dev/null", nor "a/b" fractions).
    (r"(?<![\w.~-])/(?:work|root|home)/", 0, "an absolute path of one machine"),
    # "device" followed by "call(s)" or "machine(s)": how GPU time was obtained.
    (r"\bdevice (?:calls?|machines?)\b", re.I, "how GPU machines were obtained"),
    # "borrowed", "lent", "lease": same ("equivalent", "release" do not match).
    (r"\b(?:borrow(?:ed|ing|s)?|lent|lend(?:s|ing)?|lease[sd]?)\b", re.I, "how GPU machines were obtained"),
    # "nvidia-h200-x2": the name of a kind of borrowed machine, not of hardware ("2 x H200" is).
    (r"\bnvidia-h[12]00(?:-x\d)?\b", re.I, "the name of a borrowed machine kind"),
    # "the lead engineer", "the lead said": who organised the work (the profiler's "lead trace" and
    # "lead ms" do not match).
    (r"\bthe lead\b(?! (?:trace|ms|time))", re.I, "who organised the work"),
    # "work period(s)".
    (r"\bwork(?:-| )periods?\b", re.I, "a work period"),
    # "next GPU run": when the work was done, not what the code does.
    (r"\bnext GPU (?:run|call)\b", re.I, "when the work was done"),
]
_GAP = r"(?:[ \t]+|[ \t]*\n[ \t]*(?:#+|//+|\*)?[ \t]*)"  # spaces, or a line break into a comment's next line


def _compile(pattern: str, flags: int) -> "re.Pattern[str]":
    return re.compile(re.sub(r" \??", lambda m: _GAP + m.group(0)[1:], pattern), flags)


TEXT_RES = [(_compile(p, f), why) for p, f, why in TEXT_PATTERNS]


# Names of files and folders under benchmarks/results/ (any depth).
NAME_PATTERNS = [
    # "_s16_", "_s10call1_", "_s2helper_", "-s4-" (three digits, e.g. "_s125_" for a 125M model, do not match).
    (r"(?:^|[_-])s\d{1,2}(?=[_.-]|call|helper|$)", re.I, "a work-period id"),
    # "call2_x4_report.md", "_s10call1_".
    (r"call\d", re.I, "a call id"),
    # "_run2_", "_pytest_run1.txt": the how-many-th attempt, not what the file holds.
    (r"(?:^|[_-])run\d", re.I, "a run/attempt id"),
    # "_s2helper_", "_session".
    (r"helper|session", re.I, "who or when, not what"),
]
NAME_RES = [(re.compile(p, f), why) for p, f, why in NAME_PATTERNS]


def _text_files():
    files = [ROOT / g for g in TEXT_GLOBS if "*" not in g]
    for g in TEXT_GLOBS:
        if "*" in g:
            files += sorted(ROOT.glob(g))
    for d in TEXT_DIRS:
        files += sorted(p for p in (ROOT / d).rglob("*") if p.is_file())
    for p in files:
        rel = p.relative_to(ROOT)
        if p.resolve() == THIS_FILE or SKIP_DIRS & set(rel.parts) or p.suffix in SKIP_SUFFIXES:
            continue
        if any(part.endswith(".egg-info") for part in rel.parts) or not p.exists():
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:  # a binary file
            continue
        yield rel, data.decode("utf-8", errors="replace")


def _text_hits():
    hits = []
    for rel, text in _text_files():
        lines = text.splitlines()
        for rx, why in TEXT_RES:
            for m in rx.finditer(text):
                n = text.count("\n", 0, m.start()) + 1
                hits.append((str(rel), n, f"{rel}:{n}: {' '.join(m.group(0).split())!r} ({why}): "
                                          f"{lines[n - 1].strip()[:160]}"))
    return [h for _, _, h in sorted(hits)]


def test_no_process_words_in_code_docs_and_scripts():
    hits = _text_hits()
    assert not hits, (f"{len(hits)} lines speak of how the work was organised instead of what the code does "
                      "(say what it does and why; name the benchmark command behind a figure):\n"
                      + "\n".join(hits))


def test_result_files_are_named_by_what_they_hold():
    results = ROOT / "benchmarks" / "results"
    hits = []
    for p in sorted(results.rglob("*")) if results.is_dir() else []:
        for rx, why in NAME_RES:
            m = rx.search(p.name)
            if m:
                hits.append(f"{p.relative_to(ROOT)}: {m.group(0)!r} ({why})")
                break
    assert not hits, (f"{len(hits)} result files or folders are named by the run that made them; name them "
                      "<date>_<topic>_<hardware>:\n" + "\n".join(hits))


def test_patterns_catch_what_they_are_for():
    """Each pattern matches the process words it is for and none of the look-alikes in the code."""
    def text_hit(s):
        return any(rx.search(s) for rx, _ in TEXT_RES)

    def name_hit(s):
        return any(rx.search(s) for rx, _ in NAME_RES)

    n, up = 16, ".."  # the examples are built here so that this file's own lines do not spell them out
    bad = [f"measured in session {n}", f"(s3 call {n})", "s10call1", f"the call-{n} log", f"S15 call {n}",
           f"see issue {n}", f"the round-{n} kernels", "ROUND1_MS", f"DESIGN {n}.4", f"DESIGN.md section {n}",
           f"{up}/shared/golden", "/work/shared/x.pt", "one device " + "call", "machines were lent",
           "on nvidia-h200-x4", "2026-12-01 s10)", "the H200, s10)", "2026-12-02_s16_h200.md",
           "ask the lead engineer", "in this session", "with this round's quantizer",
           f"tuned in session\n    # {n} of the work", f"(s3\n// call {n})", "what the issue asks for",
           "this issue adds", "the issues filed beside"]
    good = ["s1, s2 = tl.load(p), tl.load(q)", "c = s64 - s64.mean(-1)", "S2 = m // 4", "sm_90a", "fp8 e4m3",
            "round(x, 2)", "rounds to nearest", "round-off", "start_new_session=True", "the C++ helper",
            "the lead trace", "mean lead ms", "--out /tmp/ce.json", "one call of fn", "equivalent", "release",
            "design of the kernel", "0x5s16", "its fastest round counts", "two rounds per element",
            "values that round up across a power of two", "the next call of fn", "bound by instruction issue",
            "issue them in that order", "the order the loop issues it", "take issue slots"]
    assert [s for s in bad if not text_hit(s)] == []
    assert [s for s in good if text_hit(s)] == []
    assert all(name_hit(s) for s in ["2026-12-02_s16_h200.md", "2026-12-01_h200_s10call1_log.txt", "call2_x4_report.md",
                                     "2026-11-30_run2_log.txt", "2026-12-01_h200_s2helper_bench.txt"])
    assert not any(name_hit(s) for s in ["2026-12-02_coat-1p36b_h200.md", "2026-12-02_fp8-states-s125_h200.jsonl",
                                         "checkpoint_cpu.md", "runs", "2026-12-01_tp2-sockets_h200x2.jsonl"])
