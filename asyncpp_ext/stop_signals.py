"""Stop requests (Ctrl-C, SIGTERM, SIGHUP) for the command lines: one place that sets their handlers.

A SIGTERM's or SIGHUP's default ends the process where it stands: temporary files stay behind, a
pipeline's ranks run on until they notice their launcher is gone, and nothing says what happened.
``stop_signals_raise`` raises them as an exception (``Stopped``, a KeyboardInterrupt) instead, so
they take the path Ctrl-C takes: cleanup in ``finally`` blocks, the ranks stopped, one line, exit
128 + the signal's number. ``signals_handled`` is the building block the other uses share (the
commands' start-up, asyncpp-prepare-data's final renames).

A signal the process ignores stays ignored: ``nohup`` sets SIGHUP ignored so that a closed terminal
does not stop the run, and a script's background job ignores SIGINT.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterator

SIGNAL_NAMES = ("SIGTERM", "SIGHUP")
"""Raised as ``Stopped`` by ``stop_signals_raise``."""
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", *SIGNAL_NAMES) if hasattr(signal, name))
"""Every stop request: Ctrl-C, SIGTERM and SIGHUP (where the platform has them)."""


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
def signals_handled(handler: Callable, numbers=STOP_SIGNALS) -> Iterator[None]:
    """``handler`` for the signals ``numbers`` during the block, except those the process ignores;
    the earlier handlers come back after it. Outside the main thread (where Python cannot set
    handlers) nothing changes."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for number in numbers:
            if signal.getsignal(number) is not signal.SIG_IGN:
                previous[number] = signal.signal(number, handler)
    try:
        yield
    finally:
        for number, earlier in previous.items():  # None: a handler not set from Python
            signal.signal(number, signal.SIG_DFL if earlier is None else earlier)


def stop_signals_raise():
    """SIGTERM and SIGHUP raise ``Stopped`` for the block (a context manager)."""
    def stop(signum, frame):
        raise Stopped(signum)

    return signals_handled(stop, [getattr(signal, n) for n in SIGNAL_NAMES if hasattr(signal, n)])


def die_with_parent(parent: int, exit_code: int = 1) -> None:
    """SIGKILL this process when its parent exits (Linux's PR_SET_PDEATHSIG; elsewhere nothing): a
    helper process -- a pipeline rank, a tokenizer worker -- must not run on, holding memory and
    writing files, after the process that started it was killed outright (SIGKILL, the kernel's
    out-of-memory killer), which leaves it no chance to stop its helpers. ``parent`` is the pid
    the parent had when it started this one: if that one is gone already, exit with ``exit_code``."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent was gone before the request took effect
        os._exit(exit_code)


__all__ = ["SIGNAL_NAMES", "STOP_SIGNALS", "Stopped", "die_with_parent", "signals_handled", "stop_signals_raise"]
