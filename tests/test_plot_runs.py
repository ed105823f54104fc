"""tools/plot_runs.py: runs aligned by consumed tokens, a table of hand-checkable figures, one PNG."""
import json
import os
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
