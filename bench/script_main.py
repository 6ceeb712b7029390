"""How a bench script runs as a command: ``run_script(main)`` under ``if __name__ == "__main__"``.

A Ctrl-C or a SIGTERM (``timeout``, a job scheduler) ends the script with one line on stderr and
the shell's code for the signal (130, 143), not a traceback. Both unwind the script as an exception
does, so its ``finally`` blocks run: worker processes are stopped and partial files removed."""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM: unwinds the script like a Ctrl-C."""


def _raise_terminated(signum, frame):
    raise Terminated(128 + signum)


def run_script(main: Callable[[], Optional[int]]) -> None:
    """Exit with ``main()``'s code (0 for None); a Ctrl-C or SIGTERM is one line and 130 / 143."""
    prog = os.path.basename(sys.argv[0]) or "bench"
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        code = 128 + signal.SIGINT
    except Terminated as stop:
        print(f"{prog}: stopped by SIGTERM", file=sys.stderr, flush=True)
        code = stop.code
    sys.exit(code or 0)
