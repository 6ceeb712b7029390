"""``asyncpp-prepare-data``: tokenize a corpus -- text files, JSON lines (plain, ``.gz``,
``.zst``), Parquet, or a ``datasets`` ``save_to_disk`` directory -- into ``.bin`` token files (+
sidecars) that ``asyncpp-train --data`` reads; the formats are described in ``sources`` and
``shards``.

Usage::

    asyncpp-prepare-data --tokenizer tokenizer.json|bytes --input PATH|DIR|GLOB [...] --out train.bin
                         [--text-field text] [--doc-separator SEP] [--doc-boundary auto|eos|bos|none]
                         [--boundary-token TOKEN] [--val-fraction F] [--val-out PATH]
                         [--shard-tokens N] [--workers N] [--skip-bad-records]

Documents. A JSON line or a Parquet / Arrow row is one document (its ``--text-field``); a text file
is one document, or several split at ``--doc-separator``. Each document is encoded on its own and
marked with the tokenizer's end-of-text token after it (``eos``) or its beginning-of-text token
before it (``bos``); ``auto`` takes the tokenizer family's convention (``HFTokenizer.
boundary_tokens``: bos where the tokenizer's template puts one before every text, e.g. Llama;
else eos where it has an end-of-text token, e.g. GPT-2, SmolLM, Qwen; else none). ``none`` marks
nothing: the legacy behaviour, byte for byte (the bytes tokenizer and tokenizers without such a
token). Documents without tokens are skipped and counted.

Long text files are read in blocks and cut into pieces at line ends (a line longer than a block
is cut at whitespace), so memory stays bounded whatever the input size; pieces are encoded without
special tokens, so a tokenizer that splits text at whitespace gives the same tokens as on the whole
text except, at most, where a piece ends. JSON and Parquet records are encoded whole.

Validation: with ``--val-fraction F`` and document boundaries, F of the documents (every document
k where floor((k+1)F) > floor(kF): evenly spread, whole documents) go to the validation file; with
``--doc-boundary none``, the last F of the tokens (as before).

Scale: ``--workers N`` (default: the cores, one process for inputs under 1 MiB or the bytes
tokenizer) worker processes tokenize batches of records while this process reads the inputs and
writes the results in input order, so the output is byte-identical whatever N is; at most 2N + 1
batches are in flight, so memory stays bounded. ``--shard-tokens N`` writes shards of N ids,
``<stem>_000000.bin`` ..., each with a sidecar, and ``<stem>.manifest.json``.

Outputs are written to temporary files that are renamed only once everything succeeded, so a
failure, Ctrl-C, SIGTERM or SIGHUP leaves no partial file behind; the renames hold those signals,
and shards or a single file of an earlier run with the same ``--out`` are removed with them. Bad
input ends with one line naming the file (and line or row) and exit status 2;
``--skip-bad-records`` skips bad records (and damaged files) and counts them instead; a file
without the ``--text-field`` column is never skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from . import inputs as inp
from .encode import (BAD, BLANK, BYTES, ByteTokenizer, HFTokenizer, PrepareError, PrepareFailed,  # noqa: F401
                     Task, load_tokenizer, ordered_encode)
from .errors import first_line
from ..directories import make_directories, missing_directories, remove_directories, unwritable_ancestor
from ..stop_signals import stop_signals_raise
from .sinks import StoppedAfterCommit, TokenSink, base_header, commit_outputs, remove_orphaned_temps
from .sources import TOKEN_DTYPES, DataError, token_dtype_for_vocab
from .text_pieces import NotTextError, read_pieces, read_text_pieces  # noqa: F401 (read_pieces: public here too)

PROG = "asyncpp-prepare-data"
PIECES_PER_BATCH = 32
"""Pieces encoded per ``encode_batch`` call (the tokenizer runs them in parallel)."""
PARALLEL_MIN_BYTES = 1 << 20
"""Inputs smaller than this are tokenized in this process whatever the cores (workers take
longer to start than such an input takes to encode)."""
BOUNDARIES = ("auto", "eos", "bos", "none")


def _batched(pieces, size: int):
    batch = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_output(path: Path, flag: str) -> list:
    """The directories to create for ``path`` (missing ancestors, outermost first), after checking
    that the name is a token file's and that the nearest existing ancestor is a writable directory."""
    if path.suffix != ".bin":
        raise PrepareError(f"{flag} {path} does not end in .bin; name the token file like train.bin")
    if path.is_dir():
        raise PrepareError(f"{flag} {path} is a directory; name a file inside it, like train.bin")
    blocked = unwritable_ancestor(path.parent)
    if blocked is not None:
        raise PrepareError(f"{flag} {path}: {blocked} is not a writable directory; choose another place")
    return missing_directories(path.parent)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.?)", re.DOTALL)


def parse_separator(separator: str) -> str:
    """``--doc-separator`` with its escapes turned into characters: \\n \\t \\r \\\\, \\xHH and
    \\uHHHH. Any other backslash, and a NUL (text files hold none), is refused rather than kept:
    a separator that never matches would make each file one document without a word."""
    def replace(match):
        code = match.group(1)
        if code[:1] in ("x", "u") and len(code) > 1:
            return chr(int(code[1:], 16))
        if code in _ESCAPES:
            return _ESCAPES[code]
        what = f"unknown escape '\\{code}'" if code else "a lone '\\' at the end"
        raise PrepareError(f"--doc-separator {separator!r}: {what}; use \\n \\t \\r \\xHH \\uHHHH, "
                           "or \\\\ for a backslash")
    parsed = _ESCAPE.sub(replace, separator)
    if "\0" in parsed:
        raise PrepareError(f"--doc-separator {separator!r} holds a NUL, which text files never do "
                           "(they are refused); choose text that separates the documents")
    return parsed


def _check_flags_apply(items: list, text_field: Optional[str], separator: Optional[str]) -> None:
    """--text-field and --doc-separator each apply to some kinds of input; given for inputs none
    of which is such a kind, the flag would be ignored, so it is refused."""
    kinds = {item.kind for item in items}
    if separator is not None and inp.TEXT not in kinds:
        raise PrepareError("--doc-separator splits text files, and no input is one (each JSON "
                           "line, Parquet or Arrow row is a document already); drop it")
    if text_field is not None and kinds == {inp.TEXT}:
        raise PrepareError(f"--text-field {text_field} names a JSON field or column, and every "
                           "input is a text file; drop it")


def parse_token_count(text: str) -> int:
    """``--shard-tokens``: an integer, optionally with K, M or G (10^3, 10^6, 10^9)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 100000000 or 100M)")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of tokens")
    return int(value)


def resolve_boundary(tokenizer, mode: str, token: Optional[str]) -> tuple[str, Optional[int], Optional[str]]:
    """(eos | bos | none, boundary token id, token) for --doc-boundary and --boundary-token."""
    if mode not in BOUNDARIES:
        raise PrepareError(f"--doc-boundary {mode} is not one of {', '.join(BOUNDARIES)}")
    default, eos, bos = tokenizer.boundary_tokens()
    if token is not None:
        if mode == "none":
            raise PrepareError("--boundary-token needs --doc-boundary eos or bos (or auto)")
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise PrepareError(f"--boundary-token {token!r} is not a token of tokenizer "
                               f"{tokenizer.name}; name one of its special tokens")
        return (default if mode == "auto" and default != "none" else
                "eos" if mode == "auto" else mode), token_id, token
    mode = default if mode == "auto" else mode
    if mode == "none":
        return "none", None, None
    token = eos if mode == "eos" else bos
    if token is None:
        what = "end-of-text" if mode == "eos" else "beginning-of-text"
        raise PrepareError(f"--doc-boundary {mode}: tokenizer {tokenizer.name} has no {what} token "
                           "(looked for <|endoftext|>, </s>, <s>, ...); name one with "
                           "--boundary-token or pass --doc-boundary none")
    return mode, tokenizer.token_to_id(token), token


class _Skips:
    """Bad records and damaged files passed over with --skip-bad-records."""

    def __init__(self, allowed: bool):
        self.allowed, self.records, self.files, self.first = allowed, 0, 0, None

    def record(self, where: str, reason: str) -> None:
        if not self.allowed:
            raise PrepareError(f"input {where} {reason}; fix or delete it, or pass "
                               "--skip-bad-records to skip such records")
        self.records += 1
        self.first = self.first or f"{where}: {reason}"

    def file(self, error: PrepareError) -> None:
        if not self.allowed:
            raise error
        self.files += 1
        self.first = self.first or str(error)


def _tasks(items: list, separator: Optional[str], text_field: str, skips: _Skips,
           on_bytes) -> Iterator[Task]:
    """Every input cut into tasks, in order."""
    for item in items:
        try:
            if item.kind == inp.TEXT:
                pieces = read_text_pieces(item.path, on_bytes, separator, item.compression)
                for batch in _batched(pieces, PIECES_PER_BATCH):
                    yield Task("text", [p for p, _ in batch], str(item.path), 0, [e for _, e in batch])
            elif item.kind == inp.JSONL:
                try:
                    yield from inp.read_jsonl_tasks(item, on_bytes)
                except inp.stream_errors() as exc:
                    reason = first_line(exc)
                    raise PrepareError(f"input {item.path} is damaged or cut short ({reason}); "
                                       "download it again") from None
            elif item.kind == inp.PARQUET:
                yield from inp.read_parquet_tasks(item, text_field, on_bytes)
            else:
                yield from inp.read_arrow_tasks(item, text_field, on_bytes)
        except inp.ColumnError:
            raise  # the flag or the schema is wrong, not the file: skipping would hide it
        except NotTextError:
            raise  # a text file's earlier pieces are already written: not skippable
        except PrepareError as exc:
            skips.file(exc)


class _Documents:
    """Puts boundary tokens around documents and sends each to the training or validation sink,
    from the encoded tasks in input order."""

    def __init__(self, mode: str, token_id: Optional[int], val_fraction: float, train: TokenSink,
                 val: Optional[TokenSink], skips: _Skips, dtype: np.dtype):
        self.mode, self.train, self.val, self.skips = mode, train, val, skips
        self.marker = np.array([token_id if token_id is not None else 0], dtype=dtype)
        self.val_fraction = val_fraction if (val is not None and mode != "none") else 0.0
        self.open, self.doc_tokens, self.to_val, self.started = False, 0, False, 0
        self.documents, self.empty, self.tokens = 0, 0, 0

    def feed(self, task: Task, ids: np.ndarray, lengths: np.ndarray, bad: list) -> None:
        reasons = dict(bad)
        parts = {False: [], True: []}
        pos = 0
        for i, n in enumerate(lengths.tolist()):
            if n == BLANK:
                continue
            if n == BAD:
                self.skips.record(task.where(i), reasons[i])
                continue
            if not self.open:
                k, f = self.started, self.val_fraction
                self.open, self.doc_tokens, self.started = True, 0, k + 1
                self.to_val = f > 0 and math.floor((k + 1) * f) > math.floor(k * f)
            out = parts[self.to_val]
            if n:
                if self.mode == "bos" and self.doc_tokens == 0:
                    out.append(self.marker)
                out.append(ids[pos: pos + n])
                pos += n
                self.doc_tokens += n
            if task.ends is None or task.ends[i]:
                self.open = False
                if self.doc_tokens:
                    if self.mode == "eos":
                        out.append(self.marker)
                    self.documents += 1
                    (self.val if self.to_val else self.train).documents += 1
                else:
                    self.empty += 1
        for to_val, chunks in parts.items():
            if chunks:
                block = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
                self.tokens += len(block)
                (self.val if to_val else self.train).write(block)


MAX_WORKERS_PER_CORE = 4
"""--workers above this many per core is refused: each worker is a process with its own tokenizer
(tens of MB), and more workers than cores only add memory."""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _default_workers(tokenizer, items: list) -> int:
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    cores = _cores()
    size = sum(i.path.stat().st_size for i in items)
    return cores if size >= PARALLEL_MIN_BYTES else 1


class PrepareResult(dict):
    """{token file: its sidecar} of the files written, with what the run counted as attributes."""

    inputs: int = 0
    documents: int = 0
    empty: int = 0
    skipped_records: int = 0
    skipped_files: int = 0
    first_skip: Optional[str] = None
    manifests: list = []
    stale_removed: list = []
    orphans_removed: list = []  # temporary files of runs killed outright
    boundary: str = "none"
    boundary_token: Optional[str] = None
    boundary_token_id: Optional[int] = None
    workers: int = 1
    seconds: float = 0.0


def prepare(tokenizer_spec: str, inputs: Sequence[str], out: str, val_fraction: float = 0.0,
            val_out: Optional[str] = None, progress: Optional[bool] = None, *,
            text_field: Optional[str] = None, doc_separator: Optional[str] = None,
            doc_boundary: str = "auto", boundary_token: Optional[str] = None,
            shard_tokens: Optional[int] = None, workers: Optional[int] = None,
            skip_bad_records: bool = False) -> PrepareResult:
    """Tokenize ``inputs`` into ``out`` (and the validation file, if ``val_fraction`` > 0), with
    sidecars (and manifests with ``shard_tokens``). Returns {path: sidecar} of the token files
    written (a ``PrepareResult``). Raises ``PrepareError``; nothing is left on disk unless it
    returns."""
    began = time.perf_counter()
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction} is outside [0, 1); use e.g. 0.1 or 0")
    out_path = Path(out)
    directories = _check_output(out_path, "--out")
    val_path = None
    if val_out is not None and val_fraction == 0.0:
        raise PrepareError("--val-out needs --val-fraction > 0; give both or neither")
    if val_fraction > 0.0:
        val_path = Path(val_out) if val_out else out_path.with_name(f"{out_path.stem}.val.bin")
        directories += _check_output(val_path, "--val-out")
        if val_path.resolve() == out_path.resolve():
            raise PrepareError(f"--val-out {val_path} is the --out file; name another file")
    if shard_tokens is not None and shard_tokens < 1:
        raise PrepareError(f"--shard-tokens {shard_tokens} is not positive; use e.g. 100M")
    if workers is not None and workers < 1:
        raise PrepareError(f"--workers {workers} is not positive; use 1 or more (default: the cores)")
    cores = _cores()
    if workers is not None and workers > MAX_WORKERS_PER_CORE * cores:
        raise PrepareError(f"--workers {workers} is more than {MAX_WORKERS_PER_CORE} per core for the {cores} "
                           f"core(s) here; use at most {MAX_WORKERS_PER_CORE * cores} (the default is {cores})")
    if doc_separator == "":
        raise PrepareError("--doc-separator is empty; give the text between documents, e.g. '\\n\\n'")
    separator = parse_separator(doc_separator) if doc_separator else None
    items = inp.expand_inputs(inputs)
    _check_flags_apply(items, text_field, separator)
    text_field = text_field if text_field is not None else "text"
    tokenizer = load_tokenizer(tokenizer_spec)
    mode, token_id, token = resolve_boundary(tokenizer, doc_boundary, boundary_token)
    dtype_name = token_dtype_for_vocab(tokenizer.vocab_size)
    dtype = TOKEN_DTYPES[dtype_name]
    n_workers = workers if workers is not None else _default_workers(tokenizer, items)
    if isinstance(tokenizer, ByteTokenizer):
        n_workers = 1  # encoding bytes is a copy: nothing to share out

    show = sys.stderr.isatty() if progress is None else progress
    skips = _Skips(skip_bad_records)
    sinks: list = []
    temps: list = []
    made: list = []
    try:
        made = make_directories(directories)
        train = TokenSink(out_path, dtype, shard_tokens)
        val = TokenSink(val_path, dtype, shard_tokens) if val_path is not None else None
        sinks = [train] + ([val] if val is not None else [])
        docs = _Documents(mode, token_id, val_fraction, train, val, skips, dtype)
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=sum(i.path.stat().st_size for i in items), desc="tokenize", unit="B",
                       unit_scale=True, file=sys.stderr)
        on_bytes = bar.update if bar is not None else (lambda n: None)
        with (bar if bar is not None else contextlib.nullcontext()):
            tasks = _tasks(items, separator, text_field, skips, on_bytes)
            for task, (ids, lengths, bad) in ordered_encode(tasks, tokenizer, tokenizer_spec,
                                                             text_field, n_workers):
                docs.feed(task, ids, lengths, bad)
                if bar is not None:
                    rate = docs.tokens / max(time.perf_counter() - began, 1e-9)
                    bar.set_postfix_str(f"{docs.documents + docs.empty:,} docs, {rate:,.0f} tok/s",
                                        refresh=False)
        for sink in sinks:
            sink.close()
        total = train.total + (val.total if val is not None else 0)
        if total == 0:
            raise PrepareError(f"the inputs ({', '.join(str(i.path) for i in items[:3])}"
                               f"{', ...' if len(items) > 3 else ''}) gave no tokens; pass "
                               "files with text in them")
        if val is not None and mode == "none":  # the last F of the tokens
            held_out = int(total * val_fraction)
            if held_out:
                for chunk in train.take_tail(held_out):
                    val.write(chunk)
        if val is not None and val.total == 0:
            what = "documents" if mode != "none" else "tokens"
            count = docs.documents + docs.empty if mode != "none" else total
            raise PrepareError(f"--val-fraction {val_fraction} of {count} {what} leaves the "
                               "validation file empty; use more text or a larger fraction")
        if train.total == 0:
            raise PrepareError(f"--val-fraction {val_fraction} leaves no training tokens; use a "
                               "smaller fraction")
        temps.extend(t for sink in sinks for t in sink.temps())
        doc_fields = None
        if mode != "none":
            doc_fields = {"doc_boundary": mode, "boundary_token": token, "boundary_token_id": token_id}
        headers, manifests, stale = commit_outputs(
            sinks, base_header(dtype_name, tokenizer.vocab_size, tokenizer.name, tokenizer.sha256), doc_fields, temps)
        result = PrepareResult(headers)
        result.inputs, result.documents, result.empty = len(items), docs.documents, docs.empty
        result.skipped_records, result.skipped_files, result.first_skip = (skips.records, skips.files,
                                                                           skips.first)
        result.manifests, result.stale_removed = manifests, stale
        result.orphans_removed = [p for directory in sorted({s.final.parent for s in sinks})
                                  for p in remove_orphaned_temps(directory)]
        result.boundary, result.boundary_token, result.boundary_token_id = mode, token, token_id
        result.workers, result.seconds = n_workers, time.perf_counter() - began
        return result
    except OSError as exc:
        reason = exc.strerror or first_line(exc)  # numpy's write errors carry no strerror
        raise PrepareFailed(f"could not read or write {exc.filename or out_path} ({reason}); "
                           "check the files, the output directory and free disk space") from None
    finally:
        for sink in sinks:
            sink.close()
            temps.extend(sink.temps())
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        remove_directories(made)


class _UsageError(Exception):
    """A command-line mistake: main prints it as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (no usage block), like every other bad input
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``asyncpp-prepare-data``."""
    parser = _Parser(
        prog=PROG, description="Tokenize text, JSON lines (.gz/.zst), Parquet or a save_to_disk "
        "dataset into .bin token files (+ .bin.json sidecars) for asyncpp-train --data.")
    parser.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                        help="path of a Hugging Face tokenizer.json (or the folder holding it), or 'bytes' "
                             "(ids are the UTF-8 bytes, vocabulary 256)")
    parser.add_argument("--input", required=True, nargs="+", metavar="PATH",
                        help="files, directories or globs, read in the order given (a directory or "
                             "glob in sorted order, leaving out .bin token files, sidecars and "
                             "manifests): text (*.txt, or any other name), JSON lines (*.jsonl, "
                             "*.json, *.ndjson, optionally .gz/.zst), Parquet (*.parquet), Arrow / a "
                             "save_to_disk directory")
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="token file to write (.bin); missing directories are created")
    parser.add_argument("--text-field", metavar="NAME",
                        help="the JSON field / column holding each document's text (default text)")
    parser.add_argument("--doc-separator", metavar="SEP",
                        help="split text files into documents at SEP (escapes \\n \\t \\r \\xHH \\uHHHH "
                             "\\\\; e.g. '\\n\\n' or '<|endoftext|>'; default: one document per file)")
    parser.add_argument("--doc-boundary", choices=BOUNDARIES, default="auto",
                        help="mark documents with the end-of-text token after each (eos), the "
                             "beginning-of-text token before each (bos), or nothing (none); auto "
                             "(default): as the tokenizer's family trains, none without such a token")
    parser.add_argument("--boundary-token", metavar="TOKEN",
                        help="the boundary token to use (default: the tokenizer's own, e.g. "
                             "<|endoftext|>)")
    parser.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                        help="put F (0 <= F < 1) of the documents (with --doc-boundary none: the last "
                             "F of the tokens) in a validation file (default 0: none)")
    parser.add_argument("--val-out", metavar="PATH",
                        help="validation token file (default: <stem of --out>.val.bin next to it)")
    parser.add_argument("--shard-tokens", type=parse_token_count, metavar="N",
                        help="write shards of N tokens (e.g. 100M): <stem>_000000.bin, ... each with "
                             "its sidecar, and <stem>.manifest.json (default: one file)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="tokenizer processes (default: the cores; 1 for inputs under 1 MiB; "
                             "at most 4 per core); "
                             "the output is the same for every N")
    parser.add_argument("--skip-bad-records", action="store_true",
                        help="skip malformed records and damaged files, and count them, instead of "
                             "stopping at the first")
    return parser


def _summary(result: PrepareResult) -> str:
    paths = list(result)
    first = result[paths[0]]
    total = sum(h["num_tokens"] for h in result.values())
    if result.manifests:
        groups = []
        for manifest in result.manifests:
            stem = manifest.name[: -len(".manifest.json")]
            mine = [p for p in paths if p.name.rsplit("_", 1)[0] == stem]
            count = sum(result[p]["num_tokens"] for p in mine)
            groups.append(f"{len(mine)} shard(s) {mine[0]} ... {mine[-1].name} ({count:,}; "
                          f"manifest {manifest.name})")
        where = "; ".join(groups)
    else:
        where = ", ".join(f"{path} ({h['num_tokens']:,})" for path, h in result.items())
    line = (f"{PROG}: wrote {total:,} tokens from {result.inputs} input file(s) to {where}; "
            f"vocabulary {first['vocab_size']:,}, {first['dtype']}")
    if result.boundary != "none":
        side = "after" if result.boundary == "eos" else "before"
        line += (f"; {result.documents:,} documents, {result.boundary_token} "
                 f"(id {result.boundary_token_id}) {side} each")
    if result.empty:
        line += f"; {result.empty:,} empty document(s) skipped"
    if result.skipped_records or result.skipped_files:
        line += (f"; skipped {result.skipped_records:,} bad record(s) and {result.skipped_files:,} "
                 f"damaged file(s) (first: {result.first_skip})")
    if result.stale_removed:
        line += f"; removed {len(result.stale_removed)} token file(s) of an earlier run"
    if result.orphans_removed:
        line += f"; removed {len(result.orphans_removed)} temporary file(s) of a run killed before it ended"
    return line


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``asyncpp-prepare-data``; returns the exit status (0 ok, 1 a file could not be
    read or written part-way, 2 bad input, 128 + the signal's number when SIGINT, SIGTERM or
    SIGHUP stopped it)."""
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
        return 2
    result = None
    try:
        with stop_signals_raise():
            result = prepare(args.tokenizer, args.input, args.out, args.val_fraction, args.val_out,
                             text_field=args.text_field, doc_separator=args.doc_separator,
                             doc_boundary=args.doc_boundary, boundary_token=args.boundary_token,
                             shard_tokens=args.shard_tokens, workers=args.workers,
                             skip_bad_records=args.skip_bad_records)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        if result is None and not isinstance(exc, StoppedAfterCommit):
            what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
            print(f"{PROG}: {what}; no file written", file=sys.stderr)
        else:  # held until every output was in place
            print(f"{PROG}: {signal.Signals(signum).name} arrived as the outputs were put in place; "
                  "they are complete", file=sys.stderr)
        return 128 + signum
    except PrepareFailed as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except DataError as exc:  # PrepareError, or a vocabulary no token dtype holds
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path this user may not read or write, found before any file is opened
        where = f" {exc.filename}" if exc.filename else ""
        print(f"{PROG}: error: cannot use{where} ({exc.strerror or exc}); check that path and its "
              "permissions", file=sys.stderr)
        return 2
    try:
        print(_summary(result), flush=True)
    except OSError as exc:
        # the summary stays in stdout's buffer: the interpreter's flush at exit would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if isinstance(exc, BrokenPipeError):  # the reader (| head) went away; the outputs are complete
            return 0
        print(f"{PROG}: the outputs are complete, but the summary could not be written ({exc.strerror})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
