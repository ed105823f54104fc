"""benchmarks/tables.py: parts written once and skipped after (resume), partial and failed parts run again, the
merged JSON and markdown from synthetic parts, the metrics of a --log-json log, the largest-micro-batch search
and the planner's estimate. CPU only: the runs here are a tiny fake training script (one slow test runs a real
table-c2 part cut to a few steps)."""
import os
import json
import random
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tables  # noqa: E402
import tables_render as render  # noqa: E402
import tables_run as trun  # noqa: E402
import tables_spec as spec  # noqa: E402

# A stand-in for pretrain_gpt.py: appends its name to a counter file, writes --log-json records with random
# throughput (or fails / runs out of memory / sleeps when told).
FAKE = textwrap.dedent("""
    import json, random, sys, time
    a = sys.argv[1:]
    name, counter = a[a.index("--name") + 1], a[a.index("--counter") + 1]
    open(counter, "a").write(name + "\\n")
    if "--fail" in a:
        print("Traceback: something broke"); sys.exit(3)
    if "--oom" in a:
        print("megacoat: out of GPU memory in training step 1."); sys.exit(1)
    if "--sleep" in a:
        time.sleep(float(a[a.index("--sleep") + 1]))
    rng = random.Random(name)
    rates = [float(x) for x in a[a.index("--rates") + 1].split(",")] if "--rates" in a else None
    with open(a[a.index("--log-json") + 1], "w") as f:
        for i, it in enumerate((10, 20, 30)):
            rate = rates[i] if rates else rng.uniform(1e3, 2e3)
            f.write(json.dumps({"iteration": it, "lm_loss": 5.0 - it / 100, "tokens_per_s": rate,
                                "tflops_per_gpu": rng.uniform(10, 20), "mfu": 0.1, "peak_mem_gib": rng.uniform(1, 2),
                                "time_per_iter_s": 0.1}) + "\\n")
        f.write(json.dumps({"iteration": 30, "valid_loss": rng.uniform(3, 4)}) + "\\n")
""")


@pytest.fixture
def fake_table(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE)
    counter = tmp_path / "counter.txt"

    def run(name, *extra):
        return spec.Run(name, f"method {name}", (str(script), "--name", name, "--counter", str(counter)) + extra,
                        warmup_iters=10, timeout_s=60, info=(("method", name),))

    parts = (spec.Part("p1", "first part", 1, runs=(run("a"), run("b")), device="cpu"),
             spec.Part("p2", "second part", 1, runs=(run("c"),), device="cpu"))

    def analyse(found):
        rows = [{"label": r["label"], "tokens_per_s": r["metrics"]["tokens_per_s"]}
                for p in found.values() for r in p["runs"] if r["metrics"]]
        return {"sections": [{"key": "s", "title": "all runs", "rows": rows,
                              "columns": [{"key": "label", "title": "run", "fmt": "text"},
                                          {"key": "tokens_per_s", "title": "tokens/s", "fmt": "int"}]}],
                "targets": [], "targets_note": "", "plots": []}

    table = spec.Table("table-x", "a fake table", parts, analyse, device="cpu")
    monkeypatch.setitem(tables.TABLES, "table-x", table)
    monkeypatch.setattr(tables, "describe", lambda argv, device: {
        "date": "2030-01-02T03:04:05Z", "commit": "0123456789abcdef", "changed_files": 0, "hardware": "cpu",
        "gpu": None, "gpu_count": 0, "cpu": "test", "cpu_count": 2, "torch": "2.x", "cuda": None, "triton": None,
        "python": "3.x", "command": " ".join(argv)})
    return table, counter, run


def _ran(counter):
    return counter.read_text().split() if counter.exists() else []


def test_parts_are_written_once_and_skipped_after(fake_table, tmp_path):
    table, counter, _ = fake_table
    out = tmp_path / "2030-01-02_table-x_cpu"
    assert tables.main(["table-x", "--out", str(out)]) == 0
    assert sorted(_ran(counter)) == ["a", "b", "c"]
    for name in ("p1", "p2"):
        part = json.loads((out / "parts" / f"{name}.json").read_text())
        assert part["status"] == "complete" and part["environment"]["commit"] == "0123456789abcdef"
        assert all(r["outcome"] == "ok" and (out / r["log_json"]).exists() for r in part["runs"])
    merged = json.loads((out / "table-x.json").read_text())
    assert merged["missing_parts"] == [] and set(merged["parts"]) == {"p1", "p2"}
    assert merged["date"] == "2030-01-02" and merged["hardware"] == "cpu"
    assert "| method a |" in (out / "README.md").read_text()

    # a second call runs nothing; --redo --part runs that part only
    assert tables.main(["table-x", "--out", str(out)]) == 0
    assert sorted(_ran(counter)) == ["a", "b", "c"]
    assert tables.main(["table-x", "--out", str(out), "--part", "p2", "--redo"]) == 0
    assert sorted(_ran(counter)) == ["a", "b", "c", "c"]


def test_one_part_then_the_rest(fake_table, tmp_path):
    table, counter, _ = fake_table
    out = tmp_path / "t"
    assert tables.main(["table-x", "--out", str(out), "--part", "p2"]) == 0
    merged = json.loads((out / "table-x.json").read_text())
    assert merged["missing_parts"] == ["p1"] and "`p1`" in (out / "README.md").read_text()
    assert tables.main(["table-x", "--out", str(out)]) == 0
    assert sorted(_ran(counter)) == ["a", "b", "c"]
    assert json.loads((out / "table-x.json").read_text())["missing_parts"] == []


def test_a_failed_part_is_kept_aside_and_run_again(fake_table, tmp_path, monkeypatch):
    table, counter, run = fake_table
    broken = spec.Part("p1", "first part", 1, runs=(run("a"), run("b", "--fail")), device="cpu")
    monkeypatch.setitem(tables.TABLES, "table-x", spec.Table("table-x", "t", (broken, table.parts[1]), table.analyse,
                                                             device="cpu"))
    out = tmp_path / "t"
    assert tables.main(["table-x", "--out", str(out), "--part", "p1"]) == 1
    assert not (out / "parts" / "p1.json").exists()
    partial = json.loads((out / "parts" / "p1.partial.json").read_text())
    assert partial["status"] == "failed" and partial["runs"][1]["outcome"] == "failed (exit 3)"
    assert "something broke" in partial["runs"][1]["error"][-1]
    monkeypatch.setitem(tables.TABLES, "table-x", table)  # fixed: the part runs again and replaces the partial one
    assert tables.main(["table-x", "--out", str(out), "--part", "p1"]) == 0
    assert (out / "parts" / "p1.json").exists() and not (out / "parts" / "p1.partial.json").exists()
    assert _ran(counter) == ["a", "b", "a", "b"]


def test_a_run_past_its_timeout_or_the_budget_leaves_the_part_partial(fake_table, tmp_path, monkeypatch):
    table, counter, run = fake_table
    slow = spec.Part("p1", "slow", 1, runs=(replace(run("a", "--sleep", "20"), timeout_s=1), run("b")), device="cpu")
    monkeypatch.setitem(tables.TABLES, "table-x", spec.Table("table-x", "t", (slow,), table.analyse, device="cpu"))
    out = tmp_path / "t"
    assert tables.main(["table-x", "--out", str(out)]) == 1
    partial = json.loads((out / "parts" / "p1.partial.json").read_text())
    assert partial["status"] == "partial" and partial["runs"][0]["outcome"].startswith("timed out")
    assert partial["runs"][0]["seconds"] < 10 and partial["runs"][1]["outcome"] == "ok"
    # no time left in the part's budget: no run starts
    assert tables.main(["table-x", "--out", str(out), "--budget-s", "5"]) == 1
    partial = json.loads((out / "parts" / "p1.partial.json").read_text())
    assert [r["outcome"] for r in partial["runs"]] == ["skipped: the part's time budget is spent"] * 2
    assert _ran(counter) == ["a", "b"]


def test_merge_refuses_cut_and_full_parts_together(fake_table, tmp_path):
    table, _, _ = fake_table
    out = tmp_path / "t"
    assert tables.main(["table-x", "--out", str(out), "--part", "p1", "--steps", "3"]) == 0
    assert json.loads((out / "table-x.json").read_text())["steps"] == 3
    assert tables.main(["table-x", "--out", str(out), "--part", "p2"]) == 2


def test_unknown_part_and_gpu_table_without_gpu(fake_table, capsys, monkeypatch):
    assert tables.main(["table-x", "--part", "p9"]) == 2
    assert "has no part p9: its parts are p1, p2" in capsys.readouterr().err
    monkeypatch.setattr(tables, "gpus", lambda: [])
    assert tables.main(["table-a", "--part", "7b-mbs2"]) == 2
    assert "runs on a CUDA GPU" in capsys.readouterr().err


def test_bad_out_folders_and_damaged_parts_get_one_line(fake_table, tmp_path, capsys):
    """--out naming a file, --merge-only of a folder without parts (it is not created), and a part file that is
    not JSON: a one-line error naming the path, never a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert tables.main(["table-x", "--out", str(afile), "--part", "p1"]) == 2
    assert f"--out {afile} is a file" in capsys.readouterr().err
    empty = tmp_path / "nothing"
    assert tables.main(["table-x", "--merge-only", "--out", str(empty)]) == 2
    assert "holds no part of table-x" in capsys.readouterr().err and not empty.exists()
    out = tmp_path / "t"
    assert tables.main(["table-x", "--out", str(out), "--part", "p1"]) == 0
    (out / "parts" / "p1.json").write_text('{"environment": {')
    assert tables.main(["table-x", "--merge-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(out / "parts" / "p1.json") in err and "not valid JSON" in err


def test_default_folder_resumes_the_newest_incomplete_one(fake_table, tmp_path, monkeypatch):
    table, _, _ = fake_table
    results = tmp_path / "results"
    old, new = results / "2030-01-01_table-x_cpu", results / "2030-01-05_table-x_cpu"
    (results / "2030-01-09_table-x_h200").mkdir(parents=True)  # other hardware: not this one
    for folder in (old, new):
        (folder / "parts").mkdir(parents=True)
    (new / "parts" / "p1.json").write_text(json.dumps({"environment": {}}))
    monkeypatch.setattr(tables, "utc_date", lambda: "2030-02-01")
    assert tables.resolve_out(None, table, "cpu", None, False, str(results)) == str(new)
    (new / "parts" / "p2.json").write_text(json.dumps({"environment": {}}))   # complete: a new dated folder
    assert tables.resolve_out(None, table, "cpu", None, False, str(results)) == str(results /
                                                                                  "2030-02-01_table-x_cpu")
    assert tables.resolve_out(None, table, "cpu", None, True, str(results)) == str(results / "2030-01-09_table-x_h200")


def test_dry_run_prints_every_command_of_table_a(capsys):
    assert tables.main(["table-a", "--dry-run"]) == 0
    text = capsys.readouterr().out
    for part in spec.TABLES["table-a"].parts:
        assert f"python benchmarks/tables.py table-a --part {part.name}\n" in text
    assert text.count("python pretrain_gpt.py") == 5 * 3 + 6 * 2   # 15 runs, 6 searches (planner + runs)
    assert "--fp8-recipe coat --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 " \
           "--grad-reduce-in-bf16 --log-json" in text
    assert "--micro-batch-size MB --global-batch-size MB" in text and "--dry-run" in text


# ------------------------------------------------------------------------------------------------ metrics


def test_summarise_log_averages_the_intervals_after_warmup():
    rng = random.Random(1)
    records = [{"iteration": it, "lm_loss": rng.uniform(2, 3), "tokens_per_s": rng.uniform(1e4, 2e4),
                "tflops_per_gpu": rng.uniform(100, 200), "mfu": rng.uniform(0.1, 0.2),
                "peak_mem_gib": rng.uniform(10, 20), "time_per_iter_s": rng.uniform(0.1, 0.2)}
               for it in range(5, 45, 5)]
    records.insert(4, {"iteration": 20, "valid_loss": 3.5})
    records.append({"iteration": 40, "valid_loss": 3.25})
    m = trun.summarise_log(records, warmup_iters=10)
    steps = [r for r in records if "lm_loss" in r]
    warm = [r for r in steps if r["iteration"] > 10]
    assert m["intervals"] == len(warm) == 6
    assert m["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in warm) / 6)
    assert m["mfu"] == pytest.approx(sum(r["mfu"] for r in warm) / 6)
    assert m["peak_gib"] == max(r["peak_mem_gib"] for r in steps)   # the peak of every interval, warm-up included
    assert m["final_train_loss"] == pytest.approx(sum(r["lm_loss"] for r in steps[-5:]) / 5)
    assert m["valid"] == [[20, 3.5], [40, 3.25]] and m["final_valid_loss"] == 3.25
    # nothing after the warm-up: the last interval
    assert trun.summarise_log(records, warmup_iters=100)["tokens_per_s"] == steps[-1]["tokens_per_s"]
    assert trun.summarise_log([{"iteration": 1, "valid_loss": 2.0}], 0) is None


def test_speed_tables_flag_runs_with_unsteady_intervals(fake_table, tmp_path, monkeypatch):
    table, _, run = fake_table
    # warm-up 10: the intervals ending at 20 and 30 are averaged; the first one never counts
    part = spec.Part("p", "speed part", 1, device="cpu", runs=(
        run("steady", "--rates", "900,1000,1040"), run("stall", "--rates", "900,800,1000"),
        run("slow-start", "--rates", "100,1000,1040")))
    monkeypatch.setitem(tables.TABLES, "table-x", replace(table, parts=(part,), speed=True))
    out = tmp_path / "2030-01-02_table-x_cpu"
    assert tables.main(["table-x", "--out", str(out)]) == 0
    merged = json.loads((out / "table-x.json").read_text())
    assert merged["checks"] == ["`p` / `stall`: the intervals it averages range from 800 to 1,000 tokens/s (+25.0%), "
                                "a one-off stall or a busy machine; `--redo --part p` measures it again"]
    assert "## Checks\n\n- `p` / `stall`" in (out / "README.md").read_text()
    assert "\nCheck: `p` / `stall`" in render.docs_block(merged, "x", [])
    # a table whose results are not speeds (convergence) flags nothing
    monkeypatch.setitem(tables.TABLES, "table-x", replace(table, parts=(part,)))
    assert tables.main(["table-x", "--out", str(out), "--merge-only"]) == 0
    assert json.loads((out / "table-x.json").read_text())["checks"] == []
    assert "Check:" not in render.docs_block(json.loads((out / "table-x.json").read_text()), "x", [])


def test_unsteady_runs_of_a_largest_micro_batch_search_are_flagged_too(tmp_path):
    log = tmp_path / "raw" / "s" / "bf16-mbs8.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps({"iteration": it, "lm_loss": 2.0, "tokens_per_s": v}) + "\n"
                           for it, v in ((4, 90.0), (8, 1000.0), (12, 700.0))))
    run = {"name": "bf16-mbs8", "kind": "megacoat", "log_json": "raw/s/bf16-mbs8.jsonl", "metrics": {"intervals": 2}}
    parts = {"s": {"runs": [], "searches": [{"name": "bf16", "attempts": [{"micro_batch": 8, "run": run}]}]}}
    assert [c.split(":")[0] for c in trun.unsteady_runs(parts, str(tmp_path))] == ["`s` / `bf16-mbs8`"]


def test_out_of_memory_is_told_apart_from_a_failure(fake_table, tmp_path):
    _, _, run = fake_table
    ctx = trun.Context(root=str(tmp_path), out=str(tmp_path / "out"), part="p", device="cpu")
    assert trun.execute(run("x", "--oom"), ctx)["outcome"] == "out of memory"
    failed = trun.execute(run("y", "--fail"), ctx)
    assert failed["outcome"] == "failed (exit 3)" and failed["log_json"] is None
    ok = trun.execute(run("z"), ctx)
    assert ok["outcome"] == "ok" and ok["metrics"]["intervals"] == 2 and ok["log_json"] == "raw/p/z.jsonl"
    skipped = trun.execute(spec.Run("t", "torchao row", ("x.py",), needs=("torchao",)), ctx)
    assert skipped["outcome"].startswith("skipped: torchao")


# ------------------------------------------------------------------------------------ largest micro-batch


@pytest.mark.parametrize("fits_up_to,first", [(7, 7), (7, 4), (7, 10), (1, 3), (12, 2)])
def test_search_finds_the_largest_micro_batch_that_runs(fits_up_to, first):
    seen = []

    def attempt(mb):
        seen.append(mb)
        return {"outcome": "ok" if mb <= fits_up_to else "out of memory"}

    result = trun.search_largest(attempt, first)
    assert result["largest"] == fits_up_to and result["stopped"] is None
    assert fits_up_to in seen and (fits_up_to + 1 in seen)   # the largest confirmed and the next one tried
    assert len(seen) == abs(first - fits_up_to) + (1 if first > fits_up_to else 2)


def test_search_stops_on_a_failure_and_when_nothing_fits():
    r = trun.search_largest(lambda mb: {"outcome": "ok" if mb < 5 else "failed (exit 1)"}, 3)
    assert r["largest"] == 4 and r["stopped"] == "failed (exit 1)"
    r = trun.search_largest(lambda mb: {"outcome": "out of memory"}, 3)
    assert r["largest"] is None and [a["micro_batch"] for a in r["attempts"]] == [3, 2, 1]


@pytest.mark.parametrize("seed", range(6))
def test_planner_candidate_is_the_largest_estimate_that_fits(seed):
    rng = random.Random(seed)
    base, per = rng.uniform(20, 100), rng.uniform(1, 15)
    capacity = rng.uniform(50, 140)
    peaks = {mb: base + per * mb for mb in range(1, 65)}
    calls = []

    def peak_at(mb):
        calls.append(mb)
        return peaks[mb]

    want = max([mb for mb, p in peaks.items() if p <= capacity], default=0)
    assert trun.planner_candidate(peak_at, capacity) == want
    assert len(calls) <= 14   # doubling, then bisection
    assert trun.planner_candidate(lambda mb: None, capacity) is None


def test_planned_peak_reads_the_dry_run():
    text = ("  weights 12.55 GiB | FP8 weight copies 12.06 GiB\n"
            "  peak with this configuration (estimate) (one micro-batch: the larger of the forward's end and the "
            "backward's): 134.85 GiB; --fp8-weight-cache auto drops the kept FP8 weight copies (12.06 GiB) where the "
            "run can use less than 141.95 GiB of a GPU's memory (95% of it for this peak)\n")
    assert trun.planned_peak(text, 139.0) == pytest.approx(134.85 - 12.06)   # copies dropped on this GPU
    assert trun.planned_peak(text, 150.0) == pytest.approx(134.85)
    bf16 = "  peak with this configuration (estimate) (one micro-batch: the larger ...): 113.46 GiB\n"
    assert trun.planned_peak(bf16, 139.0) == pytest.approx(113.46)
    assert trun.planned_peak("no plan here", 139.0) is None


# ----------------------------------------------------------------------------------- analysis and writers


def _speed_part(name, methods, rng, mbs=4):
    runs = []
    for m in methods:
        runs.append({"name": m, "label": spec.METHODS[m].label, "kind": "megacoat", "outcome": "ok",
                     "info": {"method": m, "micro_batch": mbs}, "metrics": {
                         "tokens_per_s": rng.uniform(1e4, 9e4), "tflops": rng.uniform(100, 600),
                         "mfu": rng.uniform(0.1, 0.6), "peak_gib": rng.uniform(20, 130)}})
    return {"runs": runs, "searches": []}


def _search(method, largest, rng):
    attempts = [{"micro_batch": mb, "outcome": "ok", "run": {"metrics": {"tokens_per_s": rng.uniform(1e4, 3e4),
                                                                           "peak_gib": rng.uniform(100, 139)}}}
                for mb in range(largest - 1, largest + 1)]
    attempts.append({"micro_batch": largest + 1, "outcome": "out of memory", "run": {"metrics": None}})
    return {"name": method, "label": spec.METHODS[method].label, "largest": largest, "attempts": attempts}


def test_table_a_ratios_and_targets_from_synthetic_parts():
    rng = random.Random(7)
    parts = {"1p36b-gbs4": _speed_part("1p36b-gbs4", spec.METHODS, rng),
             "7b-mbs2": _speed_part("7b-mbs2", spec.METHODS, rng, mbs=2),
             "7b-largest-fp8states": {"runs": [], "searches": [_search("bf16", 6, rng),
                                                                _search("coat-fp8states", 11, rng)]}}
    a = spec.analyse_table_a(parts)
    gbs4 = {r["label"]: r for r in a["sections"][0]["rows"]}
    by = {r["info"]["method"]: r["metrics"] for r in parts["1p36b-gbs4"]["runs"]}
    want = by["coat-fp8states"]["tokens_per_s"] / by["bf16"]["tokens_per_s"]
    assert gbs4[spec.METHODS["coat-fp8states"].label]["vs_bf16"] == pytest.approx(want)
    targets = {t["key"]: t for t in a["targets"]}
    assert targets["1p36b-gbs4-speed"]["value"] == pytest.approx(want)
    assert targets["1p36b-gbs4-speed"]["met"] == (want >= 1.30)
    b7 = {r["info"]["method"]: r["metrics"] for r in parts["7b-mbs2"]["runs"]}
    mem = b7["bf16"]["peak_gib"] / b7["coat-fp8states-bf16grads"]["peak_gib"]
    assert targets["7b-mbs2-memory"]["value"] == pytest.approx(mem)
    s = parts["7b-largest-fp8states"]["searches"]
    at_largest = [x["attempts"][1]["run"]["metrics"]["tokens_per_s"] for x in s]   # attempts: largest-1, largest, +1
    largest = at_largest[1] / at_largest[0]
    assert targets["7b-largest-speed"]["value"] == pytest.approx(largest)
    assert targets["7b-mbs2-speed"]["value"] is not None
    # the 1.36B global batch 32 part is missing: its section has no rows, no target depends on it
    assert a["sections"][1]["rows"] == [] and all(t["met"] is not None for t in a["targets"])
    md = render.sections_markdown({"sections": a["sections"]})
    assert "| 11 |" in md and "Not measured yet." in md
    bars = a["plots"][0]["groups"]
    assert bars["1.36B, micro-batch 4, global batch 4"][0] == ["bf16", "bf16", by["bf16"]["tokens_per_s"]]
    largest_bars = bars["7B, each method's largest micro-batch (global batch = micro-batch)"]
    assert [b[0] for b in largest_bars] == ["bf16, micro-batch 6 (fp8states)",
                                            "coat + FP8 optimizer states, micro-batch 11 (fp8states)"]


def test_table_c2_ablations_must_be_worse_than_their_method():
    def part(key, loss):
        return {"runs": [{"name": key, "label": key, "kind": "megacoat", "log_json": f"raw/{key}/{key}.jsonl",
                          "metrics": {"final_valid_loss": loss, "valid": [[300, loss]], "final_train_loss": loss}}]}

    losses = {"plain": 4.0, "qwd": 4.004, "tlq-hs": 4.01, "both": 4.011, "qwd-direct": 4.2, "tlq-no-hadamard": 4.009,
              "tlq-hs-4bit": 4.05}
    c2 = spec.analyse_table_c2({k: part(k, v) for k, v in losses.items()})
    t = {x["key"]: x for x in c2["targets"]}
    assert t["both-gap"]["value"] == pytest.approx(4.011 / 4.0 - 1) and t["both-gap"]["met"] is True
    assert t["qwd-direct-worse"]["met"] is True and t["tlq-hs-4bit-worse"]["met"] is True
    assert t["tlq-no-hadamard-worse"]["met"] is False          # better than TLq-HS: the ablation does not hurt
    assert c2["plots"][0]["runs"]["both"] == "raw/both/both.jsonl"
    text = render.targets_table(c2["targets"])
    assert "| **no** |" in text and "+0.28%" in text


def test_table_d_counts_peer_flops_with_megacoats_formula():
    def run(name, kind, tps, tflops=None, mfu=None, command="", label=None):
        return {"name": name, "label": label or name, "kind": kind, "command": command,
                "metrics": {"tokens_per_s": tps, "tflops": tflops, "mfu": mfu, "peak_gib": 30.0}}

    parts = {"1p36b": {"runs": [run("megacoat-bf16", "megacoat", 50000.0, 450.0, mfu=0.455, label="bf16"),
                                run("plain", "peer", 40000.0, 999.0),
                                run("torchao-tensorwise", "peer", 45000.0, command="python x.py --float8 tensorwise"),
                                {"name": "torchao-rowwise", "label": "torchao-rowwise", "kind": "peer",
                                 "metrics": None, "outcome": "skipped: torchao does not import here"}]}}
    d = spec.analyse_table_d(parts)
    rows = {r["label"].split(" (")[0]: r for r in d["sections"][0]["rows"]}
    assert rows["plain"]["tflops"] == pytest.approx(40000.0 * 450.0 / 50000.0)
    # MFU as the training log has it: megacoat's own figure; a peer's against its GEMM format's peak
    assert rows["megacoat bf16"]["mfu"] == 0.455
    assert rows["plain"]["mfu"] == pytest.approx(40000.0 * 450.0 / 50000.0 / 989.0)
    assert rows["torchao-tensorwise"]["mfu"] == pytest.approx(45000.0 * 450.0 / 50000.0 / 1979.0)
    assert rows["megacoat bf16"]["vs"] == "1.250x plain"
    assert "skipped: torchao" in d["sections"][0]["rows"][3]["label"]
    assert [t["value"] for t in d["targets"]] == [pytest.approx(1.25)]
    assert d["targets"][0]["what"].startswith("1.36B: megacoat bf16 / plain")


def test_markdown_table_formats_and_escapes():
    cols = [{"key": "a", "title": "name", "fmt": "text"}, {"key": "b", "title": "tokens/s", "fmt": "int"},
            {"key": "c", "title": "vs", "fmt": "ratio"}, {"key": "d", "title": "gap", "fmt": "gap"}]
    rng = random.Random(3)
    v = rng.uniform(1e4, 1e5)
    text = render.markdown_table(cols, [{"a": "x | y", "b": v, "c": 1.23456, "d": -0.00123}, {"a": "z"}])
    lines = text.splitlines()
    assert lines[0] == "| name | tokens/s | vs | gap |" and lines[1] == "|---|---|---|---|"
    assert lines[2] == f"| x \\| y | {v:,.0f} | 1.235x | -0.12% |"
    assert lines[3] == "| z | - | - | - |"


def test_with_steps_cuts_every_schedule():
    run = spec.TABLE_C1_PARTS[0].runs[0]
    cut = spec.with_steps(run, 10)
    flags = dict(zip(cut.argv, cut.argv[1:]))
    assert flags["--train-iters"] == "10" and flags["--eval-interval"] == "10" and flags["--eval-iters"] == "2"
    assert flags["--lr-warmup-iters"] == "2" and flags["--log-interval"] == "2" and cut.warmup_iters == 5
    assert run.save_interval == 500 and cut.save_interval == 5
    peer = spec.with_steps(spec.TABLE_D_PARTS[0].runs[3], 4)
    pf = dict(zip(peer.argv, peer.argv[1:]))
    assert pf["--iters"] == "4" and pf["--warmup"] == "2"


def test_every_part_fits_its_budget_on_paper():
    for table in spec.TABLES.values():
        names = [p.name for p in table.parts]
        assert len(set(names)) == len(names)
        for p in table.parts:
            assert p.minutes <= 9 and (p.runs or p.searches)
            assert all(r.timeout_s <= (600 if p.device == "cuda" else 1800) for r in p.runs)
            run_names = [r.name for r in p.runs]
            assert len(set(run_names)) == len(run_names)


@pytest.mark.slow
def test_table_c2_part_runs_on_cpu(tmp_path):
    """The real smallest table-c2 part (4 gloo ranks as 2 x 2), cut to 4 steps."""
    out = tmp_path / "c2"
    assert tables.main(["table-c2", "--part", "both", "--steps", "4", "--out", str(out)]) == 0
    part = json.loads((out / "parts" / "both.json").read_text())
    run = part["runs"][0]
    assert run["outcome"] == "ok" and run["metrics"]["iterations"] == 4
    comm = run["metrics"]["comm_bytes_per_iter"]
    assert comm.get("grad_intra", 0) > 0 and comm.get("grad_inter", 0) > 0 and comm.get("param", 0) > 0
    assert run["metrics"]["final_valid_loss"] is not None
    merged = json.loads((out / "table-c2.json").read_text())
    assert merged["steps"] == 4 and "both" in merged["parts"]
    assert "Smoke run" in (out / "README.md").read_text()


def test_a_search_part_asks_the_planner_then_confirms_with_runs(fake_table, tmp_path, monkeypatch):
    """A part of table-a's kind (largest micro-batch searches) with a stand-in for pretrain_gpt.py: the planner's
    estimate grows by 10 GiB per sample from 20; micro-batches above `fits` run out of memory."""
    table, _, _ = fake_table
    calls, fits = [], {"bf16": 7, "coat": 9}

    def runner(argv, cwd, env, timeout):
        mb = int(argv[argv.index("--micro-batch-size") + 1])
        method = "coat" if "--coat" in argv else "bf16"
        calls.append((method, mb, "--dry-run" in argv))
        if "--dry-run" in argv:
            return 0, f"  peak with this configuration (estimate) (one micro-batch: ...): {20 + 10 * mb:.2f} GiB\n"
        if mb > fits[method]:
            return 1, "torch.OutOfMemoryError: CUDA out of memory."
        with open(argv[argv.index("--log-json") + 1], "w") as f:
            for it in (2, 4, 6, 8):
                f.write(json.dumps({"iteration": it, "lm_loss": 9.0, "tokens_per_s": 1000.0 * mb + it,
                                    "peak_mem_gib": 20 + 10 * mb}) + "\n")
        return 0, "ok"

    def search(method, flags):
        return spec.LargestBatch(method, method, lambda mb: spec.Run(
            f"{method}-mbs{mb}", method, ("pretrain_gpt.py", "--micro-batch-size", str(mb)) + flags,
            warmup_iters=4, info=(("method", method),)))

    part = spec.Part("largest", "searches", 1, searches=(search("bf16", ()), search("coat", ("--coat",))))
    monkeypatch.setattr(tables, "describe", lambda argv, device: {
        "date": "2030-01-02T03:04:05Z", "commit": "c", "hardware": "h200", "gpu": {"name": "GPU", "memory_gib": 101.0},
        "command": "x"})
    record = tables.run_part(table, part, str(tmp_path / "out"), ["x"], 600, None, str(tmp_path), runner=runner)
    assert record["status"] == "complete"
    bf16, coat = record["searches"]
    assert bf16["capacity_gib"] == pytest.approx(99.99)
    assert bf16["planner_candidate"] == 7 and coat["planner_candidate"] == 7   # 20 + 10 x 7 = 90 <= 99.99 < 100
    assert bf16["largest"] == 7 and [a["micro_batch"] for a in bf16["attempts"]] == [7, 8]
    assert coat["largest"] == 9 and [a["micro_batch"] for a in coat["attempts"]] == [7, 8, 9, 10]
    assert [a["outcome"] for a in coat["attempts"]] == ["ok", "ok", "ok", "out of memory"]
    assert coat["attempts"][2]["run"]["metrics"]["tokens_per_s"] == pytest.approx(9000 + 7)   # iterations 6, 8
    planner = [mb for method, mb, dry in calls if dry and method == "bf16"]
    assert planner == [2, 4, 8, 6, 7]


@pytest.mark.slow
def test_code_corpus_is_built_once_and_checked_for_size(tmp_path, monkeypatch):
    """table-c1's corpus: tools/preprocess_data.py over the installed packages (here a small stand-in folder),
    reused on the next call, refused when smaller than the table needs."""
    packages = tmp_path / "site-packages"
    rng = random.Random(2)
    for i in range(20):
        (packages / f"pkg{i}").mkdir(parents=True)
        (packages / f"pkg{i}" / "mod.py").write_text("\n".join(f"def f{j}(x):\n    return x * {rng.randint(0, 99)}"
                                                              for j in range(50)))
    monkeypatch.setattr(trun, "site_packages", lambda python: [str(packages)])
    ctx = trun.Context(root=str(tables.ROOT), out=str(tmp_path / "out"), part="c", device="cpu")
    with pytest.raises(RuntimeError, match="fewer than the 10,000,000 table-c1 needs"):
        trun.build_code_corpus(ctx, str(tmp_path / "small"), min_tokens=10_000_000)
    corpus = trun.build_code_corpus(ctx, str(tmp_path / "corpus"), min_tokens=1000)
    assert corpus["documents"] == 20 and corpus["tokens"] > 1000 and not corpus["reused"]
    assert Path(corpus["prefix"] + ".bin").stat().st_size == corpus["bin_bytes"]
    again = trun.build_code_corpus(ctx, str(tmp_path / "corpus"), min_tokens=1000)
    assert again["reused"] and again["fingerprint"] == corpus["fingerprint"]


RESUMABLE = textwrap.dedent("""
    import json, os, sys
    a = sys.argv[1:]
    save, log = a[a.index("--save") + 1], a[a.index("--log-json") + 1]
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    start = int(open(tracker).read()) if os.path.exists(tracker) else 0
    stop = int(a[a.index("--stop-at") + 1]) if "--stop-at" in a else 6
    os.makedirs(save, exist_ok=True)
    with open(log, "a") as f:
        for it in range(start + 1, stop + 1):
            f.write(json.dumps({"iteration": it, "lm_loss": 1.0, "tokens_per_s": 100.0}) + "\\n")
    open(tracker, "w").write(str(stop))
""")


def test_a_resumable_run_cut_by_the_budget_continues_from_its_checkpoint(tmp_path):
    script = tmp_path / "resumable.py"
    script.write_text(RESUMABLE)
    run = spec.Run("r", "resumable", (str(script),), warmup_iters=0, save_interval=3)
    scratch = tmp_path / "scratch"
    calls = []

    def runner(argv, cwd, env, timeout, cut=False):
        calls.append(argv)
        code, out = trun.run_process(list(argv) + (["--stop-at", "3"] if cut else []), cwd, env, timeout)
        return (None if cut else code), out

    def ctx(fresh=False):
        return trun.Context(root=str(tmp_path), out=str(tmp_path / "out"), part="p", device="cpu",
                            scratch=str(scratch), key="k", fresh=fresh)

    first = trun.execute(run, ctx(), lambda *a: runner(*a, cut=True))
    assert first["outcome"].startswith("timed out") and os.path.isdir(first["resumable_from"])
    assert ["--save-interval", "3"] == calls[0][calls[0].index("--save-interval"):][:2]
    second = trun.execute(run, ctx(), runner)
    assert second["outcome"] == "ok" and second["metrics"]["iterations"] == 6
    log = trun.read_json_lines(str(tmp_path / "out" / second["log_json"]))
    assert [r["iteration"] for r in log] == [1, 2, 3, 4, 5, 6]      # the cut run's records, then the rest
    assert not os.listdir(scratch)                                   # finished: its checkpoints are removed
    # --redo (fresh): a cut run's checkpoints are dropped and the run starts over
    trun.execute(run, ctx(), lambda *a: runner(*a, cut=True))
    third = trun.execute(run, ctx(fresh=True), lambda *a: runner(*a, cut=True))
    log = trun.read_json_lines(str(tmp_path / "out" / third["log_json"]))
    assert [r["iteration"] for r in log] == [1, 2, 3]
