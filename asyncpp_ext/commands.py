"""The console commands' entry points (pyproject.toml ``[project.scripts]``).

Each command's module imports torch or numpy (seconds); a Ctrl-C, SIGTERM or SIGHUP in that time
would print an import's traceback, or be lost where the KeyboardInterrupt landed in a library's
broad ``except`` (the run then trained to the end). Here any of them ends the command during its
imports with one line and exit 128 + the signal's number; the command's own ``main`` handles them
from then on.
"""
from __future__ import annotations

import importlib
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


def _command(prog: str, module: str) -> Callable[[Optional[Sequence[str]]], int]:
    """The console entry point of ``prog``: ``module``'s ``main``, imported when the command runs."""
    def run(argv: Optional[Sequence[str]] = None) -> int:
        return _import_then_run(prog, lambda: importlib.import_module(module, __package__).main, argv)
    run.__doc__ = f"``{prog}`` ({module.lstrip('.').replace('.', '/')}.py)."
    return run


train = _command("asyncpp-train", ".training.cli")
prepare_data = _command("asyncpp-prepare-data", ".data.prepare")
export = _command("asyncpp-export", ".training.export")
evaluate = _command("asyncpp-eval", ".training.evaluation")
sample = _command("asyncpp-sample", ".training.sample")
schedule = _command("asyncpp-schedule", ".schedule.cli")
compare = _command("asyncpp-compare", ".training.compare")


__all__ = ["compare", "evaluate", "export", "prepare_data", "sample", "schedule", "train"]
