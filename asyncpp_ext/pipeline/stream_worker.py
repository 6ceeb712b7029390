"""The thread a Pipeline's stream runs on, and how it is stopped.

``Pipeline.train`` runs its steps in the C++ executor on a worker thread while the caller's
thread reads their results. A caller interrupted mid-stream (a Ctrl-C in its loop) leaves that
thread running, and it must end before the interpreter's teardown: teardown ends a thread that is
inside native code by unwinding it there, which aborts the process ("terminate called without an
active exception"). ``StreamWorker.stop`` ends it within one forward or one transfer: the
stage's next forward raises ``StreamStopped`` and its transport's waits fail (the transport's
``cancel``), then the thread is joined. ``Pipeline.close()`` (and so leaving a ``with Pipeline``
block on an exception) stops it, and an exit hook stops the workers of pipelines never closed.

A stream the caller *left* (a ``break``: the generator closed) runs on, since the other stages
need this one to the stream's end; the pipeline's next call waits for it, and so does the exit
hook, unless the process is ending on an uncaught exception (then it stops it: that exception
may have been raised in the loop's body, which closes the generator on its way out).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch.utils._contextlib

from .step_feed import StepFeed

WORKER_THREAD_PREFIX = "asyncpp-stage"
"""A stream's worker thread is named this and its stage (it runs the schedule in native code)."""

STOP_TIMEOUT_S = 30.0
"""How long ``stop`` waits for the thread when its transport's waits can be cancelled: it is one
forward or one failed transfer away from its end."""

UNCANCELLABLE_STOP_S = 2.0
"""The same over a transport whose blocked wait cannot be cancelled (gloo's: a wait that times
out breaks the connection, so waits cannot be sliced): that wait ends when the peer sends or its
process exits, and a peer interrupted too does neither, so a long wait would only delay the exit."""

PEER_LOSS_GRACE_S = 0.5
"""How long a stream whose peer is gone waits for its own caller's stop before it reports the
loss: a Ctrl-C reaches every rank, and the first to stop closes its connections a moment before
the others have handled theirs (their report would then blame the peer for a Ctrl-C)."""

_RUNNING: set[StreamWorker] = set()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DECORATORS = torch.utils._contextlib.__file__  # torch.no_grad() and the like wrap calls in it


class StreamStopped(RuntimeError):
    """The stream was stopped from outside (``Pipeline.close()``, or the process exiting)."""


@dataclass
class LeftStream:
    """A stream the caller left before its end: its steps run on (see the module's docstring)."""

    worker: StreamWorker
    feed: StepFeed
    first_step: int
    steps: int
    last: int  # the last step the caller saw; run_out moves it on

    def run_out(self) -> BaseException | None:
        """Wait for the stream's end: None, or the failure that ended it. A Ctrl-C while waiting
        leaves the worker running (``interrupted``) and is raised."""
        try:
            for item in self.feed.items():
                if isinstance(item, BaseException):
                    self.worker.join()
                    return item
                self.last = getattr(item, "step", self.last)  # the end marker has none
        except BaseException:
            self.worker.interrupted.set()
            raise
        return None


def stage_workers_running() -> bool:
    """Whether a stream's worker thread is still running in this process (a process that leaves
    while one is in native code must skip the interpreter's teardown, which would abort it)."""
    return any(t.name.startswith(WORKER_THREAD_PREFIX) and t.is_alive() for t in threading.enumerate())


class StreamWorker:
    """One stream's thread. ``run`` does the stream's work; ``cancel(reason)`` makes the stage's
    next forward and its transport's pending and later transfers fail with ``reason``."""

    def __init__(self, run: Callable[[], None], stage: int, cancel: Callable[[str], None],
                 stop_timeout_s: float = STOP_TIMEOUT_S):
        self.stage, self._run, self._cancel, self.stop_timeout_s = stage, run, cancel, stop_timeout_s
        self.left: str | None = None
        """Set (to a line saying so) once the caller left the stream before its end; it runs on
        (see the module's docstring)."""
        self.interrupted = threading.Event()
        """Set once the caller was interrupted mid-stream, or the stream is stopped or quieted:
        the thread goes on (or ends) alone, and its failure is no news to report."""
        self.thread = threading.Thread(target=self._main, name=f"{WORKER_THREAD_PREFIX}{stage}", daemon=True)

    def _main(self) -> None:
        try:
            self._run()
        finally:
            _RUNNING.discard(self)

    def start(self) -> None:
        _RUNNING.add(self)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def stop(self, reason: str) -> bool:
        """End the thread (see the module's docstring); True once it has ended. Warns, and
        returns False, if it is still running after ``stop_timeout_s``."""
        if not self.thread.is_alive():
            return True
        self.interrupted.set()
        self._cancel(reason)
        self.thread.join(self.stop_timeout_s)
        if self.thread.is_alive():
            warnings.warn(f"stage {self.stage}: the stream's worker thread did not stop within {self.stop_timeout_s:g} "
                          "s of being cancelled (it waits on a peer); its transport is left open", RuntimeWarning,
                          stacklevel=outside_stacklevel())
            return False
        return True


def outside_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for its caller, of the nearest frame outside this package:
    a warning names the user's line that waited, however deep the package's calls go."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                                 or frame.f_code.co_filename == _TORCH_DECORATORS):
        frame, level = frame.f_back, level + 1
    return level


def quiet_running_streams() -> None:
    """The process is ending on its own failure or stop (its line written or about to be): a
    running stream's later failure -- a peer that left first -- is no news, and gets no report."""
    for worker in list(_RUNNING):
        worker.interrupted.set()


def join_left_streams(before: str) -> None:
    """Wait for every stream its caller left that still runs in this process (a new Pipeline's
    start-up and the process's exit do: its transfers must not interleave with theirs)."""
    for worker in list(_RUNNING):
        if worker.left and not worker.interrupted.is_set():
            warnings.warn(f"{worker.left}: its remaining steps run to the end {before} (a stream cannot "
                          "stop part-way)", RuntimeWarning, stacklevel=outside_stacklevel())
            worker.join()


@atexit.register
def _end_running_streams() -> None:
    """Before the interpreter's teardown (which runs after exit hooks): no worker thread left in
    native code. A left stream runs to its end first, unless the process ends on an uncaught
    exception (which the interpreter records as ``sys.last_value`` before the exit hooks run)."""
    uncaught = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    try:
        if not uncaught:
            join_left_streams("before the process exits")
    except KeyboardInterrupt:  # a Ctrl-C while they run out: stop them after all
        pass
    for worker in list(_RUNNING):
        worker.stop("the process is exiting")
