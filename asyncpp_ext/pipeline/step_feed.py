"""Step results from the executor's thread to the training loop's thread, without a wake-up per step.

Waking a sleeping thread costs a context switch, and on a machine whose cores all run pipeline
stages it lands on a core a stage computes on: tens of microseconds on a VM, per step. A
fine-grained pipeline (pipedream takes one optimizer step per microbatch) finishing a step every
100 us would spend a large share of its time on that. So the producer wakes the consumer at most
once per ``flush_s`` (at once for the final item), and the consumer also looks on its own every
``flush_s``: a result is delivered at most about ``flush_s`` after it is produced, and its
timestamps are taken when it is produced.
"""
from __future__ import annotations

import collections
import queue
import time
from typing import Iterator

FLUSH_S = 0.01
"""Longest a finished step's result waits before the training loop sees it (seconds)."""


class StepFeed:
    """One producer thread (``put``, then ``finish``), one consumer (``items``)."""

    def __init__(self, flush_s: float = FLUSH_S):
        self.flush_s = flush_s
        self._ready: collections.deque = collections.deque()  # appends/pops are thread-safe
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._last_wake = float("-inf")
        self._final = None  # the item ``finish`` handed over: the consumer stops after it

    def put(self, item) -> None:
        """Producer: hand over one result; wakes the consumer only if it was last woken flush_s ago."""
        self._ready.append(item)
        now = time.monotonic()
        if now - self._last_wake >= self.flush_s:
            self._last_wake = now
            self._wake.put(None)

    def finish(self, final) -> None:
        """Producer: hand over the last item (an end marker or an exception) and wake the consumer."""
        self._final = final  # set before the item is visible to the consumer
        self._ready.append(final)
        self._wake.put(None)

    def items(self) -> Iterator:
        """Consumer: every item in order, up to and including the one handed to ``finish``."""
        while True:
            try:
                self._wake.get(timeout=self.flush_s)
            except queue.Empty:
                pass
            while self._ready:
                item = self._ready.popleft()
                yield item
                if item is self._final:
                    return


__all__ = ["StepFeed", "FLUSH_S"]
