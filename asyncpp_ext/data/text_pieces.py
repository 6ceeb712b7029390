"""Long text files as bounded pieces for the tokenizer (``asyncpp-prepare-data``): read in blocks,
cut at line ends (a line longer than MAX_CARRY_CHARS at whitespace, or anywhere), documents split
at an optional separator. Memory stays bounded whatever the input size; pieces are encoded without
special tokens, so a tokenizer that splits text at whitespace gives the same tokens as on the
whole text except, at most, where a piece ends."""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Iterator, Optional

from . import inputs as inp
from .encode import PrepareError

READ_BLOCK_BYTES = 1 << 20
"""Bytes read from an input at a time."""
PIECE_CHARS = 64 * 1024
"""Target length of one piece handed to the tokenizer; pieces end at a line end."""
MAX_CARRY_CHARS = 4 * PIECE_CHARS
"""Text kept waiting for a line end; beyond it a line is cut at whitespace (or anywhere)."""


class NotTextError(PrepareError):
    """A text input that is not UTF-8 text: an invalid byte, or a NUL (UTF-16 and binary files
    decode as UTF-8 full of NULs). Never skipped: the file's earlier pieces are already written."""


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


def _split_closed(text: str) -> Iterator[str]:
    """Pieces of a text known to be complete (a whole document)."""
    while text:
        cut = _cut(text, final=True)
        yield text[:cut]
        text = text[cut:]


def read_text_pieces(path: Path, on_bytes=lambda n: None, separator: Optional[str] = None,
                     compression: Optional[str] = None) -> Iterator[tuple[str, bool]]:
    """(piece, ends a document) of a UTF-8 text file: the whole file is one document, or the
    text between ``separator``s is (a trailing separator ends the last document). Pieces end at
    a line end where possible. ``on_bytes(n)``: n more bytes of the file were read. Raises
    ``NotTextError`` at the first non-UTF-8 or NUL byte. A byte-order mark at the start of the
    file (editors on Windows write one) is not text: it is left out."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, offset, seen_separator, at_start = "", 0, False, True
    keep = len(separator) - 1 if separator else 0  # a separator may straddle the block end
    with inp.open_input(inp.Input(path, inp.TEXT, compression)) as opened:
        last = 0
        while True:
            try:
                block = opened.reader.read(READ_BLOCK_BYTES)
            except inp.stream_errors() as exc:
                raise PrepareError(f"input {path} is damaged or cut short ({exc}); download it "
                                   "again") from None
            held = len(decoder.getstate()[0])  # bytes of a character split by the last block
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                # exc.start counts from the held-back bytes, which precede this block.
                raise NotTextError(f"input {path} is not UTF-8 text (byte {offset - held + exc.start}); "
                                   "convert it to UTF-8") from None
            if "\0" in text:
                at = offset - held + len(text[: text.index("\0")].encode("utf-8"))
                raise NotTextError(f"input {path} is not UTF-8 text: it holds a NUL byte (byte {at}), "
                                   "as UTF-16 and binary files do; convert it to UTF-8")
            if at_start and text:
                text, at_start = text.removeprefix("\ufeff"), False
            pending += text
            offset += len(block)
            now = opened.position()
            on_bytes(now - last)
            last = now
            if separator:
                start = 0
                while (found := pending.find(separator, start)) >= 0:
                    pieces = list(_split_closed(pending[start:found])) or [""]
                    for i, piece in enumerate(pieces):
                        yield piece, i == len(pieces) - 1
                    start, seen_separator = found + len(separator), True
                pending = pending[start:]
            if not block:
                pieces = list(_split_closed(pending))
                if pieces or not seen_separator:  # no empty document after a final separator
                    pieces = pieces or [""]
                    for i, piece in enumerate(pieces):
                        yield piece, i == len(pieces) - 1
                return
            while len(pending) - keep >= PIECE_CHARS:
                cut = _cut(pending[: len(pending) - keep], final=False)
                if cut == 0:
                    break
                yield pending[:cut], False
                pending = pending[cut:]


def read_pieces(path: Path, on_bytes=lambda n: None) -> Iterator[str]:
    """Text pieces of a UTF-8 file, each ending at a line end where possible; ``on_bytes(n)`` is
    called after each block read. Raises ``PrepareError`` at the first non-UTF-8 byte."""
    for piece, _ in read_text_pieces(path, on_bytes):
        if piece:
            yield piece
