"""Tokenizers and the encoding of one task of ``asyncpp-prepare-data`` (in this process or in a
worker process), and the worker pool that keeps results in input order.

A task (``Task``) is a run of consecutive items of one input file: text pieces, raw JSON lines
or a column of records. ``encode_task`` turns it into ``(ids, lengths, bad)``: the ids of every
item, concatenated; each item's token count (``BAD`` for a record that cannot be used, ``BLANK``
for a blank JSON line); and ``(item index, reason)`` of each bad record. Boundary tokens and the
validation split are added by the caller, which sees the results in input order, so the output
does not depend on the number of workers.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing.context
import os
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from ..stop_signals import die_with_parent
from .errors import DataError, first_line
from .sources import BYTES_TOKENIZER

BYTES = BYTES_TOKENIZER
BAD, BLANK = -1, -2
"""Item lengths that mark a bad record and a blank JSON line."""
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""End-of-text tokens looked for, in this order, when the tokenizer names none in a template."""
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")


class PrepareError(DataError):
    """Input that ``asyncpp-prepare-data`` cannot turn into a token file; the message says why and
    what to do."""


class PrepareFailed(PrepareError):
    """A preparation that failed on good input: a file could not be read or written part-way (a
    full disk, an I/O error). The command exits 1 for it, as asyncpp-train does, not 2."""


@dataclass
class Task:
    """Consecutive items of one input, encoded together."""

    kind: str
    """"text" (str pieces), "jsonl" (raw bytes lines) or "records" (a pyarrow string array or a
    list of str / None)."""
    items: object
    path: str
    first: int = 0
    """Number of the first item: its JSONL line (from 1) or record row (from 0)."""
    ends: Optional[list] = None
    """text: True where a piece ends a document; None: every item is a whole document."""

    def where(self, index: int) -> str:
        """Names item ``index`` for a message: file and line / row."""
        if self.kind == "jsonl":
            return f"{self.path} line {self.first + index}"
        if self.kind == "records":
            return f"{self.path} row {self.first + index} (from 0)"
        return self.path


class _Encoder:
    """What both tokenizers share: ``encode_many`` (ids of several texts, concatenated)."""

    def encode_many(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of all texts concatenated, int64 token count of each)."""
        arrays = self.encode(texts)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return ids, lengths

    def boundary_tokens(self) -> tuple[str, Optional[str], Optional[str]]:
        """(default --doc-boundary, end-of-text token, beginning-of-text token)."""
        return "none", None, None

    def token_to_id(self, token: str) -> Optional[int]:
        return None


class ByteTokenizer(_Encoder):
    """Ids are the UTF-8 bytes of the text (vocabulary 256)."""

    name = BYTES
    vocab_size = 256
    sha256 = None  # nothing to tell apart

    def encode(self, pieces: list[str]) -> list[np.ndarray]:
        """Token ids of each piece."""
        return [np.frombuffer(p.encode("utf-8"), dtype=np.uint8) for p in pieces]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; bytes that do not make a whole UTF-8 character decode as U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer(_Encoder):
    """A Hugging Face ``tokenizers`` tokenizer read from a local tokenizer.json (no network)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise PrepareError("the tokenizers package is not installed; "
                               "pip install 'asyncpp_ext[hf]' (or use --tokenizer bytes)") from None
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise PrepareError(f"tokenizer {path} is not readable ({exc.strerror}); fix its permissions") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception for malformed files
            if path.name == "tokenizer_config.json":  # the settings beside it, not the tokenizer
                raise PrepareError(f"tokenizer {path} is a tokenizer's settings, not the tokenizer; pass the "
                                   "tokenizer.json beside it") from None
            reason = first_line(exc)
            raise PrepareError(f"tokenizer {path} is not a tokenizers tokenizer.json ({reason}); "
                               "pass the tokenizer.json of a Hugging Face tokenizer") from None
        self.name = os.path.abspath(path)
        # the same tokenizer at another path, or re-saved, serialises alike (sidecars compare this)
        self.sha256 = hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()
        # Added tokens may sit above the base vocabulary; the id range is what a model must embed.
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True),
                              max(ids, default=-1) + 1)
        # encode_batch_fast (tokenizers >= 0.20.1) skips the character offsets, which go unused.
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def encode(self, pieces: list[str]) -> list[np.ndarray]:
        """Token ids of each piece, without special tokens (they would repeat at every piece)."""
        encodings = self._encode(pieces, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode_many(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        id_lists = [e.ids for e in self._encode(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64,
                          count=int(lengths.sum()))
        return ids, lengths

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tokenizer.token_to_id(token)

    def boundary_tokens(self) -> tuple[str, Optional[str], Optional[str]]:
        """The family's convention: BOS when the tokenizer's post-processor puts a special token
        before every text (Llama, Mistral, Gemma), else EOS when it has an end-of-text token
        (GPT-2, SmolLM, Qwen), else none."""
        try:
            config = json.loads(self.tokenizer.to_str())
        except Exception:  # pragma: no cover - to_str always works on a loaded tokenizer
            config = {}
        first = last = None
        todo = [config.get("post_processor") or {}]
        while todo:
            proc = todo.pop()
            if proc.get("type") == "Sequence":
                todo.extend(proc.get("processors") or [])
            elif proc.get("type") == "TemplateProcessing":
                single = proc.get("single") or []
                if single and "SpecialToken" in single[0]:
                    first = single[0]["SpecialToken"].get("id")
                if single and "SpecialToken" in single[-1]:
                    last = single[-1]["SpecialToken"].get("id")
        known = lambda names: next((n for n in names if self.token_to_id(n) is not None), None)  # noqa: E731
        eos = last if last is not None and self.token_to_id(last) is not None else known(EOS_NAMES)
        bos = first if first is not None and self.token_to_id(first) is not None else known(BOS_NAMES)
        if first is not None and bos == first:
            return "bos", eos, bos
        return ("eos" if eos else "none"), eos, bos


def load_tokenizer(spec: str):
    """``ByteTokenizer`` for "bytes", else an ``HFTokenizer`` from the tokenizer.json at ``spec``."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():  # a model's folder, as a download of its tokenizer leaves it
        if not (path / "tokenizer.json").is_file():
            raise PrepareError(f"tokenizer {spec} is a directory without a tokenizer.json; pass the "
                               "tokenizer.json file, or --tokenizer bytes")
        path = path / "tokenizer.json"
    elif not path.is_file():
        raise PrepareError(f"tokenizer file {spec} does not exist (or is not a file); pass a "
                           "tokenizer.json or --tokenizer bytes")
    return HFTokenizer(path)


def _texts_of(task: Task, text_field: str, lengths: np.ndarray, bad: list) -> tuple[list, list]:
    """(texts, their item indices) of a task; bad and blank items marked in ``lengths``/``bad``."""
    if task.kind == "text":
        return list(task.items), list(range(len(task.items)))
    if task.kind == "records":
        values = task.items.to_pylist() if hasattr(task.items, "to_pylist") else list(task.items)
        texts, index = [], []
        for i, value in enumerate(values):
            if value is None:
                lengths[i] = BAD
                bad.append((i, f"has a null {text_field!r}"))
            else:
                texts.append(value)
                index.append(i)
        return texts, index
    texts, index = [], []
    for i, raw in enumerate(task.items):
        if not raw.strip():
            lengths[i] = BLANK
            continue
        reason = None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            reason = f"is not UTF-8 (byte {exc.start} of the line)"
        else:
            if i == 0 and task.first == 1 and line.startswith("\ufeff"):
                line = line[1:]  # a byte-order mark at the start of the file
            if i == 0 and task.first == 1:
                _check_json_lines(task.path, line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                reason = f"is not valid JSON ({exc.msg}, column {exc.colno})"
            else:
                if not isinstance(record, dict):
                    reason = (f"is a JSON {type(record).__name__}, not an object with a "
                              f"{text_field!r} field")
                elif text_field not in record:
                    fields = ", ".join(list(record)[:8]) or "none"
                    reason = f"has no {text_field!r} field (fields: {fields}); pass --text-field NAME"
                elif not isinstance(record[text_field], str):
                    kind = "null" if record[text_field] is None else type(record[text_field]).__name__
                    reason = f"has {text_field!r} = {kind}, not a string"
        if reason is None:
            texts.append(record[text_field])
            index.append(i)
        else:
            lengths[i] = BAD
            bad.append((i, reason))
    return texts, index


def _why_not_encodable(text: str, exc: BaseException) -> str:
    """Why the tokenizer refused ``text``: a lone surrogate (a JSON escape such as \\ud800 with no
    partner) is not Unicode any encoder takes; anything else, the tokenizer's own words."""
    for position, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            return (f"holds a lone surrogate ({ascii(char)[1:-1]} at character {position}), which is not valid "
                    "Unicode")
    return f"has text the tokenizer cannot encode ({first_line(exc)})"


def _check_json_lines(path: str, first_line: str) -> None:
    """PrepareError where a .json file's first line shows one JSON document (an array of records,
    or an object spread over lines) rather than JSON lines: skipping its "bad lines" would keep
    whichever lines happen to parse."""
    start = first_line.strip()
    if start in ("[", "{") or (start.startswith("[") and start.endswith("]")):
        how = "jq -c '.[]'" if start.startswith("[") else "jq -c ."
        raise PrepareError(f"input {path} is one JSON document, not JSON lines (one object per line); convert "
                           f"it, e.g. {how} {path} > {Path(path).stem}.jsonl")


def encode_task(tokenizer, task: Task, text_field: str = "text"):
    """(ids in the token file's dtype, lengths int64 per item, bad [(index, reason)]) of one task."""
    n = len(task.items)
    lengths = np.zeros(n, dtype=np.int64)
    bad: list = []
    texts, index = _texts_of(task, text_field, lengths, bad)
    try:
        ids, counts = tokenizer.encode_many(texts)
    except Exception as exc:  # tokenizers raises plain Exception / TypeError for bad strings
        if task.kind == "text" or not texts:
            raise
        # One text the tokenizer refuses (a lone surrogate from a JSON escape): find it, mark it.
        parts, keep_counts = [], []
        for i, text in zip(list(index), texts):
            try:
                one, count = tokenizer.encode_many([text])
            except Exception:
                lengths[i] = BAD
                bad.append((i, _why_not_encodable(text, exc)))
                index.remove(i)
                continue
            parts.append(one)
            keep_counts.append(int(count[0]))
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        counts = np.asarray(keep_counts, dtype=np.int64)
        bad.sort()
    if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
        raise PrepareError(f"tokenizer {tokenizer.name} produced id {int(ids.max())} >= its "
                           f"vocabulary size {tokenizer.vocab_size}; check the tokenizer.json")
    lengths[np.asarray(index, dtype=np.int64)] = counts
    # In the file's dtype already: a quarter of the int64 bytes cross from a worker.
    return ids.astype(_token_dtype(tokenizer.vocab_size), copy=False), lengths, bad


def _token_dtype(vocab_size: int) -> np.dtype:
    from .sources import TOKEN_DTYPES, token_dtype_for_vocab

    return TOKEN_DTYPES[token_dtype_for_vocab(vocab_size)]


# ---- worker processes -----------------------------------------------------------------------
_WORKER: dict = {}


def _worker_init(tokenizer_spec: str, text_field: str, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if hasattr(signal, "pthread_sigmask"):  # started with it blocked (_WorkerProcess): a pending one is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_spec)
    _WORKER["text_field"] = text_field


def _worker_encode(task: Task):
    return encode_task(_WORKER["tokenizer"], task, _WORKER["text_field"])


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A tokenizer worker started with SIGINT blocked, which the fresh interpreter inherits: a
    Ctrl-C while it imports and unpickles would otherwise print its KeyboardInterrupt traceback
    beside the parent's one line. In the parent the signal waits out the start and is then
    delivered as usual; the worker ignores it (``_worker_init``)."""

    def start(self) -> None:
        if not hasattr(signal, "pthread_sigmask"):
            return super().start()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _WorkerContext(multiprocessing.context.SpawnContext):
    Process = _WorkerProcess


def ordered_encode(tasks: Iterable[Task], tokenizer, tokenizer_spec: str, text_field: str,
                   workers: int) -> Iterator[tuple[Task, tuple]]:
    """(task, encode_task result) for every task, in input order. workers > 1: that many spawned
    processes, at most 2 * workers + 1 tasks in flight (memory stays bounded); else in this process."""
    if workers <= 1:
        for task in tasks:
            yield task, encode_task(tokenizer, task, text_field)
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn: a fresh interpreter per worker; fork could copy a parent's locked mutexes (torch,
    # tokenizers' thread pool) into the child. An executor rather than multiprocessing.Pool: a
    # worker that dies (killed, out of memory) breaks the pool and every pending result raises,
    # where a Pool would start a replacement and wait for the lost result forever.
    pool = ProcessPoolExecutor(workers, mp_context=_WorkerContext(),
                               initializer=_worker_init, initargs=(tokenizer_spec, text_field, os.getpid()))
    try:
        pending: deque = deque()
        for task in tasks:
            pending.append((Task(task.kind, (), task.path, task.first, task.ends),
                            pool.submit(_worker_encode, task)))
            if len(pending) > 2 * workers:
                head, result = pending.popleft()
                yield head, result.result()
        while pending:
            head, result = pending.popleft()
            yield head, result.result()
    except BrokenProcessPool:
        raise PrepareError(f"a tokenizer worker process stopped (killed, out of memory, or its "
                           f"tokenizer failed to load) with {workers} workers; run again, with "
                           "fewer --workers if memory is short") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["BAD", "BLANK", "BOS_NAMES", "BYTES", "ByteTokenizer", "EOS_NAMES", "HFTokenizer",
           "PrepareError", "PrepareFailed", "Task", "encode_task", "load_tokenizer", "ordered_encode"]
