"""Megatron's tokenizers in megacoat: GPT2BPETokenizer (--vocab-file/--merge-file) and
HuggingFaceTokenizer (--tokenizer-model DIR), in preprocessing, training and tools/generate.py."""
import json
import os
import shutil
import random
import runpy

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from megacoat.data.tokenizer import GPT2BPETokenizer, TokenizerError, build_tokenizer_by_type  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world, it's a test.", "  leading spaces and trailing  ", "numbers 12345 and 3.14159!",
         "naïve café — ünïcödé ✓ 日本語", "they'll we've I'm you're", "tabs\tand\nnewlines\n\n", "<|endoftext|> inside",
         "def f(x):\n    return x ** 2  # comment"]


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--fp32", "--num-workers", "0", "--attention-dropout",
        "0", "--hidden-dropout", "0", "--eval-interval", "0", "--eval-iters", "0", "--log-interval", "1",
        "--make-vocab-size-divisible-by", "8", "--seed", "5", "--split", "100,0,0"]


def train(args):
    """Pretrain in this process (world 1) on real data; returns (losses, trainer)."""
    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer
    trainer = Trainer(parse_args(BASE + args), log_stream=open(os.devnull, "w"))
    losses = []
    trainer.train(on_step=lambda t, rec: losses.append(rec.loss))
    return losses, trainer


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A small GPT-2 style byte-level BPE (vocab.json + merges.txt) trained here."""
    from tokenizers import ByteLevelBPETokenizer
    d = tmp_path_factory.mktemp("gpt2bpe")
    rng = random.Random(0)
    words = ["the", "model", "train", "token", "data", "Megatron", "coat", "ing", "er", "s", "café", "123"]
    corpus = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(300)] + TEXTS
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    tok.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


def test_gpt2bpe_matches_transformers_gpt2_tokenizer(gpt2_files):
    """Ids equal transformers' slow (pure Python) GPT2Tokenizer, the reference Megatron's copy follows."""
    from transformers import GPT2Tokenizer
    vocab, merges = gpt2_files
    ref = GPT2Tokenizer(vocab, merges)
    ours = GPT2BPETokenizer(vocab, merges)
    rng = random.Random(1)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABC'.,!?\n\t0123456789éü日✓-_"
    randoms = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(50)]
    for text in TEXTS + randoms:
        ids = ours.tokenize(text)
        if "<|endoftext|>" not in text:  # transformers splits added tokens out of text; see below
            assert ids == ref.convert_tokens_to_ids(ref.tokenize(text)), text
        assert ours.detokenize(ids) == text
    assert ours.vocab_size == len(json.load(open(vocab)))
    assert ours.eod == json.load(open(vocab))["<|endoftext|>"]
    # As Megatron's own GPT-2 BPE (gpt2_tokenization.py), the special token is not special inside text.
    assert ours.eod not in ours.tokenize("<|endoftext|>")


def test_gpt2bpe_bad_flags(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    with pytest.raises(TokenizerError, match="--merge-file"):
        build_tokenizer_by_type("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(TokenizerError, match="file not found"):
        build_tokenizer_by_type("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "nope.txt"))
    no_eod = tmp_path / "vocab.json"
    v = json.load(open(vocab))
    v.pop("<|endoftext|>")
    no_eod.write_text(json.dumps(v))
    with pytest.raises(TokenizerError, match="<\\|endoftext\\|>"):
        GPT2BPETokenizer(str(no_eod), merges)


def test_preprocess_train_generate_with_gpt2bpe(gpt2_files, tmp_path, capsys):
    """tools/preprocess_data.py -> pretraining -> tools/generate.py, all with --vocab-file/--merge-file."""
    from megacoat.data.indexed_dataset import IndexedDataset
    vocab, merges = gpt2_files
    docs = [f"the model {i} trains on token data with Megatron coat" * 3 for i in range(40)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    pre = runpy.run_path(os.path.join(ROOT, "tools", "preprocess_data.py"), run_name="pre")
    prefix = str(tmp_path / "gpt2")
    assert pre["main"](["--input", str(tmp_path / "c.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                        "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
                        "--no-progress-bar"]) == 0
    tok = GPT2BPETokenizer(vocab, merges)
    ds = IndexedDataset(prefix + "_text_document")
    assert len(ds) == len(docs)
    for i in (0, 17, 39):
        assert np.asarray(ds[i]).tolist() == tok.tokenize(docs[i]) + [tok.eod]

    save = str(tmp_path / "ckpt")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    losses, trainer = train(["--train-iters", "2", "--save", save, "--data-path", prefix + "_text_document",
                             "--data-cache-path", str(tmp_path / "cache")] + flags)
    assert len(losses) == 2 and trainer.model.vocab_size == tok.vocab_size
    copied = os.listdir(os.path.join(save, "iter_0000002", "tokenizer"))
    assert "vocab.json" in copied and "merges.txt" in copied
    gen = runpy.run_path(os.path.join(ROOT, "tools", "generate.py"), run_name="gen")
    capsys.readouterr()
    assert gen["main"](["--load", save, "--prompt", "the model", "--max-new-tokens", "3", "--greedy"]) == 0
    from_ckpt = capsys.readouterr().out
    assert from_ckpt.startswith("the model")
    assert gen["main"](["--load", save, "--prompt", "the model", "--max-new-tokens", "3", "--greedy"] + flags) == 0
    assert capsys.readouterr().out == from_ckpt
    # A resharded copy carries the tokenizer: it generates the same text once the source is gone.
    convert = runpy.run_path(os.path.join(ROOT, "tools", "checkpoint", "convert.py"), run_name="convert")
    copy = str(tmp_path / "tp2")
    assert convert["main"](["--load-format", "megacoat", "--load-dir", save, "--save-format", "megacoat",
                            "--save-dir", copy, "--target-tensor-parallel-size", "2"]) == 0
    shutil.rmtree(os.path.join(save, "iter_0000002", "tokenizer"))
    capsys.readouterr()
    assert gen["main"](["--load", copy, "--prompt", "the model", "--max-new-tokens", "3", "--greedy"]) == 0
    assert capsys.readouterr().out == from_ckpt
    from megacoat.checkpoint.reader import CheckpointReader
    data = CheckpointReader(os.path.join(copy, "iter_0000000")).config["data"]
    assert data["tokenizer_type"] == "GPT2BPETokenizer" and data["vocab_file"].startswith(os.path.abspath(copy))
    # A checkpoint that records no tokenizer falls back to the default one, larger than this model: refused.
    from megacoat.checkpoint.format import METADATA_FILE, write_json_atomic
    it = os.path.join(copy, "iter_0000000")
    meta = CheckpointReader(it).meta
    del meta["extra"]["tokenizer"]
    meta["config"]["data"] = {}
    write_json_atomic(os.path.join(it, METADATA_FILE), meta)
    capsys.readouterr()
    assert gen["main"](["--load", copy, "--prompt", "the model", "--max-new-tokens", "3", "--greedy"]) == 2
    assert "pass the --tokenizer-* flags" in capsys.readouterr().err
    # A tokenizer with a larger vocabulary than the model is refused, not run past the embedding.
    assert gen["main"](["--load", save, "--prompt", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        "100000"]) == 2


def test_huggingface_tokenizer_directory_in_training(tmp_path, capsys):
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR: a local tokenizer.json directory, in
    preprocessing, training and tools/generate.py (given on the command line and from the checkpoint's copy)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([f"alpha beta gamma {i} delta" for i in range(100)],
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    d = tmp_path / "hf"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    ours = build_tokenizer_by_type("HuggingFaceTokenizer", str(d))
    assert ours.eod == tok.token_to_id("</s>") and ours.tokenize("alpha beta 7") == tok.encode("alpha beta 7").ids
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": f"alpha beta gamma {i} delta " * 8})
                                                for i in range(30)))
    pre = runpy.run_path(os.path.join(ROOT, "tools", "preprocess_data.py"), run_name="pre")
    prefix = str(tmp_path / "hfdata")
    assert pre["main"](["--input", str(tmp_path / "c.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                        "HuggingFaceTokenizer", "--tokenizer-model", str(d), "--append-eod", "--no-progress-bar"]) == 0
    save = str(tmp_path / "ckpt")
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d)]
    losses, trainer = train(["--train-iters", "1", "--save", save, "--data-path", prefix + "_text_document",
                             "--data-cache-path", str(tmp_path / "cache")] + flags)
    assert len(losses) == 1 and trainer.model.vocab_size == tok.get_vocab_size()
    gen = runpy.run_path(os.path.join(ROOT, "tools", "generate.py"), run_name="gen")
    outs = []
    for extra in ([], flags):
        capsys.readouterr()
        assert gen["main"](["--load", save, "--prompt", "alpha beta", "--max-new-tokens", "3", "--greedy"] + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("alpha beta")


@pytest.mark.parametrize("lossless", [True, False], ids=["no-dummy-prefix", "dummy-prefix"])
def test_sentencepiece_tokenizer_exports_for_autotokenizer(tmp_path, capsys, lossless):
    """A model trained with a SentencePiece tokenizer (the default corpus' kind) exports a tokenizer that
    AutoTokenizer loads and that encodes and decodes as megacoat does; config.json names its eos."""
    import inspect

    transformers = pytest.importorskip("transformers")
    from megacoat.data.tokenizer_training import train_sentencepiece
    text = inspect.getsource(json) + inspect.getsource(os)  # Python source: indentation, newlines, quotes
    model = train_sentencepiece(text.split("\n\n"), str(tmp_path / "sp" / "tokenizer.model"), vocab_size=400,
                                lossless=lossless)
    ours = build_tokenizer_by_type("GPTSentencePieceTokenizer", model)
    lines = [json.dumps({"text": chunk}) for chunk in text.split("\n\n")[:200] if chunk.strip()]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    pre = runpy.run_path(os.path.join(ROOT, "tools", "preprocess_data.py"), run_name="pre")
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    assert pre["main"](["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "d"),
                        "--append-eod", "--no-progress-bar"] + flags) == 0
    save, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    train(["--train-iters", "1", "--save", save, "--data-path", str(tmp_path / "d_text_document"),
           "--data-cache-path", str(tmp_path / "cache")] + flags)
    (tmp_path / "hf").mkdir()
    (out / "tokenizer.json").write_text("{}")  # an older export's tokenizer: replaced under --force
    (out / "config.json").write_text("{}")
    convert = runpy.run_path(os.path.join(ROOT, "tools", "checkpoint", "convert.py"), run_name="convert")
    assert convert["main"](["--load-format", "megacoat", "--load-dir", save, "--save-format", "hf", "--save-dir",
                            str(out), "--force"]) == 0
    assert not (out / "tokenizer.json").exists()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    samples = ["def f(x):\n    return x  + 1\n", "  two leading spaces", "tabs\tand\n\n\nnewlines",
               "ünïcödé 中文 🙂", text[:3000], text[-3000:]]
    normalizing = "normalizes text" in capsys.readouterr().out
    assert normalizing == (not lossless)
    if normalizing:  # exact where normalization changes nothing: single spaces, plain ASCII
        samples = ["def f(x): return x + 1", "the model trains on token data", " leading space"]
    for s in samples:
        ids = ours.tokenize(s)
        assert hf_tok.encode(s, add_special_tokens=False) == ids, s[:40]
        assert hf_tok.decode(ids) == ours.detokenize(ids), s[:40]
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == ours.eod == hf_tok.eos_token_id and config["bos_token_id"] == ours.bos
