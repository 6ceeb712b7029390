"""Token sources (``load_tokens``):
  * ``"builtin"``: the source text of Python's own standard library (a sorted, size-capped subset of
    its ``.py`` files), read at run time, so every machine with Python has a corpus;
  * a UTF-8 text file: its bytes are the tokens (vocabulary 256);
  * a ``.bin`` token file (always memory-mapped, so it may be larger than RAM).

Token file format (``.bin``)
----------------------------
A ``.bin`` file is a flat array of little-endian token ids with no header, so a file written by
nanoGPT's ``prepare.py`` is read as is. Its element type comes from an optional *sidecar* JSON file
next to it, named ``<file>.bin.json`` (``asyncpp-prepare-data`` writes one)::

    {"format": "asyncpp-tokens", "version": 1, "dtype": "uint16",
     "num_tokens": 1000000, "vocab_size": 50257, "max_token_id": 50256,
     "tokenizer": "/abs/path/tokenizer.json"}

* ``dtype``: ``"uint16"`` or ``"uint32"``; uint32 only when a vocabulary's ids do not fit in 16 bits
  (``token_dtype_for_vocab``).
* ``num_tokens``: number of ids in the file; the file holds exactly ``num_tokens * itemsize`` bytes.
* ``vocab_size``: size of the tokenizer's vocabulary (the ``--vocab-size`` a model needs).
* ``max_token_id``: largest id in the file; lets the id check skip a pass over a huge file.
* ``tokenizer``: the tokenizer.json it was made with, or ``"bytes"`` (ids are UTF-8 bytes).
* ``tokenizer_sha256`` (optional, Hugging Face tokenizers): the SHA-256 of the tokenizer's
  serialised form (``Tokenizer.to_str()``), so the same tokenizer at another path is recognised.

Shards of one ``--data``, and ``--data`` against ``--val-data``, must come from one tokenizer: a
difference the sidecars show (bytes against a tokenizer, another vocabulary size, another
``tokenizer_sha256``) is a ``DataError`` (``tokenizer_of``, ``tokenizers_differ``). Text files
and the built-in corpus count as ``"bytes"``; a file without a sidecar says nothing.

Without a sidecar the file is read as uint16 (nanoGPT's format) and its largest id is found by
scanning it in chunks. Every inconsistency (bad sidecar, size not matching the dtype or the sidecar,
an id the model's vocabulary cannot embed) is a ``DataError`` naming the file and the fix.

llm.c / modded-nanogpt shards
-----------------------------
A ``.bin`` without a sidecar whose first int32 is ``20240520`` is an llm.c shard (the FineWeb
shards llm.c and modded-nanogpt publish): a header of 256 little-endian int32 -- magic 20240520,
version 1, token count -- then that many uint16 ids. llm.c's LLaMA-3 variant (magic 20240801,
version 7) holds uint32 ids. The header is checked (version, and the count against the file size);
a file with a header of that shape but another magic, or another llm.c file (a model checkpoint,
20240326; an eval file, 20240522), is refused with one line. Such a file is memory-mapped past its
header.

Several files
-------------
``load_tokens`` also takes a glob, a directory of ``.bin`` shards or a shard manifest
(``shards.resolve_token_paths``); the shards, each checked as above, read as one sequence
(``shards.TokenShards``), in sorted name order (manifest order for a manifest).
"""
from __future__ import annotations

import json
import numbers
import os
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import DataError

BUILTIN = "builtin"
BUILTIN_MAX_BYTES = 4_000_000
"""Cap of the built-in corpus: enough text for the presets, small enough to read in a blink."""

TOKEN_FORMAT = "asyncpp-tokens"
"""The ``format`` field of a token file's sidecar."""
TOKEN_FORMAT_VERSION = 1
"""The sidecar version this code writes and reads."""
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Sidecar ``dtype`` names and the little-endian numpy types they stand for."""
SCAN_CHUNK_TOKENS = 16 * 1024 * 1024
"""Tokens read at a time when a token file is scanned for its largest id (bounds the memory used)."""


@lru_cache(maxsize=2, typed=True)  # typed: True is checked, not taken as a cached 1
def builtin_corpus(max_bytes: Optional[int] = BUILTIN_MAX_BYTES) -> np.ndarray:
    """UTF-8 bytes of the standard library's ``.py`` files, in sorted path order, up to max_bytes
    (None: all of them).

    Test suites and vendored packages are skipped (they repeat a lot of boilerplate); files that
    are not valid UTF-8 are skipped so every byte is real text.
    """
    if max_bytes is not None:
        integer = isinstance(max_bytes, numbers.Integral) and not isinstance(max_bytes, bool)
        if not integer or max_bytes < 0:
            raise (ValueError if integer else TypeError)(
                f"max_bytes must be an integer >= 0 (or None), got {max_bytes!r}")
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
            take = raw if max_bytes is None else raw[: max_bytes - total]
            chunks.append(take)
            total += len(take)
            if max_bytes is not None and total >= max_bytes:
                return np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if total == 0:
        raise DataError(f"builtin corpus: no readable .py files under {root}; "
                        "pass --data PATH with a text file instead")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def token_dtype_for_vocab(vocab_size: int) -> str:
    """Sidecar dtype name for a vocabulary: ``"uint16"`` while every id (< vocab_size) fits in 16
    bits, i.e. vocab_size <= 65536, else ``"uint32"``."""
    if vocab_size < 1:
        raise DataError(f"vocabulary size {vocab_size} is not positive; check the tokenizer")
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise DataError(f"vocabulary size {vocab_size} does not fit in uint32 token ids; "
                    "use a tokenizer with fewer than 2**32 tokens")


def sidecar_path(path: str | os.PathLike) -> Path:
    """The sidecar of a token file: ``<file>.bin`` -> ``<file>.bin.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _read_sidecar(path: Path) -> Optional[dict]:
    """The validated sidecar of ``path``, or None when there is none."""
    side = sidecar_path(path)
    if not side.exists():
        return None
    regenerate = (f"delete {side} to read {path.name} as raw uint16, or regenerate both with "
                  "asyncpp-prepare-data")
    try:
        header = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"token header {side} is not readable JSON ({reason}); {regenerate}") from None
    if not isinstance(header, dict) or header.get("format") != TOKEN_FORMAT:
        found = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise DataError(f"token header {side} has format {found!r}, not {TOKEN_FORMAT!r}; "
                        f"{regenerate}")
    if header.get("version") != TOKEN_FORMAT_VERSION:
        raise DataError(f"token header {side} has version {header.get('version')!r}; this asyncpp "
                        f"reads version {TOKEN_FORMAT_VERSION}; {regenerate}")
    if header.get("dtype") not in TOKEN_DTYPES:
        raise DataError(f"token header {side} has unknown dtype {header.get('dtype')!r} "
                        f"(known: {', '.join(TOKEN_DTYPES)}); {regenerate}")
    for key, required in (("num_tokens", True), ("vocab_size", False), ("max_token_id", False)):
        value = header.get(key)
        if (value is None and not required) or (type(value) is int and value >= 0):
            continue
        raise DataError(f"token header {side} has {key} = {value!r}, not a non-negative "
                        f"integer; {regenerate}")
    return header


LLMC_HEADER_INTS = 256
"""An llm.c shard's header: 256 little-endian int32 (1024 bytes)."""
LLMC_FORMATS = {20240520: (1, "uint16"), 20240801: (7, "uint32")}
"""llm.c token-shard magic -> (version, dtype): GPT-2 tokens (also modded-nanogpt's), LLaMA-3 tokens."""
LLMC_OTHER_FILES = {20240326: "an llm.c GPT-2 model checkpoint", 20240522: "an llm.c eval file "
                    "(HellaSwag/MMLU examples)"}
"""Magics of llm.c files that are not training tokens."""


def _llmc_header(path: Path, size: int) -> Optional[tuple[str, int]]:
    """(dtype name, token count) of an llm.c shard, None for a file without such a header; a
    damaged or foreign header is a ``DataError``."""
    header_bytes = LLMC_HEADER_INTS * 4
    if size < header_bytes:
        return None
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(header_bytes), dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    hint = ("re-download or regenerate the shard, or delete it from the set "
            "(asyncpp-prepare-data writes shards that need no header)")
    if magic in LLMC_OTHER_FILES:
        raise DataError(f"data file {path} is {LLMC_OTHER_FILES[magic]} (magic {magic}), not "
                        "training tokens; pass token shards (llm.c magic 20240520)")
    if magic not in LLMC_FORMATS:
        # A header of llm.c's shape (count at [2], zeros after it, the size it implies) with a
        # magic nobody writes: a damaged or foreign shard, not raw tokens.
        shaped = (not header[3:].any() and version in (1, 7) and count > 0
                  and size - header_bytes in (count * 2, count * 4))
        if shaped:
            raise DataError(f"data file {path} has an llm.c-style header with magic {magic}, not "
                            f"20240520 (GPT-2 tokens) or 20240801 (LLaMA-3 tokens); {hint}")
        return None
    want_version, dtype_name = LLMC_FORMATS[magic]
    if version != want_version:
        raise DataError(f"data file {path} is an llm.c token shard (magic {magic}) of version "
                        f"{version}; this asyncpp reads version {want_version}; {hint}")
    itemsize = TOKEN_DTYPES[dtype_name].itemsize
    if count <= 0 or size != header_bytes + count * itemsize:
        raise DataError(f"data file {path} is an llm.c token shard whose header says {count} "
                        f"{dtype_name} tokens ({header_bytes + count * itemsize} bytes with the "
                        f"header) but the file has {size} bytes: it is cut short or damaged; {hint}")
    return dtype_name, count


def _open_token_file(path: Path) -> tuple[np.memmap, Optional[dict]]:
    """Memory-map a ``.bin`` token file after checking its size against its dtype and sidecar (or
    its llm.c header)."""
    header = _read_sidecar(path)
    if header is None:
        llmc = _llmc_header(path, path.stat().st_size)
        if llmc is not None:
            dtype_name, count = llmc
            tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype_name], mode="r",
                               offset=LLMC_HEADER_INTS * 4, shape=(count,))
            return tokens, {"dtype": dtype_name, "num_tokens": count, "format": "llm.c"}
    dtype_name = header["dtype"] if header else "uint16"
    dtype = TOKEN_DTYPES[dtype_name]
    size = path.stat().st_size
    if size % dtype.itemsize:
        shape = "an odd byte length" if dtype.itemsize == 2 else "a byte length"
        raise DataError(f"data file {path} has {shape} ({size}), not a multiple of "
                        f"{dtype.itemsize}; a .bin file must hold {dtype_name} token ids "
                        f"({dtype.itemsize} bytes each); regenerate it with asyncpp-prepare-data")
    if header is not None and size != header["num_tokens"] * dtype.itemsize:
        raise DataError(f"data file {path} has {size} bytes but its header {sidecar_path(path).name} "
                        f"says {header['num_tokens']} {dtype_name} tokens "
                        f"({header['num_tokens'] * dtype.itemsize} bytes): the file or its dtype "
                        "disagrees with its header; regenerate both with asyncpp-prepare-data")
    if size == 0:
        raise DataError(f"data file {path} is empty; pass a file with tokens in it")
    return np.memmap(path, dtype=dtype, mode="r"), header


def scan_max_token_id(tokens: np.ndarray, chunk: int = SCAN_CHUNK_TOKENS) -> int:
    """Largest id in ``tokens``, read ``chunk`` ids at a time (a memmap never enters RAM whole)."""
    top = 0
    for start in range(0, len(tokens), chunk):
        top = max(top, int(tokens[start: start + chunk].max()))
    return top


def token_file_info(path: str | os.PathLike) -> dict:
    """What a ``.bin`` token file holds: ``dtype`` (name), ``num_tokens``, ``vocab_size`` (None
    without a sidecar), ``max_token_id`` (from the sidecar, else scanned) and ``tokenizer`` (None
    without a sidecar). Raises ``DataError`` for the same problems as ``load_tokens``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist (or is not a file); "
                        "make one with asyncpp-prepare-data")
    tokens, header = _open_token_file(path)
    header = header or {}
    top = header.get("max_token_id")
    return {"dtype": header.get("dtype", "uint16"), "num_tokens": len(tokens),
            "vocab_size": header.get("vocab_size"),
            "max_token_id": scan_max_token_id(tokens) if top is None else top,
            "tokenizer": header.get("tokenizer")}


def _token_top(tokens, header: Optional[dict], vocab_size: int) -> int:
    """Largest id of ``tokens``: the sidecar's max_token_id, else a scan; -1 without a scan when
    the ids are uint16 and the vocabulary covers every uint16 (nothing to check)."""
    known_top = header.get("max_token_id") if header else None
    if known_top is None and tokens.dtype.itemsize == 2 and vocab_size >= 1 << 16:
        return -1
    return scan_max_token_id(tokens) if known_top is None else known_top


def _vocab_error(source, top: int, vocab_size: int, header_vocab: int) -> DataError:
    return DataError(f"data {source} holds token id {top} but the model's vocab_size is "
                     f"{vocab_size}; train with --vocab-size {max(top + 1, header_vocab)} or use "
                     f"data whose ids are < {vocab_size}")


def _check_vocab(source, tokens, header: Optional[dict], vocab_size: int) -> None:
    """``DataError`` if an id of ``tokens`` is >= vocab_size."""
    top = _token_top(tokens, header, vocab_size)
    if top >= vocab_size:
        raise _vocab_error(source, top, vocab_size, (header or {}).get("vocab_size") or 0)


BYTES_TOKENIZER = "bytes"
"""The ``tokenizer`` of ids that are UTF-8 bytes: text files, the built-in corpus, ``--tokenizer bytes``."""


def _tokenizer_mark(header: Optional[dict]) -> Optional[dict]:
    """What a sidecar says of the tokenizer that made its ids (None where nothing says: no
    sidecar, an llm.c shard's header)."""
    if not header or header.get("tokenizer") is None:
        return None
    return {k: header.get(k) for k in ("tokenizer", "tokenizer_sha256", "vocab_size")}


def tokenizers_differ(a: Optional[dict], b: Optional[dict]) -> bool:
    """Whether two ``tokenizer_of`` marks show different tokenizers: bytes against a tokenizer,
    different vocabulary sizes, or different ``tokenizer_sha256`` (paths alone may differ: a
    tokenizer.json moved or copied is the same tokenizer). False where either says nothing."""
    if a is None or b is None:
        return False
    bytes_a, bytes_b = a["tokenizer"] == BYTES_TOKENIZER, b["tokenizer"] == BYTES_TOKENIZER
    if bytes_a or bytes_b:
        return bytes_a != bytes_b
    if a["vocab_size"] and b["vocab_size"] and a["vocab_size"] != b["vocab_size"]:
        return True
    return bool(a["tokenizer_sha256"] and b["tokenizer_sha256"] and a["tokenizer_sha256"] != b["tokenizer_sha256"])


def describe_tokenizer(mark: dict) -> str:
    """A tokenizer mark for a message: "bytes", or "tokenizer PATH (vocabulary N)"."""
    if mark["tokenizer"] == BYTES_TOKENIZER:
        return "UTF-8 bytes"
    return f"tokenizer {mark['tokenizer']} (vocabulary {mark['vocab_size']})"


def tokenizer_of(source: str, flag: str = "--data") -> Optional[dict]:
    """Which tokenizer made ``source``'s ids, as its sidecars say: a dict of ``tokenizer``,
    ``tokenizer_sha256`` and ``vocab_size`` (``"bytes"`` for a text file and the built-in corpus),
    or None where no sidecar says (an llm.c shard, a nanoGPT ``.bin``). For several shards, the
    first that says; ``load_tokens`` refuses shards that differ. Problems with the files are left
    to ``load_tokens`` (None here)."""
    from .shards import is_multi_spec, resolve_token_paths

    if source == BUILTIN or (not is_multi_spec(source) and Path(source).suffix != ".bin"):
        return {"tokenizer": BYTES_TOKENIZER, "tokenizer_sha256": None, "vocab_size": 256}
    try:
        for path in resolve_token_paths(source, flag)[0]:
            mark = _tokenizer_mark(_read_sidecar(path))
            if mark is not None:
                return mark
    except DataError:
        return None
    return None


def boundary_of(source: str, flag: str = "--data") -> Optional[tuple[int, str]]:
    """The token that marks documents in ``source`` as its sidecars say -- (id, token), from
    ``asyncpp-prepare-data --doc-boundary eos|bos`` -- or None where none says (no sidecar, a
    text file or the built-in corpus, data prepared with ``--doc-boundary none``). For several
    shards, the first that says (one preparation writes them all). DataError where the files
    cannot be read."""
    from .shards import is_multi_spec, resolve_token_paths

    if source == BUILTIN or (not is_multi_spec(source) and Path(source).suffix != ".bin"):
        return None
    for path in resolve_token_paths(source, flag)[0]:
        header = _read_sidecar(path) or {}
        if header.get("doc_boundary", "none") != "none" and isinstance(header.get("boundary_token_id"), int):
            return header["boundary_token_id"], str(header.get("boundary_token"))
    return None


def load_shards(spec: str, vocab_size: int = 256, flag: str = "--data"):
    """The token files a glob, directory or manifest names, as one ``TokenShards`` (a single
    match: that file's memmap). Every shard is checked like a single ``.bin``."""
    from .shards import TokenShards, resolve_token_paths

    paths, counts = resolve_token_paths(spec, flag)
    parts, worst, header_vocab, first_mark = [], (-1, None), 0, None
    described, bare = None, None  # a shard with a header (sidecar or llm.c's), one without
    for i, path in enumerate(paths):
        if not path.is_file():
            raise DataError(f"{flag} {spec}: shard {path} does not exist (or is not a file); "
                            "regenerate the shards or fix the manifest")
        if path.suffix != ".bin":
            raise DataError(f"{flag} {spec}: {path} is not a .bin token file")
        tokens, header = _open_token_file(path)
        if header is None:
            bare = bare or path
        else:
            described = described or path
        if described is not None and bare is not None:  # the bare one's id width would be a guess
            raise DataError(f"{flag} {spec}: shard {bare} has no header (its .json sidecar) but {described.name} "
                            "has one, so its ids' width (uint16 or uint32) is unknown; restore its sidecar or "
                            "regenerate the shards")
        if counts is not None and len(tokens) != counts[i]:
            raise DataError(f"{flag} {spec}: shard {path} holds {len(tokens)} tokens but the "
                            f"manifest says {counts[i]}; regenerate the shards")
        mark = _tokenizer_mark(header)
        if first_mark is None and mark is not None:
            first_mark = (mark, path)
        elif first_mark is not None and tokenizers_differ(first_mark[0], mark):
            raise DataError(f"{flag} {spec} mixes token files of different tokenizers: {first_mark[1].name} "
                            f"({describe_tokenizer(first_mark[0])}) and {path.name} ({describe_tokenizer(mark)}); "
                            "give one tokenizer's shards (a narrower glob, or their manifest)")
        top = _token_top(tokens, header, vocab_size)
        if top >= vocab_size and top > worst[0]:
            worst = (top, path)
        header_vocab = max(header_vocab, (header or {}).get("vocab_size") or 0)
        parts.append(tokens)
    if worst[1] is not None:  # named once, with the vocabulary every shard needs
        where = worst[1] if len(parts) == 1 else f"{spec} (shard {worst[1].name})"
        raise _vocab_error(where, worst[0], vocab_size, header_vocab)
    if len(parts) == 1:
        return parts[0]
    return TokenShards(parts, [str(p) for p in paths])


def load_tokens(source: str | os.PathLike, vocab_size: int = 256, flag: str = "--data") -> np.ndarray:
    """Token ids of ``source``: "builtin", a UTF-8 text file, a ``.bin`` token file (returned
    as a read-only ``np.memmap``), or a glob / directory / manifest of ``.bin`` shards (a
    ``shards.TokenShards`` over their memmaps). Raises ``DataError`` if an id is >= ``vocab_size``;
    ``flag`` names the option in messages about a glob, directory or manifest."""
    from .shards import is_multi_spec

    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise TypeError(f"load_tokens: source must be a path (str or os.PathLike) or 'builtin', "
                        f"got {type(source).__name__}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"load_tokens: vocab_size must be an integer >= 1, got {vocab_size!r}")
    header = None
    if source != BUILTIN and is_multi_spec(source):
        return load_shards(source, vocab_size, flag)
    if source == BUILTIN:
        tokens = builtin_corpus()
    else:
        path = Path(source)
        if not path.is_file():
            builtin = " or --data builtin" if flag == "--data" else ""
            raise DataError(f"{flag} {source} does not exist (or is not a file); "
                            f"pass an existing text/.bin file{builtin}")
        if path.suffix == ".bin":
            tokens, header = _open_token_file(path)
        else:
            if path.stat().st_size == 0:
                raise DataError(f"{flag} {source} is empty; pass a file with text in it")
            raw = path.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{flag} {source} is not UTF-8 text (byte {exc.start}); convert "
                                "it to UTF-8 or give a pre-tokenized .bin file") from None
            tokens = np.frombuffer(raw, dtype=np.uint8)
    _check_vocab(source, tokens, header, vocab_size)
    return tokens


__all__ = ["BUILTIN", "BUILTIN_MAX_BYTES", "BYTES_TOKENIZER", "DataError", "LLMC_FORMATS", "LLMC_HEADER_INTS",
           "SCAN_CHUNK_TOKENS", "TOKEN_DTYPES", "TOKEN_FORMAT", "TOKEN_FORMAT_VERSION",
           "builtin_corpus", "load_shards", "load_tokens",
           "scan_max_token_id", "sidecar_path", "token_dtype_for_vocab", "token_file_info", "tokenizer_of",
           "tokenizers_differ", "describe_tokenizer", "boundary_of"]
