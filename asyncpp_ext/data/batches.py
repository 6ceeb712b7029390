"""Training and evaluation batches cut from a token array, in a deterministic, resumable order.

``split_tokens`` keeps the last ``eval_fraction`` of the tokens for evaluation. ``BatchStream``
draws training windows; its whole state is ``(seed, position)``: the window offsets of minibatch
``position`` are a pure function of the seed and the position, so a stream rebuilt from a
checkpoint's state yields exactly the batches the original would have. Two orders
(``SAMPLINGS``): "random" draws each window's start uniformly (windows may overlap and repeat,
nanoGPT's way); "epoch" cuts the tokens into consecutive windows of ``seq_len`` inputs and visits
them in a seeded permutation per epoch, so no token is an input twice before every token has
been one (the order long pretraining runs use), but the last (n - 1) mod seq_len of the n tokens,
which fill no window.

The tokens may be one array or several shards joined (``shards.TokenShards``): offsets index the
concatenation, so a window may cross a shard boundary and resuming needs nothing per shard. The
state also records ``num_tokens``, ``shards`` and a fingerprint of the contents
(``token_fingerprint``), and a resume over other data (a glob that now matches more files, a file
that grew or changed, shards swapped) is refused; states without them (older checkpoints, and
shards' before their fingerprint was kept) load as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .errors import DataError
from .shards import TokenShards

Microbatch = tuple  # (inputs int64 (B, T), targets int64 (B, T))
SAMPLINGS = ("random", "epoch")
"""Window orders of BatchStream (DataConfig.sampling, --sampling)."""
EPOCH_STREAM = 2
"""Third word of the "epoch" order's generator seed (seed, epoch, EPOCH_STREAM): keeps its
permutations apart from the "random" order's (seed, position) draws. Fixed: changing it would
reorder every epoch and break the resume of existing checkpoints."""


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


def window_rows(tokens: np.ndarray, starts: np.ndarray, seq_len: int,
                vocab_size: Optional[int] = None, source: Optional[str] = None) -> np.ndarray:
    """The windows of ``seq_len`` + 1 tokens at ``starts``, int64 (len(starts), seq_len + 1), their
    ids checked against ``vocab_size``."""
    rows = np.stack([np.asarray(tokens[s: s + seq_len + 1], dtype=np.int64) for s in starts])
    # The load checked the ids against the vocabulary by the sidecar's max_token_id, not by a
    # scan: a sidecar that understates it would otherwise reach the embedding as an IndexError.
    if vocab_size is not None and rows.size and int(rows.max()) >= vocab_size:
        top = int(rows.max())
        why = ("above the max_token_id its sidecar gives; regenerate the token file and its sidecar "
               "(asyncpp-prepare-data), or" if source else "outside the vocabulary;")
        raise DataError(f"{source or 'the data'} holds token id {top} >= vocab_size {vocab_size}, {why} "
                        f"train with a vocabulary of at least {top + 1} (--vocab-size)")
    return rows


def as_microbatch(rows: np.ndarray) -> Microbatch:
    """(inputs, targets) of windows as ``window_rows`` gives them."""
    block = torch.from_numpy(rows)
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int,
             vocab_size: Optional[int] = None, source: Optional[str] = None) -> Microbatch:
    return as_microbatch(window_rows(tokens, starts, seq_len, vocab_size, source))


class PositionedStream:
    """What a training stream shares (BatchStream, mixture.MixtureStream): ``minibatch(position)``
    is a pure function of the seed and the position, and ``next()`` yields the one at
    ``position`` and advances it."""

    def next(self) -> list[Microbatch]:
        batch = self.minibatch(self.position)
        self.position += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next()

    def order_state(self) -> dict:
        """The state every stream's ``state_dict`` starts with."""
        state = {"seed": self.seed, "position": self.position}
        if self.sampling != "random":  # older checkpoints, and random-order ones, carry no key
            state["sampling"] = self.sampling
        return state


@dataclass
class BatchStream(PositionedStream):
    """Training minibatches: ``microbatches`` microbatches of ``micro_batch_size`` windows of
    ``seq_len`` + 1 tokens, split into (inputs, targets). State = (seed, position)."""

    tokens: np.ndarray
    microbatches: int
    micro_batch_size: int
    seq_len: int
    seed: int = 0
    position: int = 0
    """Index of the next minibatch to yield."""
    sampling: str = "random"
    """Window order, one of SAMPLINGS (see the module docstring)."""
    vocab_size: Optional[int] = None
    """Every window's ids are checked to be below it (None: not checked)."""
    source: Optional[str] = None
    """What the tokens came from, for messages (e.g. "--data train_*.bin")."""
    key: tuple = ()
    """Words appended to the seeds of its generators: the sources of a mixture (mixture.py) draw
    apart from each other and from a plain stream; () = a plain stream's draws."""

    def __post_init__(self):
        if self.sampling not in SAMPLINGS:
            raise DataError(f"sampling {self.sampling!r} is not one of {', '.join(SAMPLINGS)}")
        for name in ("microbatches", "micro_batch_size", "seq_len", "seed", "position"):
            value, least = getattr(self, name), 0 if name in ("seed", "position") else 1
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise DataError(f"BatchStream: {name} must be an integer >= {least}, got {value!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(
                self.vocab_size, (int, np.integer)) or self.vocab_size < 1):
            raise DataError(f"BatchStream: vocab_size must be an integer >= 1 (or None), got {self.vocab_size!r}")
        if getattr(self.tokens, "ndim", 1) != 1 or np.dtype(self.tokens.dtype).kind not in "ui":
            raise DataError(f"BatchStream: tokens must be a 1-D array of integer ids, got "
                            f"{getattr(self.tokens, 'ndim', '?')}-D {self.tokens.dtype}")
        self.max_start = len(self.tokens) - (self.seq_len + 1)
        if self.max_start < 0:
            raise DataError(f"training split has {len(self.tokens)} tokens, fewer than one window "
                            f"of {self.seq_len + 1}; use more data or a smaller seq_len")
        # epoch: window k starts at k * seq_len (its last target is the next window's first input)
        self.num_windows = (len(self.tokens) - 1) // self.seq_len
        self._order = (None, None)  # (epoch, its permutation of the windows), the one in use

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch, EPOCH_STREAM, *self.key]))
            self._order = (epoch, rng.permutation(self.num_windows))
        return self._order[1]

    def minibatch(self, position: int) -> list[Microbatch]:
        """The minibatch at ``position`` (pure function of seed and position)."""
        count = self.microbatches * self.micro_batch_size
        starts = self.starts(position, position * count, count).reshape(self.microbatches, self.micro_batch_size)
        return [_windows(self.tokens, row, self.seq_len, self.vocab_size, self.source) for row in starts]

    def starts(self, position: int, first: int, count: int) -> np.ndarray:
        """Starts of ``count`` windows of minibatch ``position``: uniform draws of the position's
        generator (random), or the windows ``first`` .. ``first + count - 1`` of the epoch order."""
        if self.sampling == "random":
            rng = np.random.Generator(np.random.PCG64([self.seed, position, *self.key]))
            return rng.integers(0, self.max_start + 1, size=count)
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        visit = np.arange(first, first + count, dtype=np.int64)
        epochs, slots = np.divmod(visit, self.num_windows)
        return np.concatenate([self._epoch_order(int(e))[slots[epochs == e]]
                               for e in np.unique(epochs)]) * self.seq_len

    def tokens_per_epoch(self) -> int:
        """Input tokens an epoch of the "epoch" order covers (every training token but the last)."""
        return self.num_windows * self.seq_len

    def plan(self, steps: int) -> str:
        """What the run reads to minibatch ``steps``: its training tokens and the passes over them."""
        read = steps * self.microbatches * self.micro_batch_size * self.seq_len
        return (f"{self.source or 'the data'}: {len(self.tokens):,} training tokens, "
                f"{read / max(len(self.tokens), 1):.2f} epochs to step {steps}")

    def state_dict(self) -> dict:
        state = self.order_state()
        shards = self.tokens.num_shards if isinstance(self.tokens, TokenShards) else 1
        state.update(num_tokens=len(self.tokens), shards=shards, fingerprint=self._fingerprint())
        return state

    def _fingerprint(self) -> str:
        """``token_fingerprint`` of the tokens, taken once: the data is the run's from its start."""
        if getattr(self, "_fingerprint_of", None) is None:
            self._fingerprint_of = token_fingerprint(self.tokens)
        return self._fingerprint_of

    def load_state_dict(self, state: dict) -> None:
        if "mix" in state:
            raise DataError("the checkpoint's run trained on a --data-mix mixture, this run on one --data "
                            "source; resume with the run's --data-mix")
        if state.get("seed") != self.seed:
            raise DataError(f"batch stream state has seed {state.get('seed')!r} but this stream "
                            f"uses {self.seed}; resume with the seed the run started with")
        if state.get("sampling", "random") != self.sampling:
            raise DataError(f"batch stream state has sampling {state.get('sampling', 'random')!r} but "
                            f"this stream uses {self.sampling!r}; resume with the --sampling the run "
                            "started with")
        if "num_tokens" in state:  # the same data must be there (older checkpoints: over shards only)
            shards = self.tokens.num_shards if isinstance(self.tokens, TokenShards) else 1
            if (state["num_tokens"], state.get("shards")) != (len(self.tokens), shards):
                raise DataError(f"the checkpoint's data stream ran over {state['num_tokens']} training "
                                f"tokens in {state.get('shards')} shard(s) but the data now gives "
                                f"{len(self.tokens)} in {shards}; resume with the data the run "
                                "started with (a file may have grown, a glob may match files added since)")
        if "fingerprint" in state and state["fingerprint"] != self._fingerprint():
            raise DataError(f"the checkpoint's data stream ran over other training tokens than the data now "
                            f"gives (the same {len(self.tokens)} of them, other contents); resume with the data "
                            "the run started with")
        position = state.get("position")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise DataError(f"batch stream state has position {position!r}, not an integer >= 0; pass a "
                            "state saved by BatchStream.state_dict()")
        self.position = position


FINGERPRINT_PIECES, FINGERPRINT_PIECE_BYTES = 64, 16 << 10


def token_fingerprint(tokens) -> str:
    """A short sha256 of a token array's dtype, length and bytes -- all of them up to 1 MiB, else
    64 evenly spaced 16 KiB pieces: what a resume compares to know the data is the run's, at a
    cost that does not grow with the file. Over shards (``TokenShards``), each shard's part in
    range counts by its dtype, length and first and last 16 KiB, so a shard changed, swapped or
    reordered is seen whatever the number of shards (32 KiB read per shard)."""
    import hashlib

    if isinstance(tokens, TokenShards):
        h = hashlib.sha256(b"shards")
        for part in tokens.chunks(size=len(tokens) or 1):  # one view per shard
            raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
            h.update(f"{np.dtype(part.dtype).str}:{len(part)}".encode())
            h.update(raw[:FINGERPRINT_PIECE_BYTES].tobytes() + raw[-FINGERPRINT_PIECE_BYTES:].tobytes())
        return h.hexdigest()[:16]
    raw = np.ascontiguousarray(tokens).reshape(-1).view(np.uint8)
    h = hashlib.sha256(f"{np.dtype(tokens.dtype).str}:{len(tokens)}".encode())
    if raw.size <= FINGERPRINT_PIECES * FINGERPRINT_PIECE_BYTES:
        h.update(raw.tobytes())
    else:
        for start in np.linspace(0, raw.size - FINGERPRINT_PIECE_BYTES, FINGERPRINT_PIECES).astype(np.int64):
            h.update(raw[start:start + FINGERPRINT_PIECE_BYTES].tobytes())
    return h.hexdigest()[:16]


DEFAULT_EVAL_BATCHES = 4  # evaluation batches per evaluation unless the run says otherwise


def one_pass_batches(windows: int, batch_size: int) -> int:
    """The most evaluation batches of ``batch_size`` windows that ``windows`` distinct ones fill
    without one twice; at least ``DEFAULT_EVAL_BATCHES`` (a small set gets those, with repeats)."""
    return max(windows // batch_size, DEFAULT_EVAL_BATCHES)


def check_one_pass(count: int, batch_size: int, windows: int, holder: str, count_flag: str) -> None:
    """DataError, naming ``count_flag``, where ``count`` batches are more than ``one_pass_batches``
    of the ``windows`` distinct ones ``holder`` ("the eval split has") holds: more batches would
    only repeat them."""
    limit = one_pass_batches(windows, batch_size)
    if count > limit:
        raise DataError(f"{count_flag} {count} needs {count * batch_size} windows but {holder} {windows} "
                        f"distinct ones; pass {count_flag} {limit} or fewer"
                        + (" (or a larger --val-data)" if count_flag == "--eval-batches" else ""))


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, count: int,
                 vocab_size: Optional[int] = None, source: Optional[str] = None,
                 count_flag: str = "--eval-batches") -> list[Microbatch]:
    """A fixed evaluation set: ``count`` batches of windows spread evenly over the eval split.
    DataError, naming ``count_flag``, when ``count`` is more than ``one_pass_batches``."""
    if count == 0:  # a run that never evaluates reads none of the split
        return []
    window = seq_len + 1
    max_start = len(tokens) - window
    if max_start < 0:
        raise DataError(f"eval split has {len(tokens)} tokens, fewer than one window of {window}")
    check_one_pass(count, batch_size, max_start + 1, "the eval split has", count_flag)
    starts = np.linspace(0, max_start, num=count * batch_size).astype(np.int64)
    return [_windows(tokens, starts[i * batch_size:(i + 1) * batch_size], seq_len, vocab_size, source)
            for i in range(count)]


__all__ = ["Microbatch", "SAMPLINGS", "DEFAULT_EVAL_BATCHES", "min_tokens_needed", "split_tokens", "BatchStream",
           "one_pass_batches", "check_one_pass", "eval_batches",
           "token_fingerprint"]
