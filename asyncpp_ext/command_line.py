"""The commands' argument parser and the end of their ``main`` (standard library only).

argparse prints its usage block before a complaint and exits; every command here answers a bad
command line with one line ``PROG: error: ...`` and exit 2, as it answers every other bad input.
``OneLineParser`` raises argparse's complaint as a ``UsageError`` for the command's ``main`` to
print so; ``run_command`` is that ``main`` for the commands that read a checkpoint
(``asyncpp-export``, ``asyncpp-sample``, ``asyncpp-eval``).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

from .oom import out_of_memory
from .stop_signals import Stopped, stop_signals_raise


class UsageError(ValueError):
    """A bad command line (argparse's complaints, conflicting flags, an unusable path); the message
    names the argument and the fix."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def run_command(prog: str, work: Callable[[], None], bad_input: tuple, *, stopped_note: str = "",
                oom_hint: str = "", other: Optional[Callable[[Exception], Optional[int]]] = None) -> int:
    """``work()`` under the stop signals (stop_signals.py), and its exit code: 0 when it returns;
    141 (128 + SIGPIPE), silently, when stdout's reader closed it;
    130 / 128 + the signal's number after a line ``PROG: interrupted`` (or ``stopped by SIGTERM``)
    followed by ``stopped_note``; 2 after a line ``PROG: error: ...`` for the ``bad_input``
    exceptions; ``other(exc)``'s code where it gives one (it printed its line); 1 after a line for
    an allocation failure, followed by ``oom_hint``. Anything else is a bug and raises."""
    try:
        with stop_signals_raise():
            work()
        return 0
    except BrokenPipeError:  # the reader of stdout went away (``| head``): stop quietly, as a Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + 13  # SIGPIPE's
    except KeyboardInterrupt as exc:
        what = f"stopped by {exc.name}" if isinstance(exc, Stopped) else "interrupted"
        sys.stdout.flush()  # what was printed before the stop stays above its line
        sys.stderr.write(f"\n{prog}: {what}{stopped_note}\n")
        return 128 + exc.signum if isinstance(exc, Stopped) else 130
    except bad_input as exc:
        sys.stdout.flush()
        sys.stderr.write(f"{prog}: error: {' '.join(str(exc).split())}\n")
        return 2
    except Exception as exc:
        code = other(exc) if other is not None else None
        if code is not None:
            return code
        text = out_of_memory(exc)
        if text is None:
            raise
        sys.stderr.write(f"{prog}: error: out of memory ({text}){oom_hint}\n")
        return 1


def check_json_path(path: Optional[str], example: str = "rows.json") -> None:
    """UsageError (one line) unless ``path`` (a command's ``--json FILE``; None: not given) names a
    file in a directory that exists."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--json {path} is a directory; name a file such as {os.path.join(path, example)}")
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise UsageError(f"--json {path}: {parent} is a file, not a directory")
    if not os.path.isdir(parent):
        raise UsageError(f"--json {path}: its directory does not exist")


__all__ = ["OneLineParser", "UsageError", "check_json_path", "run_command"]
