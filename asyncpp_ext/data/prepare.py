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
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from . import inputs as inp
from ..command_line import OneLineParser, UsageError
from .documents import BOUNDARIES, Documents, Skips, check_flags_apply, input_tasks, parse_separator, resolve_boundary
from .encode import (BYTES, ByteTokenizer, HFTokenizer, PrepareError, PrepareFailed,  # noqa: F401
                     load_tokenizer, ordered_encode)
from .errors import first_line
from ..directories import make_directories, missing_directories, remove_directories, unwritable_ancestor
from ..stop_signals import stop_signals_raise
from .sinks import StoppedAfterCommit, TokenSink, base_header, commit_outputs, remove_orphaned_temps
from .sources import TOKEN_DTYPES, DataError, token_dtype_for_vocab
from .text_pieces import read_pieces  # noqa: F401 (public here too)

PROG = "asyncpp-prepare-data"
PARALLEL_MIN_BYTES = 1 << 20
"""Inputs smaller than this are tokenized in this process whatever the cores (workers take
longer to start than such an input takes to encode)."""


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


def parse_token_count(text: str) -> int:
    """``--shard-tokens``: an integer, optionally with K, M or G (10^3, 10^6, 10^9)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 100000000 or 100M)")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of tokens")
    return int(value)


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
    check_flags_apply(items, text_field, separator)
    text_field = text_field if text_field is not None else "text"
    tokenizer = load_tokenizer(tokenizer_spec)
    mode, token_id, token = resolve_boundary(tokenizer, doc_boundary, boundary_token)
    dtype_name = token_dtype_for_vocab(tokenizer.vocab_size)
    dtype = TOKEN_DTYPES[dtype_name]
    n_workers = workers if workers is not None else _default_workers(tokenizer, items)
    if isinstance(tokenizer, ByteTokenizer):
        n_workers = 1  # encoding bytes is a copy: nothing to share out

    show = sys.stderr.isatty() if progress is None else progress
    skips = Skips(skip_bad_records)
    sinks: list = []
    temps: list = []
    made: list = []
    try:
        made = make_directories(directories)
        train = TokenSink(out_path, dtype, shard_tokens)
        val = TokenSink(val_path, dtype, shard_tokens) if val_path is not None else None
        sinks = [train] + ([val] if val is not None else [])
        docs = Documents(mode, token_id, val_fraction, train, val, skips, dtype)
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=sum(i.path.stat().st_size for i in items), desc="tokenize", unit="B",
                       unit_scale=True, file=sys.stderr)
        on_bytes = bar.update if bar is not None else (lambda n: None)
        with (bar if bar is not None else contextlib.nullcontext()):
            tasks = input_tasks(items, separator, text_field, skips, on_bytes)
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


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``asyncpp-prepare-data``."""
    parser = OneLineParser(
        prog=PROG, description="Tokenize text, JSON lines (.gz/.zst), Parquet or a save_to_disk "
        "dataset into .bin token files (+ .bin.json sidecars) for asyncpp-train --data.")
    parser.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                        help="path of a Hugging Face tokenizer.json (or the folder holding it), or 'bytes' "
                             "(ids are the UTF-8 bytes, vocabulary 256)")
    parser.add_argument("--input", required=True, nargs="+", metavar="PATH",
                        help="files, directories or globs, read in the order given (a directory or "
                             "glob in sorted order, leaving out .bin token files, sidecars and "
                             "manifests; a directory only its files of the suffixes below, not hidden "
                             "ones): text (*.txt; a file named directly or by a glob whatever its "
                             "name), JSON lines (*.jsonl, *.json, *.ndjson, optionally .gz/.zst), "
                             "Parquet (*.parquet), Arrow / a save_to_disk directory")
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
    except UsageError as exc:
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
