"""tools/plot_runs.py: runs aligned by consumed tokens, a table of hand-checkable figures, one PNG."""
import json
import os
import re
import subprocess
import sys

import pytest

from test_cli import ROOT, TINY, run_cli

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_runs  # noqa: E402


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _rec(it, samples, seq, loss, tps, mem=1.0):
    return dict(iteration=it, consumed_samples=samples, consumed_tokens=samples * seq, lm_loss=loss,
                tokens_per_s=tps, tflops_per_gpu=tps / 1000, peak_mem_gib=mem)


def test_runs_align_by_tokens_and_the_table_is_right(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    # a: 8 samples x 32 tokens per step; b: 16 x 32 (twice the tokens per iteration).
    _write(a, [_rec(i, 8 * i, 32, 5.0 - 0.1 * i, 100.0 + i, mem=1.0 + i) for i in range(1, 5)]
           + [{"iteration": 4, "valid_loss": 4.5}])
    _write(b, [_rec(i, 16 * i, 32, 4.0 - 0.1 * i, 200.0 * i) for i in range(1, 4)]
           + [{"iteration": 2, "valid_loss": 3.9}])
    ra, rb = plot_runs.read_run("a", str(a)), plot_runs.read_run("b", str(b))
    assert ra.tokens == [256, 512, 768, 1024] and rb.tokens == [512, 1024, 1536]
    assert rb.valid == [(1024, 3.9)]  # validation placed at its iteration's tokens
    s = plot_runs.summary(ra, final_window=2)
    assert s["final train loss"] == pytest.approx((4.7 + 4.6) / 2)
    assert s["median tokens/s"] == pytest.approx(102.5) and s["peak mem GiB"] == 5.0
    assert s["last valid loss"] == 4.5 and s["tokens"] == 1024 and s["iterations"] == 4
    out = tmp_path / "cmp.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_runs.py"), f"A={a}", f"B={b}",
                        "--out", str(out), "--final-window", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| A | 4 | 1,024 | 4.6500 | 4.5000 | 102.5 |" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 500 and img.shape[1] > 500 and img[..., :3].std() > 0.05  # a picture, not blank


def test_real_log_and_old_logs_need_seq_length(tmp_path):
    log = tmp_path / "log.jsonl"
    r = run_cli(TINY + ["--train-iters", "3", "--fp32", "--num-workers", "0", "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-2000:]
    run = plot_runs.read_run("tiny", str(log))
    assert run.tokens == [2 * 32, 4 * 32, 6 * 32]  # micro-batch 2 x seq 32 per step
    old = tmp_path / "old.jsonl"
    _write(old, [{k: v for k, v in json.loads(x).items() if k != "consumed_tokens"} for x in open(log)])
    with pytest.raises(SystemExit, match="pass --seq-length"):
        plot_runs.read_run("old", str(old))
    assert plot_runs.read_run("old", str(old), seq_length=32).tokens == run.tokens


@pytest.mark.parametrize("record,message", [
    ({"iteration": 1, "consumed_tokens": 8, "lm_loss": 3.0}, ":2 has no 'tokens_per_s'"),
    ({"consumed_tokens": 8, "lm_loss": 3.0, "tokens_per_s": 5.0}, ":2 has no 'iteration'"),
    ({"iteration": 1, "consumed_tokens": 8, "lm_loss": "3.0", "tokens_per_s": 5.0},
     ":2: lm_loss is '3.0', not a number"),
    ({"iteration": 1.5, "consumed_tokens": 8, "lm_loss": 3.0, "tokens_per_s": 5.0}, ":2: iteration 1.5 is not"),
    ({"iteration": 2, "valid_loss": [3.0]}, ":2: valid_loss is [3.0], not a number"),
    ([1, 2, 3], ":2 is not a JSON object")])
def test_a_malformed_record_stops_with_file_and_line(tmp_path, record, message):
    log = tmp_path / "log.jsonl"
    _write(log, [_rec(1, 8, 32, 3.0, 100.0), record])
    with pytest.raises(SystemExit, match=f"plot_runs.py: {re.escape(str(log) + message)}"):
        plot_runs.read_run("a", str(log))


def test_a_directory_given_as_a_log_is_named(tmp_path):
    with pytest.raises(SystemExit, match="is a directory: pass the --log-json files"):
        plot_runs.read_run("a", str(tmp_path))


def test_records_without_a_figure_are_left_out_of_medians_and_maxima(tmp_path):
    log = tmp_path / "log.jsonl"
    recs = [_rec(i, 8 * i, 32, 3.0, 100.0 * i, mem=float(i)) for i in range(1, 4)]
    recs[1].update(tflops_per_gpu=None, peak_mem_gib=None)
    recs[2]["peak_mem_gib"] = float("nan")
    _write(log, recs)
    s = plot_runs.summary(plot_runs.read_run("a", str(log)), final_window=2)
    assert s["median TFLOP/s/GPU"] == pytest.approx(0.2) and s["peak mem GiB"] == 1.0


def test_a_run_restarted_into_the_same_log_replaces_the_earlier_records(tmp_path, capsys):
    """Iterations 1-5 with validation at 4, then the run logged again from iteration 3 (a resume that did not trim
    the log): one curve 1, 2, 3', 4', 5', 6' with the new run's figures, not a line that goes back."""
    log = tmp_path / "log.jsonl"
    first = [_rec(i, 8 * i, 32, 5.0, 100.0) for i in range(1, 6)] + [{"iteration": 4, "valid_loss": 4.9}]
    again = [_rec(i, 8 * i, 32, 4.0, 300.0) for i in range(3, 7)] + [{"iteration": 6, "valid_loss": 3.9}]
    _write(log, first + again)
    run = plot_runs.read_run("a", str(log))
    assert run.iterations == [1, 2, 3, 4, 5, 6] and run.tokens == [256 * i for i in range(1, 7)]
    assert run.loss == [5.0, 5.0, 4.0, 4.0, 4.0, 4.0] and run.valid == [(256 * 6, 3.9)]
    assert plot_runs.summary(run, final_window=10)["median tokens/s"] == 300.0
    assert f"{log}:7 logs iteration 3 again" in capsys.readouterr().err


def test_the_output_path_is_checked_before_drawing(tmp_path, capsys):
    """A missing directory is made; no suffix writes (and reports) a PNG; a directory, a path under a file or a
    format matplotlib cannot write is refused before the logs are read, with nothing written."""
    log = tmp_path / "log.jsonl"
    _write(log, [_rec(i, 8 * i, 32, 3.0, 100.0) for i in range(1, 4)])
    assert plot_runs.main([str(log), "--out", str(tmp_path / "new" / "dir" / "c.png")]) == 0
    assert (tmp_path / "new" / "dir" / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert plot_runs.main([str(log), "--out", str(tmp_path / "plain")]) == 0
    assert f"wrote {tmp_path / 'plain.png'}" in capsys.readouterr().out
    assert (tmp_path / "plain.png").read_bytes()[:4] == b"\x89PNG"
    for out, message in [(tmp_path / "new", "is a directory: name the file"),
                         (tmp_path / "c.foo", "matplotlib cannot write .foo files; use .png"),
                         (log / "c.png", f"{log} is a file, not a directory")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            plot_runs.main([str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "new", "plain.png"]
    assert os.listdir(tmp_path / "new" / "dir") == ["c.png"]


@pytest.mark.parametrize("flag,value", [("--final-window", "0"), ("--seq-length", "-4"), ("--smooth", "0")])
def test_window_and_length_flags_below_one_are_refused(tmp_path, capsys, flag, value):
    log = tmp_path / "log.jsonl"
    _write(log, [_rec(i, 8 * i, 32, 3.0 + i, 100.0) for i in range(1, 4)])
    with pytest.raises(SystemExit):
        plot_runs.main([str(log), "--out", str(tmp_path / "c.png"), flag, value])
    assert f"argument {flag}: must be >= 1, got {value}" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_runs_from_one_directory_keep_names_that_tell_them_apart(tmp_path, capsys):
    d = tmp_path / "runs" / "a"
    d.mkdir(parents=True)
    logs = [str(d / "log.jsonl"), str(d / "old.jsonl"), str(tmp_path / "runs" / "b.jsonl")]
    for i, log in enumerate(logs):
        _write(log, [_rec(it, 8 * it, 32, 3.0 + i, 100.0) for it in range(1, 3)])
    assert plot_runs.main(logs[:2] + ["--out", str(tmp_path / "c.png")]) == 0
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if "| 2 | 512 |" in line]
    assert rows == [f"| {logs[0]}", f"| {logs[1]}"]
    assert plot_runs.run_names(logs) == [(logs[0], logs[0]), (logs[1], logs[1]), ("runs", logs[2])]
    assert plot_runs.run_names([f"x={logs[0]}", logs[1]]) == [("x", logs[0]), ("a", logs[1])]
    with pytest.raises(SystemExit, match="two runs are named 'x': give each its own NAME=PATH"):
        plot_runs.run_names([f"x={logs[0]}", f"x={logs[1]}"])
