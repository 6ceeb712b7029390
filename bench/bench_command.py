"""What every bench script shares as a command.

``run_script(main)`` under ``if __name__ == "__main__"``: a Ctrl-C or a SIGTERM (``timeout``, a job
scheduler) ends the script with one line on stderr and the shell's code for the signal (130, 143),
not a traceback, as the package's commands end (``asyncpp_ext.stop_signals``). Both unwind the
script as an exception does, so its ``finally`` blocks run: worker processes are stopped and
partial files removed.

``BenchError``: a bad input, which the script prints as one line before exiting with 2.
``check_report_path`` / ``write_json``: a ``--json PATH`` report, checked before the first
measurement (a row can take minutes) and written whole or not at all."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Optional


class BenchError(ValueError):
    """A bad input: one line on stderr, exit 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors (its own and ``parser.error``'s) are one line, "PROG: error:
    MESSAGE", exit 2, without the usage block before it (``--help`` still shows the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def require_positive(self, args, names) -> None:
        """``error`` naming the first of the integer options ``names`` (dests) below 1."""
        for name in names:
            if getattr(args, name) < 1:
                self.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")


def check_report_path(path: str, example: str = "report.json", flag: str = "--json") -> None:
    """BenchError unless ``flag PATH`` can be written as ``write_json`` writes it (PATH.tmp, then
    renamed over PATH), and never a rename over a device such as /dev/full. Missing directories
    are made (as the package's commands make theirs), and removed again if the file cannot be
    written there."""
    from asyncpp_ext.directories import make_directories, missing_directories, remove_directories

    target = Path(path)
    if target.exists() and not target.is_file():
        what = "a directory" if target.is_dir() else "not a regular file"
        raise BenchError(f"{flag} {path} is {what}; name a file such as {example}")
    probe, made = Path(f"{path}.tmp"), []
    try:
        made = make_directories(missing_directories(target.absolute().parent))
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        remove_directories(made)
        raise BenchError(f"{flag} {path} cannot be written ({exc.strerror or exc}); choose a writable place") from None


def write_json(path, data) -> None:
    """``data`` as indented JSON in ``path``, whole: written beside it, then renamed over it."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_script(main: Callable[[], Optional[int]]) -> None:
    """Exit with ``main()``'s code (0 for None). A Ctrl-C is one line and 130; SIGTERM and SIGHUP
    are raised as the package's commands raise them (``stop_signals.Stopped``, a KeyboardInterrupt:
    the same unwinding), one line and 128 + the signal's number. Sizes that do not fit in memory
    are one line and 1."""
    from asyncpp_ext.oom import out_of_memory
    from asyncpp_ext.stop_signals import Stopped, stop_signals_raise

    prog = os.path.basename(sys.argv[0]) or "bench"
    try:
        with stop_signals_raise():
            code = main()
    except Stopped as stop:
        print(f"{prog}: {stop}", file=sys.stderr, flush=True)  # "stopped by SIGTERM"
        code = 128 + stop.signum
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        code = 128 + signal.SIGINT
    except (MemoryError, RuntimeError) as exc:
        text = out_of_memory(exc)
        if text is None:
            raise
        print(f"{prog}: out of memory ({text}); lower the sizes given (see --help)", file=sys.stderr, flush=True)
        code = 1
    sys.exit(code or 0)
