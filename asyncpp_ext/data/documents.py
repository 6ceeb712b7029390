"""How ``asyncpp-prepare-data``'s inputs become documents: every input cut into encoding tasks in
order (text files in pieces, JSON lines and Parquet / Arrow records whole), the document boundary
(``--doc-boundary``, ``--boundary-token``) and separator (``--doc-separator``) resolved, and the
encoded tasks turned into documents -- a boundary token around each, each whole document sent to
the training or the validation file -- with bad records skipped and counted where allowed.
"""
from __future__ import annotations

import math
import re
from typing import Iterator, Optional

import numpy as np

from . import inputs as inp
from .encode import BAD, BLANK, PrepareError, Task
from .errors import first_line
from .sinks import TokenSink
from .text_pieces import NotTextError, read_text_pieces

PIECES_PER_BATCH = 32
"""Pieces encoded per ``encode_batch`` call (the tokenizer runs them in parallel)."""
BOUNDARIES = ("auto", "eos", "bos", "none")


def batched(pieces, size: int):
    batch = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.?)", re.DOTALL)


def parse_separator(separator: str) -> str:
    """``--doc-separator`` with its escapes turned into characters: \\n \\t \\r \\\\, \\xHH and
    \\uHHHH. Any other backslash, a NUL and a lone surrogate (text files hold none) are refused:
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
    if any(0xD800 <= ord(c) <= 0xDFFF for c in parsed):  # \uD800-\uDFFF: halves of a UTF-16 pair
        raise PrepareError(f"--doc-separator {separator!r} holds a lone surrogate, which UTF-8 text never "
                           "does; give a character past U+FFFF as itself, not as two \\uHHHH halves")
    return parsed


def check_flags_apply(items: list, text_field: Optional[str], separator: Optional[str]) -> None:
    """--text-field and --doc-separator each apply to some kinds of input; given for inputs none
    of which is such a kind, the flag would be ignored, so it is refused."""
    kinds = {item.kind for item in items}
    if separator is not None and inp.TEXT not in kinds:
        raise PrepareError("--doc-separator splits text files, and no input is one (each JSON "
                           "line, Parquet or Arrow row is a document already); drop it")
    if text_field is not None and kinds == {inp.TEXT}:
        raise PrepareError(f"--text-field {text_field} names a JSON field or column, and every "
                           "input is a text file; drop it")


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


class Skips:
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


def input_tasks(items: list, separator: Optional[str], text_field: str, skips: Skips,
                on_bytes) -> Iterator[Task]:
    """Every input cut into tasks, in order."""
    for item in items:
        try:
            if item.kind == inp.TEXT:
                pieces = read_text_pieces(item.path, on_bytes, separator, item.compression)
                for batch in batched(pieces, PIECES_PER_BATCH):
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


class Documents:
    """Puts boundary tokens around documents and sends each to the training or validation sink,
    from the encoded tasks in input order."""

    def __init__(self, mode: str, token_id: Optional[int], val_fraction: float, train: TokenSink,
                 val: Optional[TokenSink], skips: Skips, dtype: np.dtype):
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


__all__ = ["BOUNDARIES", "PIECES_PER_BATCH", "Documents", "Skips", "batched", "check_flags_apply", "input_tasks",
           "parse_separator", "resolve_boundary"]
