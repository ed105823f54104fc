"""benchmarks/calibrate.py's flags: a bad link speed, time budget or output directory is refused in one line before
any measuring (it was found only after the measurements, by a traceback, or never)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import calibrate  # noqa: E402


@pytest.mark.parametrize("flags, message", [
    (["--inter-node-gbps", "-5"], "--inter-node-gbps -5.0 must be > 0 and finite"),
    (["--inter-node-gbps", "nan"], "--inter-node-gbps nan must be > 0 and finite"),
    (["--inter-node-gbps", "0"], "--inter-node-gbps 0.0 must be > 0 and finite"),
    (["--budget-s", "-1"], "--budget-s -1.0 must be > 0"),
    (["--out", os.path.join("no", "such", "m.json")], f"--out {os.path.join('no', 'such', 'm.json')}: its directory "
     "does not exist"),
])
def test_bad_flags_are_refused_before_measuring(capsys, monkeypatch, flags, message):
    measured = []
    monkeypatch.setattr(calibrate, "part_gemm", lambda deadline: measured.append("gemm"))
    monkeypatch.setattr(calibrate.torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(calibrate.torch.cuda, "set_device", lambda i: measured.append("device"))
    argv = ["--name", "x", "--out", os.devnull] + flags
    assert calibrate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"benchmarks/calibrate.py: error: {message}") and err.count("\n") == 1, err
    assert not measured
