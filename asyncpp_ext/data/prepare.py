"""``asyncpp-prepare-data``: tokenize UTF-8 text files into a ``.bin`` token file (+ sidecar) that
``asyncpp-train --data`` reads; the format is described in ``sources``.

Usage::

    asyncpp-prepare-data --tokenizer tokenizer.json|bytes --input FILE [FILE ...] --out train.bin
                         [--val-fraction F] [--val-out PATH]

The inputs are read in order, in blocks, and cut into pieces at line ends (a line longer than a
block is cut at whitespace), so memory stays bounded whatever the input size. Pieces are encoded
without special tokens; a tokenizer that splits text at whitespace therefore gives the same tokens
as on the whole text except, at most, where a piece ends. Nothing is inserted between input files.

With ``--val-fraction F`` the last F of the tokens go to a validation file. Outputs are written to
temporary files that are renamed only once everything succeeded, so a failure or Ctrl-C leaves no
partial file behind.
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from .sources import (TOKEN_DTYPES, TOKEN_FORMAT, TOKEN_FORMAT_VERSION, DataError, scan_max_token_id,
                      sidecar_path, token_dtype_for_vocab)

PROG = "asyncpp-prepare-data"
BYTES = "bytes"
READ_BLOCK_BYTES = 1 << 20
"""Bytes read from an input at a time."""
PIECE_CHARS = 64 * 1024
"""Target length of one piece handed to the tokenizer; pieces end at a line end."""
PIECES_PER_BATCH = 32
"""Pieces encoded per ``encode_batch`` call (the tokenizer runs them in parallel)."""
MAX_CARRY_CHARS = 4 * PIECE_CHARS
"""Text kept waiting for a line end; beyond it a line is cut at whitespace (or anywhere)."""


class PrepareError(DataError):
    """Input that ``asyncpp-prepare-data`` cannot turn into a token file; the message says why and
    what to do."""


class ByteTokenizer:
    """Ids are the UTF-8 bytes of the text (vocabulary 256)."""

    name = BYTES
    vocab_size = 256

    def encode(self, pieces: list[str]) -> list[np.ndarray]:
        """Token ids of each piece."""
        return [np.frombuffer(p.encode("utf-8"), dtype=np.uint8) for p in pieces]


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a local tokenizer.json (no network)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise PrepareError("the tokenizers package is not installed; "
                               "pip install 'asyncpp_ext[hf]' (or use --tokenizer bytes)") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception for malformed files
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise PrepareError(f"tokenizer {path} is not a tokenizers tokenizer.json ({reason}); "
                               "pass the tokenizer.json of a Hugging Face tokenizer") from None
        self.name = os.path.abspath(path)
        # Added tokens may sit above the base vocabulary; the id range is what a model must embed.
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True),
                              max(ids, default=-1) + 1)

    def encode(self, pieces: list[str]) -> list[np.ndarray]:
        """Token ids of each piece, without special tokens (they would repeat at every piece)."""
        # encode_batch_fast (tokenizers >= 0.20.1) skips the character offsets, which go unused.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(pieces, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def load_tokenizer(spec: str):
    """``ByteTokenizer`` for "bytes", else an ``HFTokenizer`` from the tokenizer.json at ``spec``."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise PrepareError(f"tokenizer file {spec} does not exist (or is not a file); pass a "
                           "tokenizer.json or --tokenizer bytes")
    return HFTokenizer(path)


def _cut(text: str, final: bool) -> int:
    """Length of the next piece of ``text``: up to the last line end within PIECE_CHARS, else to
    the first line end after it; a line longer than MAX_CARRY_CHARS is cut before a space (or
    anywhere). 0 means: wait for more text."""
    end = text.rfind("\n", 0, PIECE_CHARS) + 1 or text.find("\n", PIECE_CHARS, MAX_CARRY_CHARS) + 1
    if end:
        return end
    if len(text) < MAX_CARRY_CHARS:
        return len(text) if final else 0
    space = max(text.rfind(" ", 0, MAX_CARRY_CHARS), text.rfind("\t", 0, MAX_CARRY_CHARS))
    return space if space > 0 else MAX_CARRY_CHARS


def read_pieces(path: Path, on_bytes=lambda n: None) -> Iterator[str]:
    """Text pieces of a UTF-8 file, each ending at a line end where possible; ``on_bytes(n)`` is
    called after each block read. Raises ``PrepareError`` at the first non-UTF-8 byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, offset = "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BLOCK_BYTES)
            held = len(decoder.getstate()[0])  # bytes of a character split by the last block
            try:
                pending += decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                # exc.start counts from the held-back bytes, which precede this block.
                raise PrepareError(f"input {path} is not UTF-8 text (byte {offset - held + exc.start}); "
                                   "convert it to UTF-8") from None
            offset += len(block)
            on_bytes(len(block))
            while pending and (len(pending) >= PIECE_CHARS or not block):
                cut = _cut(pending, final=not block)
                if cut == 0:
                    break
                yield pending[:cut]
                pending = pending[cut:]
            if not block:
                return


def _batched(pieces: Iterator[str], size: int) -> Iterator[list[str]]:
    batch = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _temp_beside(path: Path) -> Path:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


def _check_output(path: Path, flag: str) -> None:
    if path.suffix != ".bin":
        raise PrepareError(f"{flag} {path} does not end in .bin; name the token file like train.bin")
    if path.is_dir():
        raise PrepareError(f"{flag} {path} is a directory; name a file inside it, like train.bin")
    parent = path.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PrepareError(f"{flag} {path}: directory {parent} does not exist or is not writable; "
                           "create it or choose another place")


def _check_inputs(inputs: Sequence[str]) -> list[Path]:
    paths = []
    for name in inputs:
        path = Path(name)
        if not path.is_file():
            raise PrepareError(f"input {name} does not exist (or is not a file); pass UTF-8 text "
                               "files")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise PrepareError(f"input {name} is not readable ({exc.strerror}); fix its "
                               "permissions") from None
        paths.append(path)
    return paths


def _copy_tokens(src: Path, start: int, dtype: np.dtype, dst: Path) -> None:
    """Append tokens ``start:`` of ``src`` to ``dst`` in bounded chunks."""
    tokens = np.memmap(src, dtype=dtype, mode="r")
    with open(dst, "wb") as out:
        step = 1 << 22
        for i in range(start, len(tokens), step):
            tokens[i: i + step].tofile(out)
    del tokens


def prepare(tokenizer_spec: str, inputs: Sequence[str], out: str, val_fraction: float = 0.0,
            val_out: Optional[str] = None, progress: Optional[bool] = None) -> dict:
    """Tokenize ``inputs`` into ``out`` (and the validation file, if ``val_fraction`` > 0), with
    sidecars. Returns {path: sidecar} of the files written. Raises ``PrepareError``; nothing is
    left on disk unless it returns."""
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction} is outside [0, 1); use e.g. 0.1 or 0")
    out_path = Path(out)
    _check_output(out_path, "--out")
    val_path = None
    if val_out is not None and val_fraction == 0.0:
        raise PrepareError("--val-out needs --val-fraction > 0; give both or neither")
    if val_fraction > 0.0:
        val_path = Path(val_out) if val_out else out_path.with_name(f"{out_path.stem}.val.bin")
        _check_output(val_path, "--val-out")
        if val_path.resolve() == out_path.resolve():
            raise PrepareError(f"--val-out {val_path} is the --out file; name another file")
    paths = _check_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype_name = token_dtype_for_vocab(tokenizer.vocab_size)
    dtype = TOKEN_DTYPES[dtype_name]

    show = sys.stderr.isatty() if progress is None else progress
    temps: list[Path] = []
    try:
        whole = _temp_beside(out_path)
        temps.append(whole)
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=sum(p.stat().st_size for p in paths), desc="tokenize", unit="B",
                       unit_scale=True, file=sys.stderr)
        with open(whole, "wb") as sink, (bar if bar is not None else contextlib.nullcontext()):
            for path in paths:
                pieces = read_pieces(path, bar.update if bar is not None else (lambda n: None))
                for batch in _batched(pieces, PIECES_PER_BATCH):
                    for ids in tokenizer.encode(batch):
                        if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
                            raise PrepareError(f"tokenizer {tokenizer.name} produced id "
                                               f"{int(ids.max())} >= its vocabulary size "
                                               f"{tokenizer.vocab_size}; check the tokenizer.json")
                        ids.astype(dtype).tofile(sink)
        total = whole.stat().st_size // dtype.itemsize
        held_out = int(total * val_fraction)
        if total == 0:
            raise PrepareError(f"the inputs ({', '.join(map(str, paths))}) gave no tokens; pass "
                               "files with text in them")
        if val_path is not None and held_out == 0:
            raise PrepareError(f"--val-fraction {val_fraction} of {total} tokens leaves the "
                               "validation file empty; use more text or a larger fraction")

        outputs = [(out_path, whole)]
        if val_path is not None:
            val_tmp = _temp_beside(val_path)
            temps.append(val_tmp)
            _copy_tokens(whole, total - held_out, dtype, val_tmp)
            os.truncate(whole, (total - held_out) * dtype.itemsize)
            outputs.append((val_path, val_tmp))

        headers, side_temps = {}, []
        for final, tmp in outputs:
            tokens = np.memmap(tmp, dtype=dtype, mode="r")
            headers[final] = {"format": TOKEN_FORMAT, "version": TOKEN_FORMAT_VERSION,
                              "dtype": dtype_name, "num_tokens": len(tokens),
                              "vocab_size": tokenizer.vocab_size,
                              "max_token_id": scan_max_token_id(tokens),
                              "tokenizer": tokenizer.name}
            del tokens
            side_tmp = _temp_beside(sidecar_path(final))
            temps.append(side_tmp)
            side_tmp.write_text(json.dumps(headers[final], indent=1) + "\n", encoding="utf-8")
            side_temps.append((sidecar_path(final), side_tmp))
        # Nothing appears at the final paths before every file is complete.
        umask = os.umask(0)
        os.umask(umask)
        for final, tmp in outputs + side_temps:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes owner-only files
            os.replace(tmp, final)
        temps.clear()
        return headers
    except OSError as exc:
        raise PrepareError(f"could not read or write {exc.filename or out_path} ({exc.strerror}); "
                           "check the files, the output directory and free disk space") from None
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``asyncpp-prepare-data``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tokenize UTF-8 text files into a .bin token file (+ .bin.json "
        "sidecar) for asyncpp-train --data.")
    parser.add_argument("--tokenizer", required=True, metavar="TOKENIZER",
                        help="path of a Hugging Face tokenizer.json, or 'bytes' (ids are the "
                             "UTF-8 bytes, vocabulary 256)")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE",
                        help="UTF-8 text files, tokenized in the order given")
    parser.add_argument("--out", required=True, metavar="PATH", help="token file to write (.bin)")
    parser.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                        help="put the last F of the tokens (0 <= F < 1) in a validation file "
                             "(default 0: none)")
    parser.add_argument("--val-out", metavar="PATH",
                        help="validation token file (default: <stem of --out>.val.bin next to it)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``asyncpp-prepare-data``; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        headers = prepare(args.tokenizer, args.input, args.out, args.val_fraction, args.val_out)
    except DataError as exc:  # PrepareError, or a vocabulary no token dtype holds
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no file written", file=sys.stderr)
        return 130
    first = next(iter(headers.values()))
    parts = ", ".join(f"{path} ({h['num_tokens']:,})" for path, h in headers.items())
    total = sum(h["num_tokens"] for h in headers.values())
    print(f"{PROG}: wrote {total:,} tokens from {len(args.input)} input file(s) to {parts}; "
          f"vocabulary {first['vocab_size']:,}, {first['dtype']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
