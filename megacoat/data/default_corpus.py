"""The built-in corpus: the Python standard library's own source, so training works with no data.

One document per `.py` file of the running interpreter's stdlib (sorted; test suites,
site-packages and caches skipped). At first use a SentencePiece BPE model (8000 pieces,
byte fallback, lossless) is trained on it and the corpus is written as a Megatron dataset,
both cached under `{cache}/default_corpus/py{major}{minor}-{hash of the file list}/`. The
directory is built under a lock and published by rename, so ranks starting together build it
once and never see it half-written.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import List, Optional

from megacoat.data.file_lock import exclusive_lock
from megacoat.data.indexed_dataset import dataset_exists
from megacoat.data.preprocessing import preprocess
from megacoat.data.tokenizer_training import train_sentencepiece

DEFAULT_VOCAB_SIZE = 8000
CORPUS_FORMAT_VERSION = 1  # bump when the recipe changes
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class DefaultCorpus:
    directory: str
    tokenizer_model: str
    data_prefix: str


def default_cache_dir(cache_dir: Optional[str]) -> str:
    return os.path.abspath(os.path.expanduser(cache_dir or os.path.join("~", ".cache", "megacoat")))


def stdlib_source_files(root: Optional[str] = None) -> List[str]:
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    if not files:
        raise RuntimeError(f"no .py files found under the standard library at {root}; pass --data-path")
    return files


def _corpus_key(files: List[str]) -> str:
    h = hashlib.sha256(f"v{CORPUS_FORMAT_VERSION}".encode())
    for f in files:
        h.update(f"{f}\0{os.path.getsize(f)}\n".encode())
    return f"py{sys.version_info.major}{sys.version_info.minor}-{h.hexdigest()[:16]}"


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def prepare_default_corpus(cache_dir: Optional[str] = None, log=None, progress: bool = True) -> DefaultCorpus:
    """The cached tokenizer and dataset of the default corpus, built on first use (~10 s).

    `log(msg)` hears what is being built; `progress` shows a progress bar (stderr) while tokenizing."""
    files = stdlib_source_files()
    base = os.path.join(default_cache_dir(cache_dir), "default_corpus")
    final = os.path.join(base, _corpus_key(files))
    corpus = DefaultCorpus(final, os.path.join(final, "tokenizer.model"), os.path.join(final, "stdlib_text_document"))
    if os.path.isdir(final):
        return corpus
    say = log or (lambda msg: None)
    # First use takes ~10 s of silent work otherwise: say what is happening before waiting or building.
    say(f"preparing the default corpus (first use): a {DEFAULT_VOCAB_SIZE}-piece SentencePiece tokenizer trained "
        f"on {len(files)} standard-library files, then the files tokenized; cached under {final}")
    with exclusive_lock(final + ".lock"):
        if os.path.isdir(final):  # another process built it while we waited
            say("the default corpus was prepared by another process")
            return corpus
        t0 = time.perf_counter()
        staging = f"{final}.tmp{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            say("default corpus: training the tokenizer ...")
            model = train_sentencepiece((_read_text(f) for f in files), os.path.join(staging, "tokenizer.model"),
                                        vocab_size=DEFAULT_VOCAB_SIZE, num_threads=2)
            say(f"default corpus: tokenizer trained in {time.perf_counter() - t0:.1f}s; tokenizing ...")
            preprocess(files, "", "GPTSentencePieceTokenizer", model, input_format="text-files",
                       json_keys=("text",), append_eod=True, workers=1, progress=progress,
                       output_names={"text": os.path.join(staging, "stdlib_text_document")})
            with open(os.path.join(staging, "SOURCES.txt"), "w") as f:
                f.write(f"Python {sys.version}\n" + "\n".join(files) + "\n")
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if log:
            log(f"prepared the default corpus ({len(files)} stdlib files) in {time.perf_counter() - t0:.1f}s "
                f"under {final}")
    assert dataset_exists(corpus.data_prefix)
    return corpus
