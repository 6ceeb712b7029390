"""What ``asyncpp-prepare-data --input`` reads: input specs expanded to files, and the readers of
JSON lines (plain, ``.gz``, ``.zst``), Parquet and Arrow (a ``datasets`` ``save_to_disk``
directory) that cut them into ``Task``s of consecutive records. Text files are read by
``text_pieces.read_text_pieces``.

Expansion (``expand_inputs``): each ``--input`` is a file, a directory or a glob, in the order
given; a directory expands to its data files (``DATA_SUFFIXES``, hidden entries skipped), a glob
to its matches, both in sorted path order, leaving out the token files, sidecars and manifests
this tool writes (``TOKEN_OUTPUT_SUFFIXES``); a subdirectory that cannot be listed is an error, not
skipped. A directory saved by ``datasets``' ``save_to_disk`` (``state.json`` +
``dataset_info.json``) expands to its Arrow files in the dataset's order.
"""
from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from .encode import PrepareError, Task
from .errors import first_line
from .shards import MANIFEST_SUFFIX

TEXT, JSONL, PARQUET, ARROW = "text", "jsonl", "parquet", "arrow"
COMPRESSION_SUFFIXES = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
KIND_SUFFIXES = {".jsonl": JSONL, ".ndjson": JSONL, ".json": JSONL, ".parquet": PARQUET,
                 ".arrow": ARROW, ".txt": TEXT}
"""Suffixes read as data (after a compression suffix); an explicitly named file with another
suffix is read as text."""
DATA_SUFFIXES = tuple(KIND_SUFFIXES)
TASK_BYTES = 1 << 20
"""Raw JSON lines per task (bytes), so a task is ~0.1-0.5 s of tokenizer work."""
RECORDS_PER_TASK = 512
"""Parquet / Arrow rows per task."""
DATA_EXTRA = "pip install 'asyncpp_ext[data]'"


@dataclass(frozen=True)
class Input:
    path: Path
    kind: str
    compression: Optional[str] = None


UNREAD_COMPRESSION = {".xz": "xz", ".lzma": "xz", ".bz2": "bzip2", ".zip": "zip", ".7z": "7-Zip",
                      ".tar": "tar", ".tgz": "tar.gz", ".lz4": "lz4", ".br": "brotli"}
"""Archives and compressions read as nothing but bytes: named, not taken for text that is not UTF-8."""


def classify(path: Path) -> Input:
    """The reader for a file: by its suffixes (``x.jsonl.zst`` is zstd-compressed JSON lines)."""
    unread = UNREAD_COMPRESSION.get(path.suffix.lower())
    if unread is not None:
        raise PrepareError(f"input {path} is {unread}, which is not read; unpack or decompress it (.gz and .zst "
                           "JSON lines are read as they are)")
    if _is_token_output(path) and path.suffix.lower() == ".bin":
        raise PrepareError(f"input {path} is a token file (.bin), not text; name the text it was made from, "
                           "or pass the token file to asyncpp-train --data")
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = COMPRESSION_SUFFIXES.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = KIND_SUFFIXES.get(suffixes[-1], TEXT) if suffixes else TEXT
    if compression and kind in (PARQUET, ARROW):
        raise PrepareError(f"input {path}: a compressed {kind} file is not supported (Parquet "
                           "compresses inside the file); decompress it first")
    return Input(path, kind, compression)


TOKEN_OUTPUT_SUFFIXES = (".bin", ".bin.json", MANIFEST_SUFFIX)
"""What ``asyncpp-prepare-data`` itself writes (token files, their sidecars, shard manifests): never
read from a directory or glob, so a run whose --out lies inside its input directory reads the same
inputs when it is run again."""


def _is_token_output(path: Path) -> bool:
    return path.name.lower().endswith(TOKEN_OUTPUT_SUFFIXES)


def _is_data_file(path: Path) -> bool:
    if _is_token_output(path):
        return False
    name = path.name.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.endswith(DATA_SUFFIXES)


def saved_dataset_files(directory: Path) -> Optional[list[Input]]:
    """The Arrow files of a ``save_to_disk`` directory, None for any other directory."""
    if (directory / "dataset_dict.json").is_file():
        try:
            splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        raise PrepareError(f"input {directory} is a DatasetDict saved with save_to_disk (splits: "
                           f"{', '.join(map(str, splits)) or '?'}); pass one split's directory, e.g. "
                           f"{directory / (splits[0] if splits else 'train')}")
    state = directory / "state.json"
    if not (state.is_file() and (directory / "dataset_info.json").is_file()):
        return None
    try:
        files = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrepareError(f"input {directory}: state.json of the saved dataset is not readable "
                           f"({type(exc).__name__}); save the dataset again with save_to_disk") from None
    return [Input(directory / f, ARROW) for f in files]


def _expand_directory(directory: Path) -> list[Input]:
    """A directory's data files in sorted path order; a saved dataset (the directory itself or
    one inside it) contributes its Arrow files, in the dataset's order, at its place."""
    saved = saved_dataset_files(directory)
    if saved is not None:
        return saved
    found: list[tuple[str, list[Input]]] = []
    def unreadable(exc: OSError):  # os.walk would skip the directory and read the rest
        raise PrepareError(f"input directory {exc.filename} could not be read ({exc.strerror}); "
                           "fix its permissions, or pass the files or directories to read")

    for dirpath, dirnames, filenames in os.walk(directory, onerror=unreadable):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            inner = saved_dataset_files(here / d)
            if inner is None:
                keep.append(d)
            else:
                found.append((str(here / d) + os.sep, inner))
        dirnames[:] = keep
        for name in filenames:
            path = here / name
            if not name.startswith(".") and _is_data_file(path):
                found.append((str(path), [classify(path)]))
    return [item for _, items in sorted(found, key=lambda pair: pair[0]) for item in items]


def expand_inputs(specs: Sequence[str]) -> list[Input]:
    """Every file the ``--input`` specs name, in reading order. PrepareError for a spec that
    names nothing, or a file that cannot be opened."""
    inputs: list[Input] = []
    named_by: dict[Path, str] = {}  # resolved path -> the spec that named it
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = _expand_directory(path)
            if not found:
                raise PrepareError(f"input {spec} is a directory with no input files (*.jsonl, "
                                   "*.json, *.parquet, *.arrow, *.txt, optionally .gz / .zst); "
                                   "pass files, a glob, or another directory")
        elif path.is_file():
            found = [classify(path)]
        elif any(c in spec for c in "*?["):
            matches = sorted(globlib.glob(spec, recursive=True))
            if not matches:
                raise PrepareError(f"input {spec} matches no file; check the pattern")
            found = []
            for match in map(Path, matches):
                found.extend(_expand_directory(match) if match.is_dir() else
                             [classify(match)] if match.is_file() and not _is_token_output(match)
                             else [])
            if not found:
                raise PrepareError(f"input {spec} matches no readable input file; check the pattern")
        elif path.exists():  # a pipe, a device, standard input
            raise PrepareError(f"input {spec} is not a regular file (pipes, devices and standard input are "
                               "not read); write it to a file first")
        else:
            raise PrepareError(f"input {spec} does not exist; pass files, directories or globs of text, "
                               "JSONL or Parquet")
        for item in found:
            try:
                with open(item.path, "rb"):
                    pass
            except OSError as exc:
                raise PrepareError(f"input {item.path} is not readable ({exc.strerror}); fix its "
                                   "permissions") from None
        for item in found:  # read twice, its documents would train twice, or in both splits
            key = item.path.resolve()
            if key in named_by:
                by = "" if named_by[key] == spec else f" (by {named_by[key]} and by {spec})"
                raise PrepareError(f"input {item.path} is named twice{by}; name each file once")
            named_by[key] = spec
        inputs.extend(found)
    return inputs


# ---- opening ----------------------------------------------------------------------------------
ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = 0x184D2A50
"""A skippable frame's magic, with any value in its low four bits."""


def zstd_cut_short(path: Path, zstandard) -> Optional[str]:
    """Why ``path`` is not whole zstd frames end to end, or None when it is. Read from the frame
    and block headers alone (a seek per block): zstandard's stream readers end quietly where a
    cut-short file ends, so a truncated download would otherwise pass for a shorter corpus."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        at = 0
        while at < size:
            f.seek(at)
            head = f.read(18)  # the longest frame header
            magic = int.from_bytes(head[:4], "little")
            if magic & 0xFFFFFFF0 == ZSTD_SKIPPABLE:
                at += 8 + int.from_bytes(head[4:8], "little")
                continue
            if magic != ZSTD_MAGIC:
                return f"byte {at} does not start a zstd frame"
            try:
                at += zstandard.frame_header_size(head)
                checksum = zstandard.get_frame_parameters(head).has_checksum
            except zstandard.ZstdError:
                return f"it ends inside the frame header at byte {at}"
            last = False
            while not last:
                f.seek(at)
                block = f.read(3)
                if len(block) < 3:
                    return f"it ends inside a frame ({size} bytes)"
                value = int.from_bytes(block, "little")
                last, kind, length = value & 1, (value >> 1) & 3, value >> 3
                at += 3 + (1 if kind == 1 else length)  # an RLE block stores its one byte
            at += 4 if checksum else 0
        if at > size:
            return f"it ends inside a frame ({size} bytes)"
    return None


class _Opened:
    """A binary reader of an input, decompressed, and the raw file under it (its position is the
    progress through the file)."""

    def __init__(self, item: Input):
        self.raw = open(item.path, "rb")
        try:
            if item.compression == "gz":
                self.reader = gzip.GzipFile(fileobj=self.raw, mode="rb")
            elif item.compression == "zst":
                try:
                    import zstandard
                except ImportError:
                    raise PrepareError(f"input {item.path} is zstd-compressed and the zstandard "
                                       f"package is not installed; {DATA_EXTRA}") from None
                reason = zstd_cut_short(item.path, zstandard)
                if reason is not None:
                    raise PrepareError(f"input {item.path} is damaged or cut short ({reason}); "
                                       "download it again")
                stream = zstandard.ZstdDecompressor().stream_reader(self.raw, read_across_frames=True)
                self.reader = io.BufferedReader(stream, buffer_size=1 << 20)
            else:
                self.reader = self.raw
        except BaseException:
            self.raw.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.reader is not self.raw:
            try:
                self.reader.close()
            except Exception:  # a damaged stream may complain again on close
                pass
        self.raw.close()

    def position(self) -> int:
        return self.raw.tell()


def stream_errors() -> tuple:
    """Exceptions a damaged or truncated compressed stream raises while being read."""
    errors = [EOFError, gzip.BadGzipFile, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def open_input(item: Input) -> _Opened:
    return _Opened(item)


# ---- JSON lines ---------------------------------------------------------------------------------
def read_jsonl_tasks(item: Input, on_bytes: Callable[[int], None]) -> Iterator[Task]:
    """Tasks of raw lines (about TASK_BYTES each); parsing happens where the task is encoded."""
    with open_input(item) as opened:
        lines: list = []
        size, first, number, last = 0, 1, 0, 0
        for line in opened.reader:
            number += 1
            lines.append(line)
            size += len(line)
            if size >= TASK_BYTES:
                now = opened.position()
                on_bytes(now - last)
                last = now
                yield Task("jsonl", lines, str(item.path), first)
                lines, size, first = [], 0, number + 1
        if lines:
            yield Task("jsonl", lines, str(item.path), first)
        on_bytes(opened.position() - last)


# ---- Parquet and Arrow --------------------------------------------------------------------------
def _pyarrow(item: Input):
    try:
        import pyarrow
    except ImportError:
        raise PrepareError(f"input {item.path} is {item.kind}, which needs the pyarrow package; "
                           f"{DATA_EXTRA}") from None
    return pyarrow


class ColumnError(PrepareError):
    """A Parquet / Arrow file without a text column named ``--text-field``: a wrong flag or a
    corpus of mixed schemas, not a damaged file, so ``--skip-bad-records`` does not skip it."""


def _check_column(item: Input, schema, text_field: str, pa) -> None:
    if text_field not in schema.names:
        raise ColumnError(f"input {item.path} has no column {text_field!r} (columns: "
                           f"{', '.join(schema.names[:12])}); pass --text-field NAME")
    kind = schema.field(text_field).type
    textual = [pa.types.is_string, pa.types.is_large_string]
    if hasattr(pa.types, "is_string_view"):
        textual.append(pa.types.is_string_view)
    if not any(test(kind) for test in textual):
        raise ColumnError(f"input {item.path}: column {text_field!r} holds {kind}, not text; "
                           "pass --text-field with the column of the documents' text")


def read_parquet_tasks(item: Input, text_field: str, on_bytes: Callable[[int], None]) -> Iterator[Task]:
    pa = _pyarrow(item)
    import pyarrow.parquet as pq

    size = item.path.stat().st_size
    try:
        pfile = pq.ParquetFile(item.path)
    except (pa.ArrowException, OSError) as exc:
        reason = first_line(exc)
        raise PrepareError(f"input {item.path} is not a readable Parquet file ({reason}); it may be "
                           "cut short: download it again") from None
    _check_column(item, pfile.schema_arrow, text_field, pa)
    rows, done, reported = max(pfile.metadata.num_rows, 1), 0, 0
    try:
        for batch in pfile.iter_batches(batch_size=RECORDS_PER_TASK, columns=[text_field]):
            column = batch.column(0)
            yield Task("records", column, str(item.path), done)
            done += len(column)
            now = size * min(done, rows) // rows
            on_bytes(now - reported)
            reported = now
    except (pa.ArrowException, OSError) as exc:
        reason = first_line(exc)
        raise PrepareError(f"input {item.path} is damaged after row {done} ({reason}); download "
                           "it again") from None
    on_bytes(size - reported)


def read_arrow_tasks(item: Input, text_field: str, on_bytes: Callable[[int], None]) -> Iterator[Task]:
    """An Arrow IPC file or stream (what ``datasets``' save_to_disk writes)."""
    pa = _pyarrow(item)
    size = item.path.stat().st_size
    with pa.memory_map(str(item.path)) as source:
        try:
            try:
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
                schema = reader.schema
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                schema = reader.schema
        except (pa.ArrowException, OSError) as exc:
            reason = first_line(exc)
            raise PrepareError(f"input {item.path} is not a readable Arrow file ({reason}); save the "
                               "dataset again") from None
        _check_column(item, schema, text_field, pa)
        done, reported = 0, 0
        try:
            for batch in batches:
                column = batch.column(schema.get_field_index(text_field))
                for start in range(0, len(column), RECORDS_PER_TASK):
                    part = column.slice(start, RECORDS_PER_TASK)
                    yield Task("records", part, str(item.path), done)
                    done += len(part)
                now = min(source.tell(), size)
                on_bytes(now - reported)
                reported = now
        except (pa.ArrowException, OSError) as exc:
            reason = first_line(exc)
            raise PrepareError(f"input {item.path} is damaged after row {done} ({reason}); save the "
                               "dataset again") from None
        on_bytes(size - reported)


__all__ = ["ARROW", "ColumnError", "Input", "JSONL", "PARQUET", "TEXT", "classify", "expand_inputs", "open_input",
           "read_arrow_tasks", "read_jsonl_tasks", "read_parquet_tasks", "saved_dataset_files",
           "stream_errors"]
