"""Train a SentencePiece model from documents (used by tools/train_tokenizer.py and the default corpus).

Defaults are lossless for any text, code included: no normalization, whitespace kept as is,
no dummy prefix, byte fallback for characters outside the vocabulary (newlines become byte
tokens), so detokenize(tokenize(text)) == text. Ids: unk 0, bos 1, eos 2 (the end-of-document
token), pad 3.
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from megacoat.data.preprocessing import make_parent_directory

MAX_SENTENCE_BYTES = 16384


@dataclass
class SentenceCounts:
    kept: int = 0
    too_long: int = 0  # non-blank lines left out: longer than SentencePiece's sentence limit


def sentences_within_budget(documents: Iterable[str], byte_budget: Optional[int],
                            counts: Optional[SentenceCounts] = None) -> Iterator[str]:
    """Non-blank lines of the documents, stopping after about byte_budget bytes of text."""
    counts = counts if counts is not None else SentenceCounts()
    used = 0
    for doc in documents:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            n = len(line.encode("utf-8", errors="replace"))
            if n > MAX_SENTENCE_BYTES:
                counts.too_long += 1
                continue
            counts.kept += 1
            yield line
            used += n
            if byte_budget is not None and used >= byte_budget:
                return


def check_options(vocab_size: int, character_coverage: float, num_threads: int, byte_budget: Optional[int]) -> None:
    """ValueError naming the flag of tools/train_tokenizer.py outside SentencePiece's range (its own message
    names an internal check), before any text is read."""
    if vocab_size < 1:
        raise ValueError(f"--vocab-size {vocab_size} must be >= 1 (the pieces of the model, e.g. 32000)")
    if not 0.98 <= character_coverage <= 1.0:
        raise ValueError(f"--character-coverage {character_coverage} must be in [0.98, 1] (SentencePiece's range: "
                         "the share of characters kept as pieces)")
    if not 1 <= num_threads <= 1024:
        raise ValueError(f"--threads {num_threads} must be in [1, 1024]")
    if byte_budget is not None and byte_budget < 1:
        raise ValueError(f"--max-input-bytes {byte_budget} must be >= 1")


def train_sentencepiece(documents: Iterable[str], output_model: str, vocab_size: int = 8000,
                        model_type: str = "bpe", character_coverage: float = 0.9999, byte_fallback: bool = True,
                        byte_budget: Optional[int] = 32 << 20, num_threads: int = 2, lossless: bool = True,
                        split_digits: bool = True) -> str:
    """Train and write `output_model` (a .model file, written atomically); returns its path."""
    check_options(vocab_size, character_coverage, num_threads, byte_budget)
    if not os.path.basename(output_model) or os.path.isdir(output_model):  # before the training, not after it
        raise ValueError(f"--output-model {output_model} is a directory: name the file, e.g. "
                         f"{os.path.join(output_model, 'tokenizer.model')}")
    make_parent_directory(output_model, "--output-model")
    import sentencepiece as spm

    options = dict(
        model_type=model_type, vocab_size=vocab_size, character_coverage=character_coverage,
        byte_fallback=byte_fallback, num_threads=num_threads, split_digits=split_digits,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, max_sentence_length=MAX_SENTENCE_BYTES,
        minloglevel=2, hard_vocab_limit=False,
    )
    if lossless:
        options.update(normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
                       allow_whitespace_only_pieces=True)
    proto = io.BytesIO()
    counts = SentenceCounts()
    raised = []

    def sentences():
        try:
            yield from sentences_within_budget(documents, byte_budget, counts)
        except BaseException as e:
            # A bad line, Ctrl-C: SentencePiece turns it into a RuntimeError with a Python stack in its text;
            # kept to be raised as itself.
            raised.append(e)
            raise

    try:
        spm.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=proto, **options)
    except RuntimeError as e:
        if raised:
            raise raised[0] from None
        raise RuntimeError(_training_failure(str(e), counts, vocab_size, byte_fallback)) from e
    tmp = f"{output_model}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(proto.getvalue())
        os.replace(tmp, output_model)
    finally:
        if os.path.exists(tmp):  # a failed write or rename leaves no partial model behind
            os.remove(tmp)
    return output_model


def _training_failure(message: str, counts: SentenceCounts, vocab_size: int, byte_fallback: bool) -> str:
    """SentencePiece's failure in the user's terms: no text at all, or too small a vocabulary for the text."""
    if not counts.kept:
        if counts.too_long:
            return (f"no text to train on: all {counts.too_long} non-blank line(s) are longer than "
                    f"{MAX_SENTENCE_BYTES} bytes, SentencePiece's sentence limit (split the text into lines)")
        return "no text to train on: the input holds no non-blank line (check --input, --json-keys, --input-format)"
    needed = re.search(r"required_chars.*?(\d+) vs (\d+)", message)
    if needed:
        return (f"--vocab-size {vocab_size} is too small for this text: it needs at least {needed.group(2)} pieces "
                f"(one per character{', 256 byte pieces' if byte_fallback else ''} and 4 special ones)")
    return f"SentencePiece training failed: {message}"
