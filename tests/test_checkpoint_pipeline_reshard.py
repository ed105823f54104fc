"""A checkpoint saved at (TP, PP, DP) = (2, 1, 2) resumes at (1, 2, 1) and (2, 2, 1) exactly
where an uninterrupted single-process run is (from the command line, fp32, dropout off)."""
import json

import pytest

from test_cli import TINY, run_cli


def _losses(path):
    return [json.loads(line)["lm_loss"] for line in open(path) if "lm_loss" in json.loads(line)]


@pytest.mark.slow
def test_save_tp2_dp2_resume_at_pp2_and_tp2_pp2(tmp_path):
    common = TINY + ["--num-layers", "4", "--train-iters", "3", "--global-batch-size", "4", "--fp32",
                     "--group-query-attention", "--num-query-groups", "2"]
    ckpt = str(tmp_path / "ckpt")
    r = run_cli(common + ["--log-json", str(tmp_path / "single.jsonl")])
    assert r.returncode == 0, r.stderr[-3000:]
    single = _losses(tmp_path / "single.jsonl")
    r = run_cli(common + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--exit-interval", "2",
                          "--save", ckpt, "--log-json", str(tmp_path / "saved.jsonl")], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = _losses(tmp_path / "saved.jsonl")
    for name, nproc, extra in (("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
                               ("tp2pp2", 4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                                              "2", "--sequence-parallel"])):
        path = tmp_path / f"{name}.jsonl"
        r = run_cli(common + extra + ["--load", ckpt, "--log-json", str(path)], nproc=nproc)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        resumed = _losses(path)
        assert len(saved) == 2 and len(resumed) == 1
        for a, b in zip(single, saved + resumed):
            assert abs(a - b) <= 1e-5 * abs(a), (name, single, saved, resumed)
