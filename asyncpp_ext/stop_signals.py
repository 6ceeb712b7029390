"""SIGTERM and SIGHUP as a ``KeyboardInterrupt`` (``Stopped``), for the command lines.

Their default ends the process where it stands: temporary files stay behind, a pipeline's ranks
run on until they notice their launcher is gone, and nothing says what happened. Raised as an
exception instead, they take the path Ctrl-C takes: cleanup in ``finally`` blocks, the ranks
stopped, one line, exit 128 + the signal's number.
"""
from __future__ import annotations

import contextlib
import signal

SIGNAL_NAMES = ("SIGTERM", "SIGHUP")


class Stopped(KeyboardInterrupt):
    """A stop signal (``signum``) raised where the program was."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"stopped by {self.name}"


@contextlib.contextmanager
def stop_signals_raise():
    """SIGTERM and SIGHUP raise ``Stopped`` for the block; the earlier handlers come back after
    it. Outside the main thread (where Python cannot set handlers) nothing changes."""
    def stop(signum, frame):
        raise Stopped(signum)

    numbers = [getattr(signal, n) for n in SIGNAL_NAMES if hasattr(signal, n)]
    try:
        previous = {n: signal.signal(n, stop) for n in numbers}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for number, handler in previous.items():  # None: a handler not set from Python
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


__all__ = ["SIGNAL_NAMES", "Stopped", "stop_signals_raise"]
