"""tools/generate.py: sampling rules, and an end-to-end run on a saved checkpoint."""
import os
import runpy

import pytest
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
    for tiny in (1e-40, 1e-300):  # below float32's range: was inf - inf = NaN in the softmax, a traceback
        assert all(sample(logits, tiny, 0, 1.0, False, g) == 1 for _ in range(5))


def test_generate_from_checkpoint(tmp_path, capsys):
    from test_checkpoint_resume import train
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "1", "--save", save])
    assert GEN["main"](["--load", save, "--prompt", "5 7 9", "--max-new-tokens", "5", "--greedy"]) == 0
    out = capsys.readouterr().out.split()
    assert out[:3] == ["5", "7", "9"] and len(out) >= 4  # NullTokenizer: ids as text
    assert GEN["main"](["--load", str(tmp_path / "missing"), "--prompt", "1"]) == 2


BAD_FLAGS = [
    (["--prompt", "5 7 400"], "token id 400, outside the model's vocabulary (ids 0..300)"),
    (["--prompt", "-1"], "token id -1"),
    (["--prompt", "def main("], "cannot be tokenized by the checkpoint's NullTokenizer"),
    (["--temperature", "nan"], "--temperature nan"),
    (["--top-p", "0"], "--top-p 0.0 is outside (0, 1]"),
    (["--top-k", "-2"], "--top-k -2"),
    (["--max-new-tokens", "-1"], "--max-new-tokens -1"),
    (["--temperature", "-1"], "--temperature -1.0 is negative"),  # was greedy decoding, silently
    (["--prompt", "5 \udcff"], "--prompt is not UTF-8 text (bytes b'\\xff' at character 2)"),  # argv's bytes
    (["--vocab-size", "20"], "--vocab-size without --tokenizer-type would be ignored"),  # was ignored
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "20", "--tokenizer-model", "t.model"],
     "--tokenizer-model would be ignored by --tokenizer-type NullTokenizer"),  # was ignored
    (["--device", "tpu"], "--device 'tpu' is not a device"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--device", "cuda"], "no CUDA device; use --device cpu"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from test_checkpoint_resume import train
    save = str(tmp_path_factory.mktemp("gen") / "ckpt")
    train(["--train-iters", "1", "--save", save])
    return save


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_flags_and_prompts_are_named(checkpoint, capsys, flags, message):
    """A prompt the tokenizer cannot read or the model has no embedding for, sampling settings that are
    not numbers, a device that is not there: one line, not a traceback from inside the model."""
    assert GEN["main"](["--load", checkpoint, "--max-new-tokens", "2"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_load_model_takes_a_dtype_or_its_name(tmp_path):
    import pytest

    import megacoat
    from test_checkpoint_resume import train
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "1", "--save", save])
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    want = megacoat.load_model(save, dtype=torch.bfloat16)(tokens)
    for name in ("bf16", "BFloat16"):
        got = megacoat.load_model(save, dtype=name)
        assert next(got.parameters()).dtype == torch.bfloat16 and torch.equal(got(tokens), want)
    for bad in ("int8", torch.int64, 3):
        with pytest.raises(ValueError, match="load_model: dtype"):
            megacoat.load_model(save, dtype=bad)


def test_only_ids_the_tokenizer_has_are_sampled(checkpoint, capsys):
    """A tokenizer with fewer ids than the model's embedding has rows (padding, or one given by flag): ids
    past it were sampled and printed (or failed to decode, a traceback from SentencePiece)."""
    flags = ["--load", checkpoint, "--tokenizer-type", "NullTokenizer", "--vocab-size", "20", "--prompt", "3 4",
             "--max-new-tokens", "40"]
    for seed in range(3):
        assert GEN["main"](flags + ["--seed", str(seed)]) == 0
        out = [int(i) for i in capsys.readouterr().out.split()]
        assert out[:2] == [3, 4] and max(out) < 20, out
