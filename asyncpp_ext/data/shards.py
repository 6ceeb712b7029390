"""Several token files read as one: ``--data`` / ``--val-data`` given a glob, a directory or a
manifest of shards.

``resolve_token_paths(spec)`` turns the spec into the ordered list of ``.bin`` files it names:

* a glob (``data/train_*.bin``, quoted so the shell leaves it alone): its matches, sorted by name;
* a directory: every ``*.bin`` directly in it, sorted by name (keep validation shards elsewhere,
  or give a glob);
* a manifest written by ``asyncpp-prepare-data --shard-tokens`` (``<stem>.manifest.json``): its
  shards in its order, each checked to hold the token count the manifest lists.

``TokenShards`` joins the memory-mapped shards into one read-only sequence of ids, so the batch
stream, the held-out split and the id check treat a thousand shards exactly like one file: a
window that crosses a shard boundary reads the end of one shard and the start of the next. Slices
are views (nothing is read until an array is asked for), so a split of a 100 GB corpus costs
nothing, and only the windows a batch draws are read.
"""
from __future__ import annotations

import glob as globlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .errors import DataError, first_line

MANIFEST_FORMAT = "asyncpp-token-shards"
"""The ``format`` field of a shard manifest."""
MANIFEST_VERSION = 1
MANIFEST_SUFFIX = ".manifest.json"
GLOB_CHARS = "*?["


def manifest_path(out: str | os.PathLike) -> Path:
    """The manifest of the shards written for ``--out``: ``data/train.bin`` -> ``data/train.manifest.json``."""
    out = Path(out)
    return out.with_name(out.stem + MANIFEST_SUFFIX)


def shard_path(out: str | os.PathLike, index: int) -> Path:
    """Shard ``index`` written for ``--out``: ``data/train.bin`` -> ``data/train_000003.bin``."""
    out = Path(out)
    return out.with_name(f"{out.stem}_{index:06d}{out.suffix}")


def is_multi_spec(spec: str) -> bool:
    """True when ``spec`` names several token files: a glob, a directory or a manifest."""
    path = Path(spec)
    if path.is_dir() or spec.endswith(MANIFEST_SUFFIX):
        return True
    return not path.exists() and any(c in spec for c in GLOB_CHARS)


def _read_manifest(path: Path) -> list[tuple[Path, int]]:
    """(shard path, num_tokens) of each shard a manifest lists, in order."""
    regenerate = "regenerate the shards with asyncpp-prepare-data --shard-tokens"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"manifest {path} does not exist; pass an existing manifest, a directory "
                        "or a glob of .bin shards") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = first_line(exc)
        raise DataError(f"manifest {path} is not readable JSON ({reason}); {regenerate}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"manifest {path} is not an {MANIFEST_FORMAT!r} manifest; {regenerate}")
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(f"manifest {path} has version {manifest.get('version')!r}; this asyncpp reads "
                        f"version {MANIFEST_VERSION}; {regenerate}")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards or not all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and type(s.get("num_tokens")) is int
            for s in shards):
        raise DataError(f"manifest {path} has no valid 'shards' list; {regenerate}")
    return [(path.parent / s["file"], s["num_tokens"]) for s in shards]


def resolve_token_paths(spec: str, flag: str = "--data") -> tuple[list[Path], Optional[list[int]]]:
    """The token files ``spec`` names, in reading order, and (for a manifest) the token count
    each must hold. A spec naming nothing is a ``DataError``."""
    path = Path(spec)
    if spec.endswith(MANIFEST_SUFFIX):
        pairs = _read_manifest(path)
        return [p for p, _ in pairs], [n for _, n in pairs]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".bin" and p.is_file()
                       and not p.name.startswith("."))
        if not files:
            raise DataError(f"{flag} {spec} is a directory without .bin token files; pass a "
                            "directory of shards, a quoted glob like 'data/train_*.bin', or a file")
        return files, None
    if path.exists() or not any(c in spec for c in GLOB_CHARS):
        return [path], None
    # Sidecars and manifests beside the shards belong to them: a pattern like data/train_* may match them.
    files = sorted(Path(p) for p in globlib.glob(spec, recursive=True) if Path(p).is_file()
                   and not p.endswith((".bin.json", MANIFEST_SUFFIX)))
    if not files:
        raise DataError(f"{flag} {spec} matches no file; check the pattern (quote it so the shell "
                        "does not expand it)")
    odd = [p for p in files if p.suffix != ".bin"]
    if odd:
        raise DataError(f"{flag} {spec} matches {odd[0]}, which is not a .bin token file; narrow "
                        "the pattern to the .bin shards")
    return files, None


class TokenShards:
    """Read-only concatenation of 1-D token arrays (memory-mapped shards), without copying.

    Supports what the data path uses of an ndarray: ``len``, ``dtype``, integer indexing, slicing
    with step 1 (a view: another ``TokenShards``, or the shard's own slice when it lies in one
    shard), ``np.asarray`` (reads the ids in range), ``max()`` and ``tolist()``.
    """

    ndim = 1

    def __init__(self, parts: Sequence[np.ndarray], names: Optional[Sequence[str]] = None,
                 start: int = 0, stop: Optional[int] = None):
        self.parts = list(parts)
        self.names = list(names) if names is not None else [f"part {i}" for i in range(len(parts))]
        lengths = np.array([len(p) for p in self.parts], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        total = int(self.offsets[-1])
        self.start = start
        self.stop = total if stop is None else stop
        self.dtype = np.result_type(*[p.dtype for p in self.parts]) if self.parts else np.dtype("<u2")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def num_shards(self) -> int:
        return len(self.parts)

    def _locate(self, index: int) -> tuple[int, int]:
        """(shard, offset in it) of absolute position ``index``."""
        shard = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return shard, index - int(self.offsets[shard])

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("TokenShards supports slices with step 1 only")
            hi = max(hi, lo)
            a, b = self.start + lo, self.start + hi
            if b > a:
                first, off = self._locate(a)
                if b - a <= len(self.parts[first]) - off:  # inside one shard: its own view
                    return self.parts[first][off: off + (b - a)]
            return TokenShards(self.parts, self.names, a, b)
        index = int(key)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {key} out of range for {len(self)} tokens")
        shard, off = self._locate(self.start + index)
        return self.parts[shard][off]

    def chunks(self, size: int = 1 << 24):
        """The ids in order, as arrays of at most ``size`` (views of the shards)."""
        pos = self.start
        while pos < self.stop:
            shard, off = self._locate(pos)
            take = min(size, len(self.parts[shard]) - off, self.stop - pos)
            yield self.parts[shard][off: off + take]
            pos += take

    def __array__(self, dtype=None, copy=None):
        out = np.empty(len(self), dtype=dtype or self.dtype)
        at = 0
        for chunk in self.chunks():
            out[at: at + len(chunk)] = chunk
            at += len(chunk)
        return out

    def max(self):
        if len(self) == 0:
            raise ValueError("max of no tokens")
        return max(int(chunk.max()) for chunk in self.chunks())

    def tolist(self) -> list:
        return np.asarray(self).tolist()

    def __repr__(self) -> str:
        return f"TokenShards({len(self)} tokens in {self.num_shards} shards)"


__all__ = ["MANIFEST_FORMAT", "MANIFEST_VERSION", "MANIFEST_SUFFIX", "TokenShards", "is_multi_spec",
           "manifest_path", "resolve_token_paths", "shard_path"]
