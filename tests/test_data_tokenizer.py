"""Tokenizer layer: SentencePiece (Megatron and GPT flavours), HuggingFace, Null, clear errors."""
import json

import pytest

from megacoat.config import DataConfig
from megacoat.data import build_tokenizer
from megacoat.data.tokenizer import (GPTSentencePieceTokenizer, NullTokenizer, SentencePieceTokenizer, TokenizerError,
                                     check_vocab_size)
from megacoat.data.tokenizer_training import train_sentencepiece

TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. 12345",
        "class Foo:\n    pass\n", "import os\nprint(os.getcwd())\n", "Ünïcödé and emoji \U0001F600 text\n"] * 20


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(TEXT, str(tmp_path_factory.mktemp("sp") / "tok.model"), vocab_size=400,
                               num_threads=1)


def test_gpt_sentencepiece_is_lossless_with_eos_as_eod(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model))
    assert isinstance(tok, GPTSentencePieceTokenizer)
    assert tok.eod == tok.eos == 2 and tok.bos == 1 and tok.pad == 3
    assert tok.vocab_size <= 400
    for t in set(TEXT) | {"  leading spaces\n\n\ttabs\r\n", "never seen: ∮ ψ 漢字"}:
        ids = tok.tokenize(t)
        assert max(ids) < tok.vocab_size
        assert tok.detokenize(ids) == t


def test_megatron_sentencepiece_adds_special_tokens(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    base = tok._sp.get_piece_size()
    # <CLS>, <SEP>, <EOD>, <MASK> are appended; pad/bos/eos exist in the model already.
    assert (tok.cls, tok.sep, tok.eod, tok.mask) == (base, base + 1, base + 2, base + 3)
    assert tok.vocab_size == base + 4
    assert (tok.pad, tok.bos, tok.eos) == (3, 1, 2)
    ids = tok.tokenize("a<EOD>b")
    assert tok.eod in ids and ids[0] != tok.eod
    assert "<EOD>" in tok.detokenize(ids)


def test_null_tokenizer():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("1 2  33") == [1, 2, 33] and tok.detokenize([4, 5]) == "4 5"


def test_mock_data_tokenizer():
    tok = build_tokenizer(DataConfig(mock_data=True))
    assert tok.vocab_size == 32000 and tok.eod == 31999
    assert build_tokenizer(DataConfig(mock_data=True, vocab_size=500)).vocab_size == 500


@pytest.mark.parametrize("cfg, message", [
    (dict(tokenizer_type="GPTSentencePieceTokenizer"), "--tokenizer-model"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nonexistent.model"), "not found"),
    (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model"),
    (dict(data_path=["some/prefix"]), "--tokenizer-type"),
])
def test_clear_errors(cfg, message):
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer(DataConfig(**cfg))


def test_bad_model_file(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(TokenizerError, match="not a valid SentencePiece model"):
        build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(bad)))


def test_vocab_size_check():
    check_vocab_size(8000, 8064)
    with pytest.raises(TokenizerError, match="smaller than the tokenizer"):
        check_vocab_size(8000, 7999)


def test_huggingface_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers, decoders

    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert tok.eod == tk.token_to_id("<|endoftext|>")
    assert tok.detokenize(tok.tokenize(TEXT[0])) == TEXT[0]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    assert build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                      tokenizer_model=str(tmp_path / "tokenizer.json"))).eod == 0
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a valid HuggingFace"):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "junk.json")))
