"""Raw text -> Megatron `.bin/.idx`: streaming input readers and a parallel, order-keeping encoder.

Inputs are read as records (path, line number, raw text) by the main process; parsing and
tokenizing happen in worker processes on batches; results come back in input order and are
written by the main process. At most a few batches per worker are in flight, so memory stays
flat however large the input is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megacoat.data.indexed_dataset import INDEX_MAGIC, IndexedDatasetBuilder, best_token_dtype
from megacoat.data.tokenizer import build_tokenizer_by_type

INPUT_FORMATS = ("auto", "jsonl", "text-lines", "text-files")


@dataclass(frozen=True)
class Record:
    path: str
    line: int          # 1-based line number; 0 for a whole file
    raw: bytes
    file_bytes: int = 0  # bytes of the input file read up to the end of this record, since the previous one
                         # (compressed bytes for .gz: progress is measured against the files' sizes)


class BadInputError(ValueError):
    """A malformed input line (reported with file and line number)."""


# -- reading ---------------------------------------------------------------------------------

def expand_inputs(inputs: Sequence[str], suffixes: Optional[Sequence[str]] = None) -> List[str]:
    """Files named, plus the files under named directories (sorted, recursively). A tokenized dataset's file
    is refused: read as text it would be tokenized into the output (NUL and small-id bytes are valid UTF-8)."""
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, n) for n in sorted(names)
                          if suffixes is None or n.endswith(tuple(suffixes))]
            for f in found:
                if is_dataset_file(f):
                    raise BadInputError(f"--input {path} holds {f}, a tokenized dataset file, not text: pass "
                                        "--input-suffix to pick the text files, or move the dataset out")
            files += found
        elif os.path.isfile(path):
            if is_dataset_file(path):
                raise BadInputError(f"--input {path} is a tokenized dataset file (.bin/.idx), not text: pass the "
                                    "raw text it was made from")
            files.append(path)
        elif os.path.exists(path):
            raise BadInputError(f"--input {path} is neither a regular file nor a directory")
        else:
            raise FileNotFoundError(f"--input {path}: no such file or directory")
    seen: Dict[str, str] = {}
    for f in files:  # a file named twice (a glob and a directory over it) would be tokenized twice
        real = os.path.realpath(f)
        if real in seen:
            raise BadInputError(f"--input names {f} twice" + (f" (also as {seen[real]})" if seen[real] != f else "")
                                + ": give each file once")
        seen[real] = f
    return files


def is_dataset_file(path: str) -> bool:
    """A `.bin` or `.idx` of an indexed dataset (its `.idx` starts with the index magic), or a builder's
    temporary file of one (`.bin.tmp<pid>`, left by a killed run)."""
    if re.search(r"\.(bin|idx)\.tmp\d+$", path):
        return True
    if path.endswith(".bin"):
        path = path[:-len(".bin")] + ".idx"
    elif not path.endswith(".idx"):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(INDEX_MAGIC)) == INDEX_MAGIC
    except OSError:
        return False


def detect_format(path: str) -> str:
    return "jsonl" if path.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")) else "text-lines"


@contextlib.contextmanager
def _open(path: str):
    """(readable binary stream, position()): position() is how far into the file on disk reading has
    got, in compressed bytes for .gz files, so that progress adds up to the file's size."""
    with open(path, "rb") as raw:
        if path.endswith(".gz"):
            import gzip
            import zlib

            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                try:
                    yield f, raw.tell
                except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # raised while the caller reads
                    raise BadInputError(f"{path}: not a complete gzip file ({e}): recompress it, or leave it out "
                                        "of --input") from None
        else:
            yield raw, raw.tell


UTF8_BOM = b"\xef\xbb\xbf"


def read_records(files: Sequence[str], input_format: str) -> Iterator[Record]:
    """A file's UTF-8 byte-order mark (Windows editors write one) is left out: it is no text of the first
    document (and no JSON: json.loads refuses the first line)."""
    for path in files:
        fmt = detect_format(path) if input_format == "auto" else input_format
        if fmt == "text-files":
            with _open(path) as (f, _):
                yield Record(path, 0, f.read().removeprefix(UTF8_BOM), os.path.getsize(path))
            continue
        with _open(path) as (f, position):
            held, done = None, 0  # one record held back: the file's last one also carries its unread tail
            for lineno, line in enumerate(f, start=1):
                if lineno == 1:
                    line = line.removeprefix(UTF8_BOM)
                if fmt == "jsonl" and not line.strip():
                    continue  # blank lines in JSONL are not documents
                if held is not None:
                    yield held
                now = position()
                held = Record(path, lineno, line.rstrip(b"\r\n") if fmt == "text-lines" else line, now - done)
                done = now
            if held is not None:  # trailing blank lines, gzip trailer: counted with the last record
                yield dataclasses.replace(held, file_bytes=held.file_bytes + os.path.getsize(path) - done)


class BadLines:
    """Malformed lines: without --skip-bad-lines the first one stops the run (its error says how to skip);
    with it each is counted and the first SHOWN are reported."""
    SHOWN = 10

    def __init__(self, skip: bool, report: Callable[[str], None]):
        self.skip, self.report, self.count = skip, report, 0

    def __call__(self, message: str) -> None:
        self.count += 1
        if not self.skip:
            raise BadInputError(f"{message}\n(pass --skip-bad-lines to skip malformed lines)")
        if self.count <= self.SHOWN:
            self.report(f"skipping bad line: {message}")


class Interrupted(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `timeout`'s kill), raised like Ctrl-C so that partial files are removed."""


def run_interruptible(run: Callable[[], int], outcome: str) -> int:
    """run() for a command-line tool: Ctrl-C or SIGTERM print "interrupted: <outcome>" (what was left on disk)
    and return 128 + the signal's number, as a shell reports it, instead of a traceback."""
    def on_sigterm(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run()
    except KeyboardInterrupt as e:
        print(f"interrupted: {outcome}", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(e, Interrupted) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _where(record: Record) -> str:
    return f"{record.path}:{record.line}" if record.line else record.path


def parse_record(record: Record, input_format: str, json_keys: Sequence[str]) -> Dict[str, str]:
    """The text of each key of one record; raises BadInputError naming file and line."""
    where = _where(record)
    try:
        text = record.raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInputError(f"{where}: not valid UTF-8 ({e})") from None
    fmt = detect_format(record.path) if input_format == "auto" else input_format
    if fmt != "jsonl":
        return {key: text for key in json_keys}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    out = {}
    for key in json_keys:
        if key not in obj:
            raise BadInputError(f"{where}: missing key {key!r} (see --json-keys)")
        if not isinstance(obj[key], str):
            raise BadInputError(f"{where}: key {key!r} is {type(obj[key]).__name__}, expected a string")
        surrogate = re.search(r"[\ud800-\udfff]", obj[key])
        if surrogate:  # a JSON escape such as \ud800 with no partner: no UTF-8 text, no tokenizer takes it
            raise BadInputError(f"{where}: key {key!r} holds an unpaired surrogate "
                                f"\\u{ord(surrogate.group()):04x} (a broken JSON escape), not text")
        out[key] = obj[key]
    return out


def batches(records: Iterable[Record], max_records: int = 256, max_bytes: int = 1 << 20) -> Iterator[List[Record]]:
    batch, size = [], 0
    for r in records:
        batch.append(r)
        size += len(r.raw)
        if len(batch) >= max_records or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# -- encoding (runs in workers) --------------------------------------------------------------

@dataclass(frozen=True)
class EncoderSpec:
    tokenizer_type: str
    tokenizer_model: Optional[str]
    vocab_size: Optional[int]
    json_keys: Tuple[str, ...]
    input_format: str
    append_eod: bool
    dtype: str
    tokenizer_threads: int = -1  # -1: all cores (one process); 1 in each of several worker processes
    vocab_file: Optional[str] = None  # GPT2BPETokenizer
    merge_file: Optional[str] = None


@dataclass
class EncodedBatch:
    # per document: {key: tokens} or an error message; plus the input bytes for throughput
    documents: List[object] = field(default_factory=list)
    input_bytes: int = 0
    file_bytes: int = 0  # bytes of the input files these documents span (compressed for .gz)


class Encoder:
    def __init__(self, spec: EncoderSpec):
        self.spec = spec
        self.tokenizer = build_tokenizer_by_type(spec.tokenizer_type, spec.tokenizer_model, spec.vocab_size,
                                                 spec.vocab_file, spec.merge_file)
        self.dtype = np.dtype(spec.dtype)

    def encode(self, batch: List[Record]) -> EncodedBatch:
        out = EncodedBatch(input_bytes=sum(len(r.raw) for r in batch), file_bytes=sum(r.file_bytes for r in batch))
        parsed = []
        for r in batch:
            try:
                parsed.append(parse_record(r, self.spec.input_format, self.spec.json_keys))
            except BadInputError as e:
                parsed.append(str(e))
        ok = [p for p in parsed if isinstance(p, dict)]
        by_key = {key: iter(self._tokenize([p[key] for p in ok])) for key in self.spec.json_keys}
        for r, p in zip(batch, parsed):
            if isinstance(p, str):
                out.documents.append(p)
                continue
            tokens = {key: next(by_key[key]) for key in self.spec.json_keys}  # every key: the iterators stay aligned
            errors = [e for e in (self._check(key, ids) for key, ids in tokens.items()) if e]
            if errors:
                out.documents.append(f"{_where(r)}: {errors[0]}")
                continue
            doc = {}
            for key, ids in tokens.items():
                ids = list(ids)
                if ids and self.spec.append_eod:  # Megatron: empty documents get no eod
                    ids.append(self.tokenizer.eod)
                doc[key] = np.asarray(ids, dtype=self.dtype)
            out.documents.append(doc)
        return out

    def _tokenize(self, texts: List[str]) -> List[object]:
        """Token ids per text, or for a text the tokenizer refuses (NullTokenizer: not integers) the reason."""
        batch_fn = getattr(self.tokenizer, "tokenize_batch", None)
        if batch_fn is not None:
            return list(batch_fn(texts, num_threads=self.spec.tokenizer_threads))
        out: List[object] = []
        for t in texts:
            try:
                out.append(self.tokenizer.tokenize(t))
            except ValueError as e:
                out.append(f"the tokenizer cannot read it ({e})")
        return out

    def _check(self, key: str, ids) -> Optional[str]:
        """Why a document's ids cannot be written (outside the vocabulary: they would index past the embedding,
        or not fit the dataset's dtype), else None."""
        if isinstance(ids, str):
            return f"key {key!r}: {ids}"
        if not len(ids):
            return None
        arr = np.asarray(ids, dtype=np.int64)
        lo, hi, n = int(arr.min()), int(arr.max()), self.tokenizer.vocab_size
        if lo < 0:
            return f"key {key!r}: token id {lo} is negative"
        if hi < n:
            return None
        fix = " (NullTokenizer: --vocab-size must exceed the largest id)" \
            if self.spec.tokenizer_type == "NullTokenizer" else ""
        return f"key {key!r}: token id {hi} is outside the vocabulary 0..{n - 1}{fix}"


_worker_encoder: Optional[Encoder] = None


def _init_worker(spec: EncoderSpec) -> None:
    global _worker_encoder  # per-process state of a pool worker (not shared)
    # Interrupts are the main process's to handle (it removes the partial output and ends the pool); a worker
    # forked with its SIGTERM handler would print a traceback when the pool is terminated.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = Encoder(spec)


def _encode_in_worker(batch: List[Record]) -> EncodedBatch:
    return _worker_encoder.encode(batch)


def ordered_parallel_map(spec: EncoderSpec, work: Iterable[List[Record]], workers: int,
                         in_flight_per_worker: int = 4) -> Iterator[EncodedBatch]:
    """Encode batches in worker processes, yielding results in input order, bounded in flight."""
    if workers <= 1:
        encoder = Encoder(spec)
        for batch in work:
            yield encoder.encode(batch)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        pending = deque()
        for batch in work:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= workers * in_flight_per_worker:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# -- the whole job -----------------------------------------------------------------------------

@dataclass
class PreprocessResult:
    outputs: Dict[str, str]        # key -> output prefix
    documents: int
    bad_lines: int
    input_bytes: int
    tokens: int
    seconds: float


def check_output_prefix(output_prefix: str) -> None:
    """Refuse a prefix that names no file (`data/`: it would write `data/_text_document.bin`) or lies under a
    file; create its directory."""
    if not os.path.basename(output_prefix):
        raise ValueError(f"--output-prefix {output_prefix} ends with a path separator: name the files too, e.g. "
                         f"{os.path.join(output_prefix, 'corpus')}")
    make_parent_directory(output_prefix, "--output-prefix")


def make_parent_directory(path: str, flag: str) -> None:
    """Create the directory `path` goes in; a path under a file is refused naming `flag` (os.makedirs would
    raise FileExistsError about the file)."""
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory")
    os.makedirs(directory, exist_ok=True)


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    return f"{output_prefix}_{key}_{level}"


def preprocess(files: Sequence[str], output_prefix: str, tokenizer_type: str, tokenizer_model: Optional[str] = None,
               vocab_size: Optional[int] = None, json_keys: Sequence[str] = ("text",), input_format: str = "auto",
               append_eod: bool = True, workers: int = 1, skip_bad_lines: bool = False,
               progress: bool = True, log_interval: int = 1000, output_names: Optional[Dict[str, str]] = None,
               tokenizer_threads: Optional[int] = None, vocab_file: Optional[str] = None,
               merge_file: Optional[str] = None,
               report: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> PreprocessResult:
    """Tokenize `files` into one `.bin/.idx` dataset per JSON key. Returns what was written."""
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"unknown input format {input_format!r}: choose one of {', '.join(INPUT_FORMATS)}")
    twice = [k for i, k in enumerate(json_keys) if k in json_keys[:i]]
    if twice:  # one dataset per key: a key given twice would write its file twice
        raise ValueError(f"--json-keys names {twice[0]!r} more than once: give each key once")
    odd = [k for k in json_keys if not k or "/" in k or os.sep in k]
    if odd:  # a key is part of the output's file name: {prefix}_{key}_document.bin
        raise ValueError(f"--json-keys {odd[0]!r}: each key names an output file ({{prefix}}_{{key}}_document.bin), "
                         "so it cannot be empty or hold a path separator; keys are the JSON lines' top-level keys")
    # fail fast, in the main process
    tokenizer = build_tokenizer_by_type(tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    dtype = best_token_dtype(tokenizer.vocab_size)
    if tokenizer_threads is None:  # one process may use every core; worker processes one each
        tokenizer_threads = -1 if workers <= 1 else 1
    spec = EncoderSpec(tokenizer_type, tokenizer_model, vocab_size, tuple(json_keys), input_format, append_eod,
                       dtype.str, tokenizer_threads, vocab_file, merge_file)
    prefixes = {k: (output_names or {}).get(k) or output_prefix_for(output_prefix, k) for k in json_keys}
    if not output_names:
        check_output_prefix(output_prefix)
    inputs = {os.path.realpath(f) for f in files}
    for prefix in prefixes.values():
        for out in (f"{prefix}.bin", f"{prefix}.idx"):
            if os.path.realpath(out) in inputs:  # the finished dataset would replace the text it was read from
                raise ValueError(f"the output {out} is one of the --input files: choose another --output-prefix")
    builders = {k: IndexedDatasetBuilder(p, dtype=dtype) for k, p in prefixes.items()}
    total_bytes = sum(os.path.getsize(f) for f in files)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="preprocess",
                   file=sys.stderr, mininterval=0.5)
    docs = tokens = seen_bytes = 0
    bad_lines = BadLines(skip_bad_lines, report)
    next_log = log_interval
    t0 = time.perf_counter()
    try:
        for result in ordered_parallel_map(spec, batches(read_records(files, input_format)), workers):
            for doc in result.documents:
                if isinstance(doc, str):
                    bad_lines(doc)
                    continue
                for key, ids in doc.items():
                    builders[key].add_document(ids, [len(ids)] if len(ids) else [])
                    tokens += len(ids)
                docs += 1
            seen_bytes += result.input_bytes
            if bar is not None:
                bar.update(result.file_bytes)  # the total is the files' sizes on disk
                elapsed = time.perf_counter() - t0
                bar.set_postfix(docs=docs, docs_per_s=f"{docs / max(elapsed, 1e-9):.0f}", refresh=False)
            elif log_interval and docs >= next_log:
                elapsed = time.perf_counter() - t0
                report(f"processed {docs} documents ({docs / elapsed:.1f} docs/s, "
                       f"{seen_bytes / elapsed / 1e6:.2f} MB/s)")
                next_log = docs + log_interval
        for b in builders.values():
            b.finalize()
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    if bad_lines.count:
        report(f"skipped {bad_lines.count} bad line(s)")
    return PreprocessResult(prefixes, docs, bad_lines.count, seen_bytes, tokens, time.perf_counter() - t0)


def empty_output_warning(result: PreprocessResult) -> Optional[str]:
    """A warning when the outputs hold no token (training on them is refused), saying why; else None."""
    if result.tokens:
        return None
    what = "no documents" if result.documents == 0 else \
        f"{result.documents} document(s) without a token (every text was empty)"
    why = f"{result.bad_lines} bad line(s) were skipped under --skip-bad-lines" if result.bad_lines else \
        "check --input, --json-keys and --input-format"
    return (f"warning: wrote {what} to {', '.join(result.outputs.values())}: training on it will be refused "
            f"({why})")
