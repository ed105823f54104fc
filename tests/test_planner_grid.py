"""benchmarks/planner_grid.py's bookkeeping on CPU: the grid resumes in the newest folder that lacks parts (it
takes about two hours of one GPU, often spread over days), parts carry their commit, and --compare predicts every
measured run again with the model as it is, lists the grid's runs not measured yet, and refuses a folder without
parts or with a damaged one."""
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import planner_grid as pg  # noqa: E402
from megacoat.training.hardware import load_hardware  # noqa: E402

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--mock-data --vocab-size 301 --bf16").split()


def _part(folder, name, runs, date="2030-01-01T00:00:00"):
    (folder / "parts").mkdir(parents=True, exist_ok=True)
    pg.write_json(str(folder / "parts" / f"{name}.json"), {"part": name, "date": date, "commit": "abcdef0123",
                                                          "runs": runs})


def _run(name, mbs, measured_ms=None, rng=random.Random(3)):
    r = {"name": name, "model": "1p36b", "recipe": "bf16", "micro_batch": mbs, "recompute": False,
         "flags": TINY + ["--micro-batch-size", str(mbs), "--global-batch-size", str(mbs)],
         "predicted_ms": 1e9, "predicted_tokens_per_s": 1.0}  # a stale prediction: --compare predicts again
    if measured_ms is not None:
        r.update(measured_ms=measured_ms, measured_tokens_per_s=64 * mbs / measured_ms * 1e3,
                 peak_gib=rng.uniform(1, 2))
    return r


def test_the_grid_resumes_in_the_newest_folder_that_lacks_parts(tmp_path, monkeypatch):
    parts = {"a-0": [], "a-1": []}
    results = tmp_path / "results"
    today = pg.datetime.date.today().isoformat()
    assert pg.default_out(str(results), parts) == str(results / f"{today}_planner-grid_h200")
    old = results / "2030-01-01_planner-grid_h200"
    _part(old, "a-0", [])
    assert pg.default_out(str(results), parts) == str(old)        # a-1 still to measure, on a later day
    _part(old, "a-1", [])
    assert pg.default_out(str(results), parts) == str(results / f"{today}_planner-grid_h200")
    assert pg.default_out(str(results), None) == str(old)  # --part NAME: the newest folder (skipped if written)


def test_compare_predicts_again_and_lists_what_is_missing(tmp_path):
    out = tmp_path / "grid"
    _part(out, "p-0", [_run("r1", 1, 2.0), _run("r2", 2, 3.0)], date="2030-01-01T00:00:00")
    _part(out, "p-1", [_run("r2", 2, 5.0), _run("r3", 4)], date="2030-01-02T00:00:00")  # r2 again, r3 failed
    grid_runs = [_run(n, 1) for n in ("r1", "r2", "r3", "r4")]
    text = pg.compare(str(out), load_hardware("h200"), grid_runs)
    assert "over 3 runs (2 measured) of 4 in the grid, measured at commit abcdef0" in text
    assert "| r2 | 5.0 |" in text and "| r2 | 3.0 |" not in text        # the newer part's measurement
    assert "1000000000.0" not in text                                    # predictions made now, not stored ones
    assert "Not measured yet (1): r4." in text and "| r3 | not run |" in text
    assert "2 measured" in text and "within +-10%" in text


def test_compare_refuses_a_folder_without_parts_or_with_a_damaged_one(tmp_path):
    with pytest.raises(SystemExit, match="no part written under"):
        pg.compare(str(tmp_path / "none"), load_hardware("h200"), [])
    _part(tmp_path / "g", "p-0", [_run("r1", 1, 2.0)])
    (tmp_path / "g" / "parts" / "p-1.json").write_text('{"runs": [')
    with pytest.raises(SystemExit, match=r"p-1.json is not valid JSON .*run its part again"):
        pg.compare(str(tmp_path / "g"), load_hardware("h200"), [])
