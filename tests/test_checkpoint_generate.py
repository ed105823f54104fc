"""tools/generate.py: sampling rules, and an end-to-end run on a saved checkpoint."""
import os
import runpy

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = runpy.run_path(os.path.join(ROOT, "tools", "generate.py"), run_name="generate")


def test_sampling_rules():
    sample = GEN["sample_next"]
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, 1.0, 0, 1.0, True, g) == 1
    assert all(sample(logits, 1.0, 1, 1.0, False, g) == 1 for _ in range(20))        # top-k 1 = greedy
    assert all(sample(logits, 1.0, 0, 0.01, False, g) == 1 for _ in range(20))       # tiny nucleus = greedy
    assert {sample(logits, 1.0, 2, 1.0, False, g) for _ in range(200)} == {1, 2}     # top-k 2: two ids only


def test_generate_from_checkpoint(tmp_path, capsys):
    from test_checkpoint_resume import train
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "1", "--save", save])
    assert GEN["main"](["--load", save, "--prompt", "5 7 9", "--max-new-tokens", "5", "--greedy"]) == 0
    out = capsys.readouterr().out.split()
    assert out[:3] == ["5", "7", "9"] and len(out) >= 4  # NullTokenizer: ids as text
    assert GEN["main"](["--load", str(tmp_path / "missing"), "--prompt", "1"]) == 2
