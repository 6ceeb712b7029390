"""A weighted mixture of token sources: ``--data-mix PATH=WEIGHT``, once per source.

Each source (any ``--data`` format: a text file, a ``.bin``, a glob, a directory of shards, a
manifest) keeps its own last ``eval_fraction`` for evaluation and trains on the rest through its
own ``BatchStream`` (its own window order, ``--sampling`` as for one source; its generators
seeded by its tokens' fingerprint, not by where it is listed). A minibatch of ``W``
windows takes from source ``j`` a number of windows fixed by the weights, not drawn:

* every source but the heaviest has given ``floor(n * w_j + 1/2)`` (``n * w_j`` rounded) of the
  first ``n`` windows of the run, so it gives the difference of two such counts to minibatch ``p``;
* the heaviest source fills the rest.

So after every step (not only on average) each source has given its weight's share of the
windows to within half a window, the heaviest to within half a window per other source, and the
count of windows source ``j`` gave before minibatch
``p`` is a formula: the stream's state stays ``(seed, position)``, a resume needs nothing per
source, and in the "epoch" order source ``j``'s windows are the next ones of its own permutation
(a small source repeats its epochs sooner: that is what upsampling it means). The windows of a
minibatch are then put in a seeded random order, so every microbatch (and every data-parallel
replica's rows of it) mixes the sources.

The held-out set takes windows from each source's held-out part in proportion to the weights
(largest remainders), so the eval loss estimates the mixture's loss; a ``--val-data`` replaces it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .batches import Microbatch, PositionedStream, as_microbatch, check_one_pass, window_rows
from .errors import DataError

MIX_STREAM = 3
"""Word of the mixture's generator seeds ((seed, position, MIX_STREAM) orders a minibatch's windows;
a source's draws add (MIX_STREAM, its fingerprint): ``source_key``): keeps them apart from a plain
stream's. Fixed:
changing it would change every mixture's batches and break the resume of its checkpoints."""


def normalised_weights(weights, what: str = "--data-mix") -> list[float]:
    """``weights`` divided by their sum; DataError for a weight that is not a finite number > 0."""
    checked = []
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)) \
                or not math.isfinite(w) or w <= 0:
            raise DataError(f"{what}: weight {w!r} is not a finite number > 0; give each source a "
                            "positive weight (they need not sum to 1)")
        checked.append(float(w))
    if not checked:
        raise DataError(f"{what}: no sources; give at least one PATH=WEIGHT")
    total = math.fsum(checked)
    return [w / total for w in checked]


def heaviest(weights) -> int:
    """The source that fills what the others' floors leave (the first of the largest weight)."""
    return max(range(len(weights)), key=lambda j: (weights[j], -j))


def windows_before(weights, n: int) -> list[int]:
    """How many of the first ``n`` windows each source gives (module docstring): ``n * w_j``
    rounded (half up: a count that never decreases as ``n`` grows) but for the heaviest source,
    which gives the rest."""
    major = heaviest(weights)
    counts = [math.floor(n * w + 0.5) for w in weights]
    counts[major] = n - (sum(counts) - counts[major])
    return counts


def check_fits(weights, windows: int, sources) -> None:
    """DataError when a minibatch of ``windows`` windows cannot hold what the light sources may
    take in one minibatch (at most ``ceil(windows * w_j)`` each): the heaviest would owe windows."""
    major = heaviest(weights)
    most = sum(math.ceil(windows * w) for j, w in enumerate(weights) if j != major)
    if most > windows:
        raise DataError(f"--data-mix: {len(weights)} sources {', '.join(map(str, sources))} may need "
                        f"{most} windows in one minibatch of {windows} (microbatches x micro-batch size); "
                        "use fewer sources or more windows per minibatch (--microbatches, "
                        "--micro-batch-size)")


DATA_KEYS = ("num_tokens", "shards", "fingerprint")
"""What identifies a source's training tokens in a state (BatchStream.state_dict)."""


@dataclass
class MixtureStream(PositionedStream):
    """Training minibatches drawn from several ``BatchStream``s (one per source, each over its
    own training tokens, with the same shape, seed and sampling) by fixed weights. Its state is
    ``(seed, position)`` as a BatchStream's, with each source's data checked on a resume.

    A run may change its mixture at a resume (``change=True``, ``--change-data-mix``): the new
    weights and sources form a *phase* from the checkpoint's position on, counted as a run of
    their own from there; the earlier phases are kept in the state (``history``), so a source that
    was in them (the same tokens) continues its window order where they left it."""

    parts: list
    """One BatchStream per source; each is keyed here by its tokens (``source_key``)."""
    weights: list
    """The sources' weights (any positive numbers; normalised here)."""
    names: list = field(default_factory=list)
    """The sources as the user named them, for messages."""
    position: int = 0
    """Index of the next minibatch to yield."""
    change: bool = False
    """Whether ``load_state_dict`` may start a new phase where the state's mixture differs."""

    def __post_init__(self):
        if len(self.parts) != len(self.weights) or not self.parts:
            raise DataError(f"MixtureStream: {len(self.parts)} streams for {len(self.weights)} weights")
        self.names = list(self.names) or [part.source or f"source {j}" for j, part in enumerate(self.parts)]
        self.weights = normalised_weights(self.weights)
        first = self.parts[0]
        for part in self.parts:
            shape = (part.microbatches, part.micro_batch_size, part.seq_len, part.seed, part.sampling)
            if shape != (first.microbatches, first.micro_batch_size, first.seq_len, first.seed, first.sampling):
                raise DataError("MixtureStream: every source's stream must have the same microbatches, "
                                "micro_batch_size, seq_len, seed and sampling")
        self.microbatches, self.micro_batch_size = first.microbatches, first.micro_batch_size
        self.seq_len, self.seed, self.sampling = first.seq_len, first.seed, first.sampling
        self.windows = self.microbatches * self.micro_batch_size
        check_fits(self.weights, self.windows, self.names)
        for part in self.parts:
            part.key = source_key(part)
        self.phase_start = 0  # the position this mixture took over at
        self.history = []  # the earlier phases: {"start", "end", "mix"} (the mix as state_dict writes it)
        self.given_before = [0] * len(self.parts)  # windows each source gave in the earlier phases

    def _span(self, position: int) -> tuple[list[int], list[int]]:
        """(windows each source gave this phase before minibatch ``position``, those it gives to it)."""
        n = (position - self.phase_start) * self.windows
        before = windows_before(self.weights, n)
        return before, [after - b for after, b in zip(windows_before(self.weights, n + self.windows), before)]

    def counts(self, position: int) -> list[int]:
        """Windows each source gives to minibatch ``position``."""
        return self._span(position)[1]

    def minibatch(self, position: int) -> list[Microbatch]:
        """The minibatch at ``position`` (pure function of seed and position, in this phase)."""
        if position < self.phase_start:
            raise DataError(f"minibatch {position} belongs to an earlier mixture (this one starts at "
                            f"{self.phase_start})")
        before, counts = self._span(position)
        rows = [window_rows(part.tokens, part.starts(position, given + first, count), self.seq_len,
                            part.vocab_size, part.source)
                for part, given, first, count in zip(self.parts, self.given_before, before, counts) if count]
        order = np.random.Generator(np.random.PCG64([self.seed, position, MIX_STREAM])).permutation(self.windows)
        block = np.concatenate(rows)[order].reshape(self.microbatches, self.micro_batch_size, self.seq_len + 1)
        return [as_microbatch(rows) for rows in block]

    def state_dict(self) -> dict:
        state = self.order_state()
        state["mix"] = self._mix_state()
        if self.history:  # a run that never changed its mixture writes the state it always wrote
            state.update(phase_start=self.phase_start, history=self.history)
        return state

    def _mix_state(self) -> list:
        keep = ("seed", "position", "sampling")
        return [dict(weight=weight, **{k: v for k, v in part.state_dict().items() if k not in keep})
                for part, weight in zip(self.parts, self.weights)]

    def load_state_dict(self, state: dict) -> None:
        mix = state.get("mix")
        if mix is None:
            raise DataError("the checkpoint's run trained on one --data source, this run on a --data-mix "
                            "mixture; resume with the run's --data")
        position = state.get("position")
        for part in self.parts:  # the seed, the sampling and the position, checked once
            part.load_state_dict({k: v for k, v in state.items() if k in ("seed", "position", "sampling")})
        history, start = list(state.get("history", [])), state.get("phase_start", 0)
        if not self._same_mixture(mix):
            if not self.change:
                self._refuse(mix)
            history, start = history + [{"start": start, "end": position, "mix": mix}], position
        self.history, self.phase_start, self.position = history, start, position
        self.given_before = [sum(windows_before([m["weight"] for m in phase["mix"]],
                                                (phase["end"] - phase["start"]) * self.windows)[k]
                                 for phase in history for k, m in enumerate(phase["mix"]) if _key(m) == _key(mine))
                             for mine in self._mix_state()]

    def plan(self, steps: int) -> str:
        """What the mixture gives each source from its phase's start to minibatch ``steps``: its
        share, its tokens, and how many passes over them that is (a source upweighted past its
        size repeats its tokens)."""
        given = windows_before(self.weights, max(steps - self.phase_start, 0) * self.windows)
        each = [f"{name} {w:.0%} ({len(part.tokens):,} tokens, {n * self.seq_len / len(part.tokens):.2f} epochs)"
                for name, w, part, n in zip(self.names, self.weights, self.parts, given)]
        since = f" from step {self.phase_start}" if self.phase_start else ""
        return f"--data-mix{since} to step {steps}: {', '.join(each)}"

    def _same_weights(self, mix: list) -> bool:
        return len(mix) == len(self.weights) and all(abs(m.get("weight", -1) - w) <= 1e-12
                                                     for m, w in zip(mix, self.weights))

    def _same_mixture(self, mix: list) -> bool:
        return self._same_weights(mix) and all(all(m[k] == o[k] for k in DATA_KEYS if k in m)
                                               for m, o in zip(mix, self._mix_state()))

    def _refuse(self, mix: list) -> None:
        """The DataError of a resume whose mixture differs from the state's, naming what differs."""
        hint = "; or pass --change-data-mix to continue with the new mixture from the checkpoint's step"
        if not self._same_weights(mix):
            theirs = ", ".join(f"{m.get('weight', '?'):.4g}" for m in mix)
            ours = ", ".join(f"{w:.4g}" for w in self.weights)
            raise DataError(f"the checkpoint's run mixed {len(mix)} sources with weights {theirs} (normalised), "
                            f"this run {len(self.parts)} with {ours}; resume with the run's --data-mix "
                            f"(the same sources in the same order and weights){hint}")
        for name, part, own in zip(self.names, self.parts, mix):
            try:
                part.load_state_dict({"seed": self.seed, "position": 0, "sampling": self.sampling,
                                      **{k: v for k, v in own.items() if k != "weight"}})
            except DataError as exc:
                raise DataError(f"--data-mix source {name}: {exc}{hint}") from None
        raise DataError(f"the checkpoint's mixture differs from this run's --data-mix{hint}")


def source_key(part) -> tuple:
    """The words a source's generators are seeded with besides (seed, ...): (MIX_STREAM, its
    tokens' fingerprint as a number). Its draws and epoch order depend on its tokens only, not on
    its place in the list, so a source keeps its window order across mixtures (a source listed
    twice under two names with the same tokens would draw the same windows twice)."""
    return (MIX_STREAM, int(part.state_dict()["fingerprint"], 16))


def _key(entry: dict) -> tuple:
    return tuple(entry.get(k) for k in DATA_KEYS)


def proportional(weights, total: int) -> list[int]:
    """``total`` split by ``weights`` by largest remainders (ties to the earlier source)."""
    exact = [total * w for w in weights]
    counts = [math.floor(x) for x in exact]
    for j in sorted(range(len(weights)), key=lambda j: (counts[j] - exact[j], j))[:total - sum(counts)]:
        counts[j] += 1
    return counts


def mixture_eval_batches(held_out: list, weights, batch_size: int, seq_len: int, count: int,
                         vocab_size=None, sources=None, count_flag: str = "--eval-batches") -> list[Microbatch]:
    """``count`` evaluation batches of ``batch_size`` windows whose windows come from each source's
    held-out tokens in proportion to the weights, spread evenly over each (as ``eval_batches``
    spreads them over one source; they overlap where a held-out part is short), in source order;
    a source whose share rounds to 0 gives none. DataError, naming ``count_flag``, for a count
    past one pass over all the parts' windows (as ``eval_batches`` refuses one for one source)."""
    if count == 0:
        return []
    check_one_pass(count, batch_size, sum(max(len(tokens) - seq_len, 0) for tokens in held_out),
                   "the --data-mix sources' held-out parts have", count_flag)
    sources = sources or [None] * len(held_out)
    rows = []
    for tokens, share, source in zip(held_out, proportional(normalised_weights(weights), count * batch_size),
                                     sources):
        max_start = len(tokens) - (seq_len + 1)
        if max_start < 0:
            raise DataError(f"{source or 'a source'}'s held-out part has {len(tokens)} tokens, fewer than "
                            f"one window of {seq_len + 1}; use more data or a smaller --seq-len")
        if share:
            starts = np.linspace(0, max_start, num=share).astype(np.int64)
            rows.append(window_rows(tokens, starts, seq_len, vocab_size, source))
    block = np.concatenate(rows).reshape(count, batch_size, seq_len + 1)
    return [as_microbatch(b) for b in block]


__all__ = ["MIX_STREAM", "MixtureStream", "source_key", "normalised_weights", "windows_before", "check_fits",
           "proportional", "mixture_eval_batches"]
