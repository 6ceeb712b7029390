"""Where ``asyncpp-prepare-data`` writes tokens: one ``.bin`` or shards of ``--shard-tokens`` ids
(``<stem>_000000.bin``, ...), each with its sidecar, plus a manifest for shards. Everything is
written to hidden temporary files beside the outputs and renamed only by ``commit_outputs`` once
the whole input succeeded (a failure removes them). Memory: one open file per output, nothing
held.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..directories import chmod_as_created
from ..stop_signals import Stopped, signals_handled
from .shards import MANIFEST_FORMAT, MANIFEST_VERSION, manifest_path, shard_path
from .sources import TOKEN_FORMAT, TOKEN_FORMAT_VERSION, scan_max_token_id, sidecar_path

COPY_CHUNK = 1 << 22
"""Tokens copied at a time when the tail of the output moves to the validation file."""


def _this_host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def temp_beside(path: Path) -> Path:
    """A new hidden temporary file beside ``path``, named after it, this host and this process
    (``.<name>.<host>-<pid>-<random>.tmp``), so that a later run can tell one whose process is
    gone (``remove_orphaned_temps``)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_this_host()}-{os.getpid()}-",
                                suffix=".tmp")
    os.close(fd)
    return Path(name)


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_orphaned_temps(directory: Path) -> list:
    """Remove the temporary files that runs on this host left in ``directory`` when they were killed
    outright (SIGKILL, the out-of-memory killer: no ``finally`` ran), each as large as the output
    it was becoming; a live run's (its process still runs, or it runs on another host of a
    shared file system) are left alone. Returns those removed."""
    pattern = re.compile(rf"\..+\.{re.escape(_this_host())}-(\d+)-[A-Za-z0-9_]+\.tmp")
    removed = []
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            match = pattern.fullmatch(entry.name)
            if match and not _process_runs(int(match[1])) and entry.is_file():
                entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


@dataclass
class _File:
    final: Path
    tmp: Path
    count: int = 0
    top: int = 0


@dataclass
class TokenSink:
    """One output: ``final`` itself, or shards of ``shard_tokens`` named after it."""

    final: Path
    dtype: np.dtype
    shard_tokens: Optional[int] = None
    files: list = field(default_factory=list)
    total: int = 0
    documents: int = 0
    _out: Optional[object] = None

    def _next_file(self) -> _File:
        self.close()
        final = shard_path(self.final, len(self.files)) if self.shard_tokens else self.final
        self.files.append(_File(final, temp_beside(final)))
        self._out = open(self.files[-1].tmp, "wb")
        return self.files[-1]

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while len(ids):
            current = self.files[-1] if self.files and self._out is not None else None
            if current is None or (self.shard_tokens and current.count >= self.shard_tokens):
                current = self._next_file()
            room = self.shard_tokens - current.count if self.shard_tokens else len(ids)
            part, ids = ids[:room], ids[room:]
            part.tofile(self._out)
            current.count += len(part)
            current.top = max(current.top, int(part.max()))
            self.total += len(part)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def take_tail(self, count: int) -> Iterator[np.ndarray]:
        """Remove the last ``count`` tokens, yielding them in order (in bounded chunks)."""
        self.close()
        cut, start = self.total - count, 0
        keep = []
        for f in self.files:
            lo, start = start, start + f.count
            if start <= cut:
                keep.append(f)
                continue
            tokens = np.memmap(f.tmp, dtype=self.dtype, mode="r")
            for i in range(max(cut - lo, 0), f.count, COPY_CHUNK):
                yield np.array(tokens[i: min(i + COPY_CHUNK, f.count)])
            del tokens
            if lo < cut:  # the cut falls inside this file
                f.count = cut - lo
                os.truncate(f.tmp, f.count * self.dtype.itemsize)
                f.top = scan_max_token_id(np.memmap(f.tmp, dtype=self.dtype, mode="r"))
                keep.append(f)
            else:
                f.tmp.unlink(missing_ok=True)
        self.files = keep
        self.total = cut

    def temps(self) -> list:
        return [f.tmp for f in self.files]


def _ours(path: Path, fmt: str) -> bool:
    """True when ``path`` (a sidecar or manifest) is JSON of format ``fmt``: written by this tool."""
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == fmt
    except (OSError, ValueError, AttributeError):
        return False


def _stale_outputs(sink: TokenSink) -> list[Path]:
    """Token files an earlier run with the same ``--out`` left that this run does not replace: the
    shards beyond the ones it wrote, and the outputs of the other mode (the single file when this
    run writes shards; every shard when it writes one file). A directory or glob would read them
    with the new ones. Only files with this tool's sidecar count: llm.c shards named alike stay."""
    pattern = re.compile(re.escape(sink.final.stem) + r"_(\d{6})" + re.escape(sink.final.suffix) + "$")
    keep = len(sink.files) if sink.shard_tokens else 0
    stale = [path for path in sink.final.parent.iterdir()
             if (match := pattern.match(path.name)) and int(match.group(1)) >= keep]
    if sink.shard_tokens and sink.final.exists():
        stale.append(sink.final)
    return sorted(p for p in stale if _ours(sidecar_path(p), TOKEN_FORMAT))


class StoppedAfterCommit(Stopped):
    """A stop signal arrived while the outputs were put in place; it was held until they all
    were, so they are complete."""


@contextlib.contextmanager
def _stop_signals_held():
    """Holds SIGINT, SIGTERM and SIGHUP so a stop request cannot leave the outputs half renamed:
    for the block their handlers only note the signal, and ``StoppedAfterCommit`` is raised once
    it is done. (Python runs handlers in the main thread only; elsewhere nothing is held. An
    ignored signal stays ignored.)"""
    arrived: list = []
    with signals_handled(lambda number, frame: arrived.append(number)):
        yield
    if arrived:
        raise StoppedAfterCommit(arrived[0])


def commit_outputs(sinks: list[TokenSink], base: dict, doc_fields: Optional[dict],
                   temps: list) -> tuple[dict, list, list]:
    """Write sidecars (and manifests) for every output file, then put everything in place: an
    earlier run's stale outputs removed, then each sidecar and its token file, manifests last.
    Returns ({token file: sidecar}, manifests, stale token files removed). ``temps`` collects the
    temporary names so a failure can remove them.

    The renames hold the stop signals. Should the process die all the same (SIGKILL, power),
    what is left reads as missing or as a size that disagrees with its sidecar or manifest,
    never as a token file without its sidecar (which would read as uint16 whatever it holds)."""
    headers, renames, manifests = {}, [], []
    for sink in sinks:
        sink.close()
        for f in sink.files:
            header = dict(base, num_tokens=f.count, max_token_id=f.top)
            if doc_fields is not None:
                header.update(doc_fields)
                if not sink.shard_tokens:
                    header["num_documents"] = sink.documents
            headers[f.final] = header
            side_tmp = temp_beside(sidecar_path(f.final))
            temps.append(side_tmp)
            side_tmp.write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
            renames.append((side_tmp, sidecar_path(f.final)))
            renames.append((f.tmp, f.final))
        if sink.shard_tokens:
            manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                        "dtype": base["dtype"], "vocab_size": base["vocab_size"],
                        "tokenizer": base["tokenizer"], "num_tokens": sink.total,
                        "max_token_id": max(f.top for f in sink.files),
                        "shard_tokens": sink.shard_tokens,
                        "doc_boundary": (doc_fields or {}).get("doc_boundary", "none")}
            if doc_fields is not None:
                manifest.update(doc_fields, num_documents=sink.documents)
            manifest["shards"] = [{"file": f.final.name, "num_tokens": f.count} for f in sink.files]
            path = manifest_path(sink.final)
            tmp = temp_beside(path)
            temps.append(tmp)
            tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            manifests.append((tmp, path))
    stale = [p for sink in sinks for p in _stale_outputs(sink)]
    stale_manifests = [manifest_path(sink.final) for sink in sinks if not sink.shard_tokens
                       and _ours(manifest_path(sink.final), MANIFEST_FORMAT)]
    with _stop_signals_held():
        for path in stale:  # removed first: a stop in between leaves data missing, never doubled
            path.unlink(missing_ok=True)  # before its sidecar, as placing goes the other way
            sidecar_path(path).unlink(missing_ok=True)
        for path in stale_manifests:
            path.unlink(missing_ok=True)
        for tmp, final in renames + manifests:
            chmod_as_created(tmp)
            os.replace(tmp, final)
        temps.clear()
    return headers, [final for _, final in manifests], stale


def base_header(dtype_name: str, vocab_size: int, tokenizer: str, tokenizer_sha256: Optional[str] = None) -> dict:
    header = {"format": TOKEN_FORMAT, "version": TOKEN_FORMAT_VERSION, "dtype": dtype_name,
              "num_tokens": 0, "vocab_size": vocab_size, "max_token_id": 0, "tokenizer": tokenizer}
    if tokenizer_sha256 is not None:
        header["tokenizer_sha256"] = tokenizer_sha256
    return header


__all__ = ["StoppedAfterCommit", "TokenSink", "base_header", "commit_outputs", "remove_orphaned_temps",
           "temp_beside"]
