"""Token sources and a deterministic, resumable batch order.

Sources (``load_tokens``):
  * ``"builtin"``: the source text of Python's own standard library (a sorted, size-capped subset of
    its ``.py`` files), read at run time, so every machine with Python has a corpus;
  * a UTF-8 text file: its bytes are the tokens (vocabulary 256);
  * a ``.bin`` file of little-endian uint16 token ids (memory-mapped).

``split_tokens`` keeps the last ``eval_fraction`` of the tokens for evaluation. ``BatchStream``
draws training windows; its whole state is ``(seed, position)``: the window offsets of minibatch
``position`` come from a generator seeded by ``(seed, position)``, so a stream rebuilt from a
checkpoint's state yields exactly the batches the original would have.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

BUILTIN = "builtin"
BUILTIN_MAX_BYTES = 4_000_000
"""Cap of the built-in corpus: enough text for the presets, small enough to read in a blink."""


class DataError(ValueError):
    """A data source that cannot feed training; the message names the file and the fix."""


Microbatch = tuple  # (inputs int64 (B, T), targets int64 (B, T))


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


def min_tokens_needed(micro_batch_size: int, seq_len: int, eval_fraction: float) -> int:
    """Smallest corpus whose training split holds one microbatch of distinct windows and whose
    eval split holds one window of seq_len + 1 tokens."""
    window = seq_len + 1
    n = max(micro_batch_size * window, window)
    while True:
        eval_len = int(n * eval_fraction)
        if n - eval_len >= micro_batch_size * window and eval_len >= window:
            return n
        n += 1 if n < 1024 else n // 64


def split_tokens(tokens: np.ndarray, eval_fraction: float, micro_batch_size: int, seq_len: int,
                 source: str = "data") -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) = (first 1-eval_fraction, last eval_fraction) of the tokens, size-checked."""
    needed = min_tokens_needed(micro_batch_size, seq_len, eval_fraction)
    if len(tokens) < needed:
        raise DataError(f"data {source} has {len(tokens)} tokens but one batch needs at least "
                        f"{needed} (micro-batch size {micro_batch_size} x seq_len {seq_len} + 1, "
                        f"plus {eval_fraction:.0%} held out); use more text or a smaller "
                        "--micro-batch-size/--seq-len")
    cut = len(tokens) - int(len(tokens) * eval_fraction)
    return tokens[:cut], tokens[cut:]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Microbatch:
    rows = np.stack([np.asarray(tokens[s: s + seq_len + 1], dtype=np.int64) for s in starts])
    block = torch.from_numpy(rows)
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


@dataclass
class BatchStream:
    """Training minibatches: ``microbatches`` microbatches of ``micro_batch_size`` windows of
    ``seq_len`` + 1 tokens, split into (inputs, targets). State = (seed, position)."""

    tokens: np.ndarray
    microbatches: int
    micro_batch_size: int
    seq_len: int
    seed: int = 0
    position: int = 0
    """Index of the next minibatch to yield."""

    def __post_init__(self):
        self.max_start = len(self.tokens) - (self.seq_len + 1)
        if self.max_start < 0:
            raise DataError(f"training split has {len(self.tokens)} tokens, fewer than one window "
                            f"of {self.seq_len + 1}; use more data or a smaller seq_len")

    def minibatch(self, position: int) -> list[Microbatch]:
        """The minibatch at ``position`` (pure function of seed and position)."""
        rng = np.random.Generator(np.random.PCG64([self.seed, position]))
        starts = rng.integers(0, self.max_start + 1,
                              size=(self.microbatches, self.micro_batch_size))
        return [_windows(self.tokens, row, self.seq_len) for row in starts]

    def next(self) -> list[Microbatch]:
        batch = self.minibatch(self.position)
        self.position += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise DataError(f"batch stream state has seed {state.get('seed')!r} but this stream "
                            f"uses {self.seed}; resume with the seed the run started with")
        self.position = int(state["position"])


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, count: int) -> list[Microbatch]:
    """A fixed evaluation set: ``count`` batches of windows spread evenly over the eval split."""
    window = seq_len + 1
    max_start = len(tokens) - window
    if max_start < 0:
        raise DataError(f"eval split has {len(tokens)} tokens, fewer than one window of {window}")
    starts = np.linspace(0, max_start, num=count * batch_size).astype(np.int64)
    return [_windows(tokens, starts[i * batch_size:(i + 1) * batch_size], seq_len)
            for i in range(count)]


__all__ = ["BUILTIN", "DataError", "builtin_corpus", "load_tokens", "min_tokens_needed",
           "split_tokens", "BatchStream", "eval_batches"]
