"""The console commands' entry points (pyproject.toml ``[project.scripts]``).

Each command's module imports torch or numpy (seconds); a Ctrl-C, SIGTERM or SIGHUP in that time
would print an import's traceback, or be lost where the KeyboardInterrupt landed in a library's
broad ``except`` (the run then trained to the end). Here any of them ends the command during its
imports with one line and exit 128 + the signal's number; the command's own ``main`` handles them
from then on.
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Optional, Sequence

from .stop_signals import signals_handled


def _import_then_run(prog: str, load: Callable[[], Callable], argv: Optional[Sequence[str]]) -> int:
    """``load()`` (the command's imports), during which SIGINT, SIGTERM and SIGHUP end the process
    at once with one line and exit 128 + the signal's number (nothing is written yet; an exception
    could be swallowed by an import's broad ``except``: torch's of numpy is one), then the
    command's ``main(argv)``. A signal the process ignores (a background job's SIGINT) stays ignored."""
    def stop_now(signum, frame):
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        os.write(2, f"\n{prog}: {what} while starting\n".encode())
        os._exit(128 + signum)

    with signals_handled(stop_now):
        main = load()
    return main(argv)


def train(argv: Optional[Sequence[str]] = None) -> int:
    """``asyncpp-train`` (training/cli.py)."""
    def load():
        from .training.cli import main
        return main
    return _import_then_run("asyncpp-train", load, argv)


def prepare_data(argv: Optional[Sequence[str]] = None) -> int:
    """``asyncpp-prepare-data`` (data/prepare.py)."""
    def load():
        from .data.prepare import main
        return main
    return _import_then_run("asyncpp-prepare-data", load, argv)


def export(argv: Optional[Sequence[str]] = None) -> int:
    """``asyncpp-export`` (training/export.py)."""
    def load():
        from .training.export import main
        return main
    return _import_then_run("asyncpp-export", load, argv)


def evaluate(argv: Optional[Sequence[str]] = None) -> int:
    """``asyncpp-eval`` (training/evaluation.py)."""
    def load():
        from .training.evaluation import main
        return main
    return _import_then_run("asyncpp-eval", load, argv)


def sample(argv: Optional[Sequence[str]] = None) -> int:
    """``asyncpp-sample`` (training/sample.py)."""
    def load():
        from .training.sample import main
        return main
    return _import_then_run("asyncpp-sample", load, argv)


def schedule(argv: Optional[Sequence[str]] = None) -> int:
    """``asyncpp-schedule`` (schedule/cli.py)."""
    def load():
        from .schedule.cli import main
        return main
    return _import_then_run("asyncpp-schedule", load, argv)


__all__ = ["evaluate", "export", "prepare_data", "sample", "schedule", "train"]
