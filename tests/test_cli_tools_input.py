"""The command-line tools given wrong or unusual input: a correct result or a one-line error naming the problem
and the fix; never a traceback, never a silently wrong output, never a half-written file left behind."""
import json
import os
import random
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import preprocess_data  # noqa: E402


def _jsonl(path, texts, key="text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path


def _ids(n, rng, vocab=10):
    return " ".join(str(rng.randrange(vocab)) for _ in range(n))


def _preprocess(capsys, *args):
    """preprocess_data.main in this process: (exit code, stderr)."""
    try:
        rc = preprocess_data.main([str(a) for a in args])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


@pytest.mark.parametrize("workers", ["0", "-3", "two"])
def test_preprocess_refuses_a_worker_count_below_one(tmp_path, capsys, workers):
    src = _jsonl(tmp_path / "a.jsonl", [_ids(5, random.Random(0))])
    rc, err = _preprocess(capsys, "--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
                          "NullTokenizer", "--vocab-size", 10, "--workers", workers)
    assert rc == 2 and "argument --workers:" in err
    assert not list(tmp_path.glob("o_*"))
