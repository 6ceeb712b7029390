"""Stop requests (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) for the command lines: one place that
sets their handlers.

A SIGTERM's or SIGHUP's default ends the process where it stands -- and so does SIGUSR1's and
SIGUSR2's, which batch systems send as a warning before a job's time runs out (SLURM's
``--signal``): temporary files stay behind, a
pipeline's ranks run on until they notice their launcher is gone, and nothing says what happened.
``stop_signals_raise`` raises them as an exception (``Stopped``, a KeyboardInterrupt) instead, so
they take the path Ctrl-C takes: cleanup in ``finally`` blocks, the ranks stopped, one line, exit
128 + the signal's number. ``signals_handled`` is the building block the other uses share (the
commands' start-up, asyncpp-prepare-data's final renames).

A signal the process ignores stays ignored: ``nohup`` sets SIGHUP ignored so that a closed terminal
does not stop the run, and a script's background job ignores SIGINT.
"""
from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterator

SIGNAL_NAMES = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""Raised as ``Stopped`` by ``stop_signals_raise``."""
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", *SIGNAL_NAMES) if hasattr(signal, name))
"""Every stop request: Ctrl-C and SIGNAL_NAMES (where the platform has them)."""


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


_early: list[int] = []  # signals noted by ``notes_early`` and not yet taken


@contextlib.contextmanager
def notes_early(names) -> Iterator[None]:
    """For the block, the signals ``names`` ("SIGUSR1", ...) are noted (``take_early_notes``)
    instead of stopping the process. A pipeline's rank starts under it for the signal its launcher
    passes on (``--stop-on-signal``), which may arrive while the rank is still setting up, before
    its own noting is in place: without this it would stop the rank instead of the run at a
    checkpoint."""
    with signals_handled(lambda signum, frame: _early.append(signum),
                         [getattr(signal, name) for name in names if hasattr(signal, name)]):
        yield


def take_early_notes() -> list[int]:
    """The signals ``notes_early`` noted since the last call (then forgotten)."""
    taken = list(_early)
    del _early[:len(taken)]
    return taken


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Stopped`` for the block, and no stop request is lost: Python drops
    an exception raised where nothing can catch it -- a signal handler run inside a weakref callback
    or a ``__del__`` that the garbage collector called -- with an "Exception ignored in" note, and
    the program would run on; such a stop (Ctrl-C's KeyboardInterrupt too) is delivered again, to
    be raised where the program is once that call returns."""
    def stop(signum, frame):
        raise Stopped(signum)

    with signals_handled(stop, [getattr(signal, n) for n in SIGNAL_NAMES if hasattr(signal, n)]), \
            _stops_redelivered():
        yield


@contextlib.contextmanager
def _stops_redelivered() -> Iterator[None]:
    """``sys.unraisablehook`` for the block: a dropped KeyboardInterrupt (``Stopped`` included) is
    raised again as its signal, from a thread of its own: raised here, the handler would run inside
    this hook, which drops it too; from another thread it runs in the main thread once that is back
    in the program (or, dropped again, comes back here). Other unraisable exceptions go to the hook
    before."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # _thread: threading's start() waits for the thread in Python code, where the handler
            # would run (and be dropped) again
            _thread.start_new_thread(signal.raise_signal, (getattr(unraisable.exc_value, "signum", signal.SIGINT),))
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


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
