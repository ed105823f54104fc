"""Tokenizers with Megatron's interface: vocab_size, eod, tokenize(str), detokenize(ids).

- SentencePieceTokenizer: Megatron's wrapper. Adds <CLS>, <SEP>, <EOD>, <MASK> (and pad/bos/eos
  pieces when the model lacks them) after the model's vocabulary; eod is <EOD>. Special-token
  strings inside text are mapped to their ids.
- GPTSentencePieceTokenizer: the model's vocabulary as is; eod is the model's eos id.
- HuggingFaceTokenizer: a `tokenizer.json` (or a directory holding one) through the
  `tokenizers` package; eod is the eos token of tokenizer_config.json, else a well-known one.
- GPT2BPETokenizer: Megatron's GPT-2 byte-level BPE from `--vocab-file` (vocab.json) and
  `--merge-file` (merges.txt), through the `tokenizers` package; eod is `<|endoftext|>`.
- NullTokenizer: text is space-separated ids; vocab_size is --vocab-size + 1 and eod is
  --vocab-size (Megatron's convention).
The default corpus uses GPTSentencePieceTokenizer semantics on its own model.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given flags or files."""


class SentencePieceTokenizer:
    def __init__(self, model_file: str):
        self.model_file = model_file
        self._sp = _load_sentencepiece(model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        self._inv_vocab = {i: p for p, i in self._vocab.items()}
        self._special = {}

        def add_special(piece: str) -> int:
            if piece not in self._vocab:
                new_id = len(self._vocab)
                self._vocab[piece] = new_id
                self._inv_vocab[new_id] = piece
            self._special[piece] = self._vocab[piece]
            return self._vocab[piece]

        self.cls = add_special("<CLS>")
        self.sep = add_special("<SEP>")
        self.eod = add_special("<EOD>")
        self.mask = add_special("<MASK>")
        self.pad = add_special(self._piece_or(self._sp.pad_id(), "<PAD>"))
        self.bos = add_special(self._piece_or(self._sp.bos_id(), "<BOS>"))
        self.eos = add_special(self._piece_or(self._sp.eos_id(), "<EOS>"))
        self._inv_special = {i: p for p, i in self._special.items()}

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < self._sp.get_piece_size() else fallback

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        pos = 0
        while True:
            hits = [(text.find(p, pos), p) for p in self._special]
            hits = [(i, p) for i, p in hits if i >= 0]
            if not hits:
                break
            at, piece = min(hits)
            ids.extend(self._sp.encode_as_ids(text[pos:at]))
            ids.append(self._special[piece])
            pos = at + len(piece)
        ids.extend(self._sp.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids: List[int]) -> str:
        text, start = "", 0
        ids = [int(i) for i in ids]
        for k, i in enumerate(ids):
            if i in self._inv_special:
                text += self._sp.decode_ids(ids[start:k]) + " " + self._inv_special[i] + " "
                start = k + 1
        return text + self._sp.decode_ids(ids[start:])


class GPTSentencePieceTokenizer:
    def __init__(self, model_file: str):
        self.model_file = model_file
        self._sp = _load_sentencepiece(model_file)
        self.eos = self._sp.eos_id()
        self.bos = self._sp.bos_id()
        self.pad = self._sp.pad_id()
        if self.eos < 0:
            raise TokenizerError(
                f"--tokenizer-model {model_file}: the SentencePiece model has no eos piece, which "
                "GPTSentencePieceTokenizer uses as end of document; use --tokenizer-type SentencePieceTokenizer "
                "(adds <EOD>) or retrain with tools/train_tokenizer.py")
        self.eod = self.eos

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode_as_ids(text)

    def tokenize_batch(self, texts: List[str], num_threads: int = -1) -> List[List[int]]:
        """Many texts at once; num_threads=-1 uses every core (set 1 inside worker processes)."""
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def detokenize(self, ids: List[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])


class _TokenizersLibraryMethods:
    """The tokenizer interface over a `tokenizers.Tokenizer` held in `self._tok` (no special tokens added)."""

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: List[str], num_threads: int = -1) -> List[List[int]]:
        # `tokenizers` sizes its own thread pool (RAYON_NUM_THREADS); num_threads is accepted for symmetry.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: List[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_TokenizersLibraryMethods):
    _EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package: pip install tokenizers") from e
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(json_path):
            raise TokenizerError(f"--tokenizer-model {path}: no tokenizer.json found")
        try:
            self._tok = Tokenizer.from_file(json_path)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise TokenizerError(f"--tokenizer-model {json_path}: not a valid HuggingFace tokenizer.json ({e})") from e
        self.model_file = json_path
        self.eod = self._find_eos(directory)
        self.eos = self.eod
        self.bos = self._id_of_config_token(directory, "bos_token")
        self.pad = self._id_of_config_token(directory, "pad_token")

    def _config_token(self, directory: str, key: str) -> Optional[str]:
        cfg = os.path.join(directory, "tokenizer_config.json")
        if not os.path.isfile(cfg):
            return None
        with open(cfg) as f:
            value = json.load(f).get(key)
        return value.get("content") if isinstance(value, dict) else value

    def _id_of_config_token(self, directory: str, key: str) -> Optional[int]:
        tok = self._config_token(directory, key)
        return self._tok.token_to_id(tok) if tok else None

    def _find_eos(self, directory: str) -> int:
        candidates = [self._config_token(directory, "eos_token")] + list(self._EOS_CANDIDATES)
        for tok in candidates:
            if tok and self._tok.token_to_id(tok) is not None:
                return self._tok.token_to_id(tok)
        raise TokenizerError(
            f"--tokenizer-model {self.model_file}: cannot find an end-of-document token (looked for the eos_token "
            f"of tokenizer_config.json and {', '.join(self._EOS_CANDIDATES)})")



class GPT2BPETokenizer(_TokenizersLibraryMethods):
    """GPT-2's byte-level BPE (Megatron's GPT2BPETokenizer): vocab.json + merges.txt, no special handling
    of `<|endoftext|>` inside text (as Megatron's), which is the end-of-document id."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise TokenizerError(f"--tokenizer-type GPT2BPETokenizer needs {flag} PATH (GPT-2's vocab.json and "
                                     "merges.txt)")
            if not os.path.isfile(path):
                raise TokenizerError(f"{flag} {path}: file not found")
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError as e:
            raise TokenizerError("GPT2BPETokenizer needs the `tokenizers` package: pip install tokenizers") from e
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE ({e})") from e
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.model_file, self.merge_file = vocab_file, merge_file
        self.companion_files = (merge_file,)  # copied into checkpoints beside model_file
        self.eod = self._tok.token_to_id(self.EOD_TOKEN)
        if self.eod is None:
            raise TokenizerError(f"--vocab-file {vocab_file} has no {self.EOD_TOKEN} token (GPT-2's end of document)")
        self.eos, self.bos, self.pad = self.eod, None, None



class NullTokenizer:
    """Pre-tokenized text ("12 7 9"); ids 0..vocab_size-1 plus eod = vocab_size."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError("NullTokenizer needs --vocab-size N (token ids are 0..N-1, eod is N)")
        self._n = int(vocab_size)
        self.eod = self._n
        self.eos = self._n
        self.bos = None
        self.pad = None

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _load_sentencepiece(model_file: Optional[str]):
    if not model_file:
        raise TokenizerError("this --tokenizer-type needs --tokenizer-model PATH (a SentencePiece .model file)")
    if not os.path.isfile(model_file):
        raise TokenizerError(f"--tokenizer-model {model_file}: file not found")
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.load(model_file)
    except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError/RuntimeError variously
        raise TokenizerError(f"--tokenizer-model {model_file}: not a valid SentencePiece model ({e})") from e
    return sp


TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "NullTokenizer")


# The flags each tokenizer type reads; the others would be ignored.
_TOKENIZER_FLAGS = {"GPT2BPETokenizer": ("--vocab-file", "--merge-file"), "NullTokenizer": ("--vocab-size",)}


def unused_tokenizer_flags(tokenizer_type: Optional[str], **given) -> List[str]:
    """The flags in `given` (tokenizer_model=..., vocab_size=..., vocab_file=..., merge_file=...; None: not given)
    that `tokenizer_type` does not read (None: no type given, so none is read)."""
    reads = () if tokenizer_type is None else _TOKENIZER_FLAGS.get(tokenizer_type, ("--tokenizer-model",))
    flags = ["--" + k.replace("_", "-") for k, v in given.items() if v is not None]
    return [f for f in flags if f not in reads]


def build_tokenizer_by_type(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                            vocab_size: Optional[int] = None, vocab_file: Optional[str] = None,
                            merge_file: Optional[str] = None):
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH "
                                 "(a tokenizer.json or a directory holding one)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N")
        return NullTokenizer(vocab_size)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


def check_vocab_size(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """The model's (padded) embedding must cover every id the tokenizer produces."""
    if model_vocab_size < tokenizer_vocab_size:
        raise TokenizerError(
            f"the model's vocabulary ({model_vocab_size}) is smaller than the tokenizer's ({tokenizer_vocab_size}); "
            "token ids would index past the embedding. Use the tokenizer the data was made with, or a larger "
            "--vocab-size / --make-vocab-size-divisible-by")
