"""Where ``asyncpp-prepare-data`` writes tokens: one ``.bin`` or shards of ``--shard-tokens`` ids
(``<stem>_000000.bin``, ...), each with its sidecar, plus a manifest for shards. Everything is
written to hidden temporary files beside the outputs and renamed only by ``commit_outputs`` once
the whole input succeeded; ``discard`` removes them. Memory: one open file per output, nothing
held.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .shards import MANIFEST_FORMAT, MANIFEST_VERSION, manifest_path, shard_path
from .sources import TOKEN_FORMAT, TOKEN_FORMAT_VERSION, scan_max_token_id, sidecar_path

COPY_CHUNK = 1 << 22
"""Tokens copied at a time when the tail of the output moves to the validation file."""


def temp_beside(path: Path) -> Path:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


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


def _stale_shards(sink: TokenSink) -> list[Path]:
    """Shards of an earlier run with the same name beyond the ones this run wrote."""
    pattern = re.compile(re.escape(sink.final.stem) + r"_(\d{6})" + re.escape(sink.final.suffix) + "$")
    stale = []
    for path in sink.final.parent.iterdir():
        match = pattern.match(path.name)
        if match and int(match.group(1)) >= len(sink.files):
            stale.append(path)
    return sorted(stale)


def commit_outputs(sinks: list[TokenSink], base: dict, doc_fields: Optional[dict],
                   temps: list) -> tuple[dict, list, list]:
    """Write sidecars (and manifests) for every output file, then rename everything into place:
    token files, sidecars, manifests last. Returns ({token file: sidecar}, manifests, stale
    shards removed). ``temps`` collects the temporary names so a failure can remove them."""
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
            renames.append((f.tmp, f.final))
            renames.append((side_tmp, sidecar_path(f.final)))
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
    stale = [p for sink in sinks if sink.shard_tokens for p in _stale_shards(sink)]
    umask = os.umask(0)
    os.umask(umask)
    for tmp, final in renames + manifests:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes owner-only files
        os.replace(tmp, final)
    temps.clear()
    for path in stale:  # an earlier, longer run's shards would join a glob of these
        path.unlink(missing_ok=True)
        sidecar_path(path).unlink(missing_ok=True)
    return headers, [final for _, final in manifests], stale


def base_header(dtype_name: str, vocab_size: int, tokenizer: str) -> dict:
    return {"format": TOKEN_FORMAT, "version": TOKEN_FORMAT_VERSION, "dtype": dtype_name,
            "num_tokens": 0, "vocab_size": vocab_size, "max_token_id": 0, "tokenizer": tokenizer}


__all__ = ["TokenSink", "base_header", "commit_outputs", "temp_beside"]
