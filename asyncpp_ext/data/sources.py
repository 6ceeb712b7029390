"""Token sources (``load_tokens``):
  * ``"builtin"``: the source text of Python's own standard library (a sorted, size-capped subset of
    its ``.py`` files), read at run time, so every machine with Python has a corpus;
  * a UTF-8 text file: its bytes are the tokens (vocabulary 256);
  * a ``.bin`` file of little-endian uint16 token ids (memory-mapped).
"""
from __future__ import annotations

import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

BUILTIN = "builtin"
BUILTIN_MAX_BYTES = 4_000_000
"""Cap of the built-in corpus: enough text for the presets, small enough to read in a blink."""


class DataError(ValueError):
    """A data source that cannot feed training; the message names the file and the fix."""


@lru_cache(maxsize=2)
def builtin_corpus(max_bytes: int = BUILTIN_MAX_BYTES) -> np.ndarray:
    """UTF-8 bytes of the standard library's ``.py`` files, in sorted path order, up to max_bytes.

    Test suites and vendored packages are skipped (they repeat a lot of boilerplate); files that
    are not valid UTF-8 are skipped so every byte is real text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk's order deterministic across file systems.
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "test", "tests",
                                          "idlelib", "__pycache__") and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                raw = (Path(dirpath) / name).read_bytes()
                raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            take = raw[: max_bytes - total]
            chunks.append(take)
            total += len(take)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if total == 0:
        raise DataError(f"builtin corpus: no readable .py files under {root}; "
                        "pass --data PATH with a text file instead")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_tokens(source: str, vocab_size: int = 256) -> np.ndarray:
    """Token ids of ``source`` ("builtin", a UTF-8 text file or a uint16 ``.bin`` file)."""
    if source == BUILTIN:
        tokens = builtin_corpus()
    else:
        path = Path(source)
        if not path.is_file():
            raise DataError(f"data file {source} does not exist (or is not a file); "
                            "pass an existing text/.bin file or --data builtin")
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"data file {source} is empty; pass a file with text in it")
        if path.suffix == ".bin":
            if size % 2:
                raise DataError(f"data file {source} has an odd byte length ({size}); a .bin file "
                                "must hold uint16 token ids (2 bytes each) - regenerate it")
            tokens = np.memmap(path, dtype="<u2", mode="r")
        else:
            raw = path.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"data file {source} is not UTF-8 text (byte {exc.start}); convert "
                                "it to UTF-8 or give a pre-tokenized uint16 .bin file") from None
            tokens = np.frombuffer(raw, dtype=np.uint8)
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"data {source} holds token id {top} but the model's vocab_size is "
                        f"{vocab_size}; use data whose ids are < {vocab_size}")
    return tokens


__all__ = ["BUILTIN", "BUILTIN_MAX_BYTES", "DataError", "builtin_corpus", "load_tokens"]
