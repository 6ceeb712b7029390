"""``--time-limit``: end a run with a checkpoint before a job's wall-clock limit, to be resumed.

A batch system ends a job at its time limit wherever the job is; the steps since its last
checkpoint are lost. With ``--time-limit D`` the trainer sizes its segments (the steps between two
points where every stage is quiet, Trainer._segment_end) so that the last one ends, and its
checkpoint is written, before D has passed since the command started (``asyncpp-train``'s
``main``; a library call of ``train``: that call; a spawned rank: its launcher's): after each segment
every rank proposes the next one's end at the last step that fits (steps counted ``SLACK`` times
slower than the latest segment's, the latest evaluation's and checkpoint's times kept in
reserve, a checkpoint's background write's as soon as it is known), the ranks of a pipeline take
the smallest proposal (one all-reduce per segment), and a proposal of no step at all ends the run
there, with a checkpoint. The first segment of a process is one step (its time holds the compile
and start-up, so the next proposal errs short). The interpreter's own start and imports (seconds)
come before the command's clock: leave them room.
"""
from __future__ import annotations

import contextlib
import math
import re
import time
from typing import Callable, Iterator, Optional

SLACK = 1.1
"""Segments are sized as if each step took this much longer than the latest segment's did: step
times vary (an evaluation's data, the allocator, a neighbour on the machine)."""

_PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")


def parse_duration(text: str) -> float:
    """Seconds of "90" (minutes), "45s", "30m", "2h", "1h30m" or "1.5h"; ValueError otherwise."""
    text = text.strip().lower()
    try:
        minutes = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(minutes) and minutes > 0:
            return minutes * 60.0
        raise ValueError(f"{text!r} is not a positive duration")
    parts = _PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text or len({u for _, u in parts}) != len(parts):
        raise ValueError(f"{text!r} is not a duration: give minutes (90) or units h, m, s (1h30m, 45m, 600s)")
    seconds = sum(float(n) * {"h": 3600.0, "m": 60.0, "s": 1.0}[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


def limited_end(step: int, end: int, elapsed_s: float, limit_s: float, step_s: Optional[float],
                reserve_s: float) -> int:
    """Where the segment starting after ``step`` should end (``step``: stop here) instead of
    ``end``, ``elapsed_s`` into a ``limit_s`` budget: one step while no time per step is known
    (``step_s`` None), else as many steps of ``SLACK`` x ``step_s`` as fit in the time left once
    ``reserve_s`` (the evaluation and checkpoint to come) is set aside."""
    if step_s is None:
        return min(end, step + 1)
    left = limit_s - elapsed_s - reserve_s
    if left <= 0:
        return step
    return end if step_s <= 0 else min(end, step + int(left // (SLACK * step_s)))


def capped_end(step: int, end: int, cap_s: float, step_s: Optional[float]) -> int:
    """Where the segment starting after ``step`` should end (instead of ``end``) to train no longer
    than ``cap_s`` at ``step_s`` per step: one step at least, and while no time per step is known."""
    if step_s is None or step_s <= 0:
        return min(end, step + 1) if step_s is None else end
    return min(end, step + max(1, int(cap_s // step_s)))


class SegmentClock:
    """The trainer's side of the limit: the time per step of the latest segment and of the latest
    evaluation and checkpoint, and the segment ends they allow (``limit_s`` None: no limit;
    ``cap_s``: no segment longer than this, ``--stop-on-signal``'s response; both None: the ends
    as given)."""

    def __init__(self, limit_s: Optional[float], start: float, cap_s: Optional[float] = None):
        self.limit_s, self.start = limit_s, start  # start: the limit's origin on time.perf_counter()
        self.cap_s = cap_s
        self.step_s: Optional[float] = None
        self.spent = {"eval": 0.0, "checkpoint": 0.0}  # the latest evaluation's, checkpoint's (in the loop)
        self.write_s: Callable[[], float] = lambda: 0.0
        """A checkpoint's write in the background as known now (async_checkpoint.BackgroundWriter.write_s):
        a stop's checkpoint waits for it, so it is kept in reserve on top of the loop's part."""

    @property
    def sizes_segments(self) -> bool:
        """Whether segment ends are this clock's to propose (and a pipeline's ranks must agree)."""
        return self.limit_s is not None or self.cap_s is not None

    def first_end(self, step: int, end: int) -> int:
        """The first segment's end: one step when sizing (the same on every rank: no clock read)."""
        return min(end, step + 1) if self.sizes_segments else end

    def trained(self, steps: int, seconds: float) -> None:
        if steps > 0:
            self.step_s = seconds / steps

    @contextlib.contextmanager
    def timing(self, what: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spent[what] = time.perf_counter() - began

    def next_end(self, step: int, end: int, checkpoint_due: bool) -> int:
        """This rank's proposal for the next segment's end, after ``step``: the last evaluation's and
        checkpoint's times kept in reserve (the checkpoint's twice when one is due now, before
        the segment starts)."""
        if self.cap_s is not None:
            end = capped_end(step, end, self.cap_s, self.step_s)
        if self.limit_s is None:
            return end
        checkpoint = self.spent["checkpoint"] + self.write_s()
        reserve = checkpoint * (2 if checkpoint_due else 1) + self.spent["eval"]
        return limited_end(step, end, time.perf_counter() - self.start, self.limit_s, self.step_s, reserve)


def describe_duration(seconds: float) -> str:
    """1h30m, 45m, 20s: how --time-limit was given back in messages."""
    whole = int(round(seconds))
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or f"{seconds:g}s"


__all__ = ["SLACK", "parse_duration", "limited_end", "capped_end", "SegmentClock", "describe_duration"]
