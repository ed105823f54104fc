"""benchmarks/multi_gpu_report.py: step time skips the first (compiling) interval; exposed communication
only for runs with the reference's per-GPU work."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import multi_gpu_report as report  # noqa: E402


def _write(path, times, comm=None, valid=None):
    with open(path, "w") as f:
        for i, t in enumerate(times):
            f.write(json.dumps({"iteration": 4 * (i + 1), "time_per_iter_s": t, "tokens_per_s": 1000 / t,
                                "peak_mem_gib": 10.0 + i, "lm_loss": 5.0 - i,
                                "comm_bytes_per_iter": comm or {}}) + "\n")
        if valid is not None:
            f.write(json.dumps({"iteration": 4 * len(times), "valid_loss": valid}) + "\n")


def test_summary_and_exposed_communication(tmp_path):
    _write(tmp_path / "b_ref_1gpu.jsonl", [9.0, 0.25, 0.27])
    _write(tmp_path / "b_sockets_both.jsonl", [9.0, 0.45, 0.47], comm={"param": 2**20, "grad_inter": 3 * 2**20}, valid=4.5)
    _write(tmp_path / "c_plain.jsonl", [9.0, 0.05, 0.07])
    runs = report.load_runs(str(tmp_path))
    assert abs(runs["b_sockets_both"]["step_ms"] - 460.0) < 1e-9  # first interval (compilation) left out
    assert runs["b_sockets_both"]["valid_loss"] == 4.5 and runs["b_sockets_both"]["peak_gib"] == 12.0
    assert runs["b_sockets_both"]["comm_mib"] == {"param": 1.0, "grad_inter": 3.0}
    rows = {line.split("|")[1].strip(): line.split("|") for line in report.table(runs, "b_ref_1gpu").splitlines()[2:]}
    assert rows["b_sockets_both"][4].strip() == "200"   # 460 - 260 ms
    assert rows["c_plain"][4].strip() == ""              # other per-GPU work: no exposed time
    assert rows["b_ref_1gpu"][4].strip() == ""


def test_refuses_a_missing_folder(tmp_path):
    import pytest
    with pytest.raises(SystemExit, match="not a folder"):
        report.main([str(tmp_path / "missing")])
