"""Hugging Face conversion both ways (Llama GQA untied, GPT-2), load_model, unsupported features."""
import os
import runpy

import pytest
import torch

import megacoat
from megacoat.checkpoint import CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 203


def convert(*args):
    """tools/checkpoint/convert.py in this process; returns its exit code."""
    mod = runpy.run_path(os.path.join(ROOT, "tools", "checkpoint", "convert.py"), run_name="convert")
    return mod["main"](list(args))


def _perturb(model):
    """Random values everywhere (norm weights and biases too), so every mapping is exercised."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _assert_logits_close(got, want):
    rel = (got - want).abs().max() / want.abs().max()
    assert rel <= 1e-4, rel.item()


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=False)
    return _perturb(transformers.LlamaForCausalLM(cfg)).eval()


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    return _perturb(transformers.GPT2LMHeadModel(cfg)).eval()


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama_gqa_untied", "gpt2"])
def test_hf_to_megacoat_and_back(tmp_path, make):
    hf = make()
    hf.save_pretrained(tmp_path / "hf")
    want = _hf_logits(hf, _tokens())
    for tp, pp in ((1, 1), (2, 1), (2, 2)):
        ckpt = str(tmp_path / (f"mc_tp{tp}" if pp == 1 else f"mc_tp{tp}_pp{pp}"))
        assert convert("--load-format", "hf", "--load-dir", str(tmp_path / "hf"), "--save-format", "megacoat",
                       "--save-dir", ckpt, "--target-tensor-parallel-size", str(tp),
                       "--target-pipeline-parallel-size", str(pp)) == 0
        model = megacoat.load_model(ckpt, dtype=torch.float32)
        with torch.no_grad():
            _assert_logits_close(model(_tokens()), want)
    assert convert("--load-format", "hf", "--load-dir", str(tmp_path / "hf"), "--save-format", "megacoat",
                   "--save-dir", str(tmp_path / "bad"), "--target-pipeline-parallel-size", "3") == 2  # 2 layers
    assert convert("--load-format", "megacoat", "--load-dir", str(tmp_path / "mc_tp2"), "--save-format", "hf",
                   "--save-dir", str(tmp_path / "hf2")) == 0
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    _assert_logits_close(_hf_logits(back, _tokens()), want)


def test_existing_targets_need_force(tmp_path, capsys):
    """A directory that holds a model or checkpoint is refused without --force; forced, an old sharded
    model's index and shards go, so Hugging Face loads the new weights."""
    hf = llama()
    hf.save_pretrained(tmp_path / "hf")
    mc, out = str(tmp_path / "mc"), tmp_path / "out"
    to_megacoat = ["--load-format", "hf", "--load-dir", str(tmp_path / "hf"), "--save-format", "megacoat",
                   "--save-dir", mc]
    assert convert(*to_megacoat) == 0
    assert convert(*to_megacoat) == 2 and "--force" in capsys.readouterr().err
    assert convert(*to_megacoat, "--force") == 0  # the same iteration (0): replaced
    gpt2().save_pretrained(out, max_shard_size="100KB")  # another model, sharded: index + shards
    assert (out / "model.safetensors.index.json").exists()
    capsys.readouterr()
    to_hf = ["--load-format", "megacoat", "--load-dir", mc, "--save-format", "hf", "--save-dir", str(out)]
    assert convert(*to_hf) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(out) in err and "--force" in err and "config.json" in err
    assert convert(*to_hf, "--force") == 0
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    _assert_logits_close(_hf_logits(back, _tokens()), _hf_logits(hf, _tokens()))


def test_megacoat_trained_checkpoint_to_hf(tmp_path):
    from test_checkpoint_resume import train
    save = str(tmp_path / "ckpt")
    train(["--train-iters", "2", "--save", save, "--group-query-attention", "--num-query-groups", "2",
           "--untie-embeddings-and-output-weights", "--vocab-size", str(VOCAB)])
    assert convert("--load-format", "megacoat", "--load-dir", save, "--save-format", "hf",
                   "--save-dir", str(tmp_path / "hf")) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        _assert_logits_close(_hf_logits(hf, _tokens()), megacoat.load_model(save)(_tokens()))


def test_unsupported_features_are_refused(tmp_path, capsys):
    hf = llama()
    hf.config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    hf.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    hf.save_pretrained(tmp_path / "hf")
    assert convert("--load-format", "hf", "--load-dir", str(tmp_path / "hf"), "--save-format", "megacoat",
                   "--save-dir", str(tmp_path / "out")) == 2
    assert "not supported" in capsys.readouterr().err
    from megacoat.convert.hf import family_of_megacoat
    from megacoat.config import ModelConfig, resolve_model_defaults
    m = ModelConfig(normalization="LayerNorm")  # SwiGLU + RoPE + LayerNorm: neither Llama nor GPT-2
    resolve_model_defaults(m)
    with pytest.raises(CheckpointError, match="no Hugging Face architecture"):
        family_of_megacoat(m)
    assert convert("--load-format", "hf", "--load-dir", str(tmp_path / "nope"), "--save-format", "megacoat",
                   "--save-dir", str(tmp_path / "out")) == 2



def test_a_sentencepiece_tokenizer_comes_back_from_hugging_face(tmp_path, capsys):
    """The export writes a SentencePiece tokenizer as tokenizer.model (no tokenizer.json); importing such a
    directory left the tokenizer behind (a checkpoint that took token ids only). It is kept, both ways."""
    import random
    import shutil

    from megacoat.checkpoint.model_io import load_tokenizer
    from megacoat.data.tokenizer_training import train_sentencepiece
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "class", "return"]
    docs = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(200)]
    sp = str(tmp_path / "sp.model")
    train_sentencepiece(docs, sp, vocab_size=120, byte_fallback=False, num_threads=1)
    llama().save_pretrained(tmp_path / "hf")
    shutil.copyfile(sp, tmp_path / "hf" / "tokenizer.model")
    mc = str(tmp_path / "mc")
    assert convert("--load-format", "hf", "--load-dir", str(tmp_path / "hf"), "--save-format", "megacoat",
                   "--save-dir", mc) == 0
    tok, want = load_tokenizer(mc), load_tokenizer_of_file(sp)
    assert type(tok).__name__ == "GPTSentencePieceTokenizer" and tok.eod == want.eod == 2
    assert tok.tokenize(docs[0]) == want.tokenize(docs[0]) and tok.detokenize(tok.tokenize(docs[1])) == docs[1]
    assert convert("--load-format", "megacoat", "--load-dir", mc, "--save-format", "hf",
                   "--save-dir", str(tmp_path / "hf2")) == 0
    assert (tmp_path / "hf2" / "tokenizer.model").read_bytes() == (tmp_path / "hf" / "tokenizer.model").read_bytes()
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"not a SentencePiece model")  # refused, not dropped
    capsys.readouterr()
    assert convert("--load-format", "hf", "--load-dir", str(tmp_path / "hf"), "--save-format", "megacoat",
                   "--save-dir", str(tmp_path / "bad")) == 2
    assert "convert a copy without tokenizer.model" in capsys.readouterr().err
    assert not list(tmp_path.glob("bad/iter_*"))


def load_tokenizer_of_file(model_file):
    from megacoat.data.tokenizer import build_tokenizer_by_type
    return build_tokenizer_by_type("GPTSentencePieceTokenizer", model_file)
