"""Per-rank stall detection: abort the rank when no pipeline instruction completes in time.

A pipeline that stops making progress (a stage stuck in a kernel, a peer that hangs without
closing its sockets, a deadlocked collective) would otherwise wait forever. Every rank runs one
``Watchdog`` thread. It learns of progress two ways: the stage executor records the instruction in
flight and counts completed ones in a C++ ``Progress`` object that the thread polls (``follow``;
nothing per instruction enters Python), and other phases report with ``beat``/``doing``. While
the rank is inside the pipeline (``armed``), if nothing completes for
``timeout_s`` the watchdog writes ONE report block to stderr -- the last completed instruction,
what the rank is doing now and its pending sends/receives -- and ends the process. Because every
rank runs its own watchdog, a stall makes every rank dump its own state.

Exit codes (see launch.py's root-cause attribution): a rank stuck in its own work (a forward,
backward or optimizer step that does not return) exits ``EXIT_STALLED``; a rank stuck waiting for
a peer exits ``EXIT_PEER_LOST``, because its stall is a consequence, not a cause.

Long legitimate phases: the first instruction of each ``train`` call may take ``warmup_factor``
times longer (lazy initialisation, kernel compilation, the pipeline filling up); evaluation beats
once per batch; checkpoints run outside the armed region (their barriers are bounded by the
process group timeout, which is the same ``timeout_s``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Optional

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "ASYNCPP_TIMEOUT"
EXIT_PEER_LOST = 3     # this rank waited on a peer that failed or stalled
EXIT_STALLED = 4       # this rank's own instruction never completed


def default_timeout_s() -> float:
    """``ASYNCPP_TIMEOUT`` (seconds) when set, else 300 s: generous for a slow CPU step, and a
    stalled GPU run still ends within minutes."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    return check_timeout(raw, f"{TIMEOUT_ENV}={raw!r}")


MAX_TIMEOUT_S = 1e8
"""Longest timeout accepted (about 3 years, for "never"): torch.distributed's store and sockets
keep it in milliseconds in C integers, and fail on values of 1e10 s and more."""


def check_timeout(value, what: str) -> float:
    """``value`` as a positive number of seconds up to MAX_TIMEOUT_S, else ValueError naming ``what``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not (0 < seconds < float("inf")):
        raise ValueError(f"{what} is not a positive number of seconds; use e.g. 300")
    if seconds > MAX_TIMEOUT_S:
        raise ValueError(f"{what} is more than {MAX_TIMEOUT_S:g} s (about 3 years), the longest the process "
                         f"group can wait; use {MAX_TIMEOUT_S:g} for no practical limit")
    return seconds


class Watchdog:
    """Aborts this process when an armed pipeline makes no progress for ``timeout_s``.

    Args:
        timeout_s: longest allowed time between two completed instructions.
        label: names the rank in the report, e.g. ``"rank 1 (stage 1)"``.
        pending: returns the transport's pending send/receive descriptions for the report.
        exit_fn: how to end the process (``os._exit``); tests may replace it.
        warmup_factor: the first instruction after arming may take this many timeouts.
    """

    def __init__(self, timeout_s: float, label: str, pending: Callable[[], list] = lambda: [],
                 exit_fn: Callable[[int], None] = os._exit, warmup_factor: float = 2.0):
        self.timeout_s = check_timeout(timeout_s, f"timeout_s={timeout_s!r}")
        self.label, self.pending, self.exit_fn = label, pending, exit_fn
        self.warmup_factor = warmup_factor
        self._lock = threading.Lock()
        self._armed = 0
        self._phase = ""
        self._last_done: Optional[str] = None
        self._last_time = time.monotonic()
        self._allowance = self.timeout_s
        self._current: Optional[tuple[str, bool, float]] = None  # (what, waits_on_peer, since)
        self._thread: Optional[threading.Thread] = None
        self._reported = False  # one report block per rank
        self.fired = threading.Event()
        self.on_report: Optional[Callable[[str], None]] = None  # e.g. tell the launcher
        self._progress: Optional[Callable[[], dict]] = None  # an executor Progress's snapshot
        self._progress_seen = 0
        self._progress_current = None  # (what, waits_on_peer, since) from the latest poll

    def follow(self, snapshot: Callable[[], dict]) -> None:
        """Poll ``snapshot()`` (``asyncpp_ext._C.Progress.snapshot``: completed count, the
        instruction running now and for how long, the last one finished) at every check: a
        changed count is progress. The poll interval adds at most ``min(0.5, timeout_s / 20)`` s
        to a stall's detection."""
        self._progress = snapshot

    # ---- progress ------------------------------------------------------------------------
    def beat(self, what: str, instruction: bool = True) -> None:
        """Progress: an instruction (or a unit of a long phase) completed. Non-instruction
        progress (a send confirmed late) resets the deadline but is not reported as the last
        completed instruction."""
        with self._lock:
            if instruction:
                self._last_done = what
            self._last_time = time.monotonic()
            self._allowance, self._current = self.timeout_s, None

    @contextlib.contextmanager
    def doing(self, what: str, waits_on_peer: bool, instruction: bool = True):
        """Marks what this rank is doing now; completing it is a beat."""
        with self._lock:
            self._current = (what, waits_on_peer, time.monotonic())
        yield
        self.beat(what, instruction)

    @contextlib.contextmanager
    def armed(self, phase: str):
        """Watch the enclosed region (a train stream, an evaluation, the start-up handshake)."""
        with self._lock:
            self._armed += 1
            self._phase = phase
            self._last_time = time.monotonic()
            self._allowance = self.timeout_s * self.warmup_factor
            if self._progress is not None:  # what finished before this region is no progress in it
                self._progress_seen = self._progress()["completed"]
        self._ensure_thread()
        try:
            yield
        finally:
            with self._lock:
                self._armed -= 1

    # ---- the watching thread ---------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="asyncpp-watchdog", daemon=True)
            self._thread.start()

    def _poll_progress(self) -> None:
        """Fold the executor's progress into the watched state (called with the lock held)."""
        snap = self._progress()
        now = time.monotonic()
        if snap["completed"] != self._progress_seen:
            self._progress_seen = snap["completed"]
            self._last_time, self._allowance = now, self.timeout_s
            self._last_done = snap["last_done"]
        current = snap["current"]
        self._progress_current = None if current is None else (
            current, current[0] in _PEER_WAITING_OPS, now - snap["current_for_s"])

    def _watch(self) -> None:
        poll = min(0.5, self.timeout_s / 20)
        while True:
            time.sleep(poll)
            with self._lock:
                if self._progress is not None:
                    self._poll_progress()
                idle = time.monotonic() - self._last_time
                if not self._armed or idle < self._allowance or self._reported:
                    continue
                self._reported = True
                report, summary, code = self._report(idle)
            if self.on_report is not None:
                self.on_report(summary)
            sys.stderr.write(report)
            sys.stderr.flush()
            self.exit_fn(code)  # does not return unless a test replaced it
            self.fired.set()
            return

    def dump_state(self, reason: str) -> None:
        """Write this rank's state block when it lost a peer (a transport failure), so that
        every rank's last instruction and pending transfers are on record whichever rank
        noticed first. The caller then fails as usual."""
        with self._lock:
            if self._reported:
                return
            self._reported = True
            block = self._state_lines(reason.splitlines()[0] if reason else "lost a peer")
        sys.stderr.write("\n".join(block) + "\n")
        sys.stderr.flush()

    def _activity(self):
        """(what, waits_on_peer, since) of what this rank is doing, or None between instructions."""
        return self._current if self._current is not None else self._progress_current

    def _state_lines(self, headline: str) -> list:
        now = time.monotonic()
        if self._progress is not None:
            self._poll_progress()
        activity = self._activity()
        if activity is not None:
            what, _, since = activity
            doing = f"{describe_activity(what)} (for {now - since:.1f} s)"
        else:
            doing = "between instructions"
        lines = [f"asyncpp: {self.label}: {headline}",
                 f"  last completed: {describe_activity(self._last_done) or 'none yet'}",
                 f"  in progress:    {doing}"]
        return lines + ([f"  pending:        {p}" for p in self.pending()]
                        or ["  pending:        no send or receive"])

    def _report(self, idle: float) -> tuple[str, str, int]:
        """(the report block, a one-line summary for the launcher, the exit code)"""
        now = time.monotonic()
        activity = self._activity()
        if activity is not None:
            what, waits_on_peer, since = activity
            doing = f"{describe_activity(what)} (for {now - since:.1f} s)"
        else:
            waits_on_peer, doing = True, "between instructions"
        code = EXIT_PEER_LOST if waits_on_peer else EXIT_STALLED
        pending = self.pending()
        lines = [f"asyncpp: {self.label}: watchdog: no instruction completed for {idle:.1f} s during "
                 f"{self._phase} (timeout {self.timeout_s:g} s; set --timeout or {TIMEOUT_ENV})",
                 f"  last completed: {describe_activity(self._last_done) or 'none yet'}",
                 f"  in progress:    {doing}"]
        lines += [f"  pending:        {p}" for p in pending] or ["  pending:        no send or receive"]
        cause = "waiting on a peer" if code == EXIT_PEER_LOST else "this rank stalled"
        lines.append(f"  aborting this rank (exit code {code}: {cause})")
        summary = (f"watchdog: no instruction completed for {idle:.1f} s; in progress: {doing}; "
                   f"last completed: {describe_activity(self._last_done) or 'none yet'}")
        return "\n".join(lines) + "\n", summary, code


_PEER_WAITING_OPS = ("recv_act", "recv_grad", "send_act", "send_grad")
"""Executor instructions that wait on a neighbour (a send waits when too many are in flight)."""


def describe_activity(what) -> str | None:
    """Text of an activity: a string given to ``beat``/``doing`` as is, or an executor Progress
    tuple (op, step, microbatch, version; an optimizer step's version is the one it creates)."""
    if not isinstance(what, tuple):
        return what
    op, step, mb, version = what
    if op == "optimizer_step":
        return f"optimizer_step (step {step}, new version {version})"
    return f"{op} (step {step}, microbatch {mb}, version {version})"


class WatchedTransport:
    """The Python transport with every completed wait reported to the watchdog."""

    def __init__(self, transport, watchdog: Watchdog):
        self.transport, self.watchdog = transport, watchdog

    def post_send(self, kind: int, step: int, mb: int, peer: int, tensor) -> int:
        return self.transport.post_send(kind, step, mb, peer, tensor)

    def post_recv(self, kind: int, step: int, mb: int, peer: int, tensor) -> int:
        return self.transport.post_recv(kind, step, mb, peer, tensor)

    def test(self, request: int) -> bool:
        return self.transport.test(request)

    def wait(self, request: int, timeout_s: float) -> None:
        desc = self.transport.describe_request(request)
        with self.watchdog.doing(f"waiting for {desc}", True, instruction=" recv from " in desc):
            self.transport.wait(request, timeout_s)

    def pending(self) -> list:
        return self.transport.pending()
