"""A terminal's Ctrl-C for tests: SIGINT to a command's whole process group (helpers shared by the
tests that stop a running command)."""
import os
import signal
import subprocess
from typing import Callable


def sigint_by_default() -> None:
    """``preexec_fn``: SIGINT handled as at a terminal (a background job, as CI runs, ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c(proc: subprocess.Popen, ready: Callable[[], None]) -> str:
    """Once ``ready()`` returns, SIGINT to the process group of ``proc`` (started with
    ``start_new_session=True``); its stderr once it ended (killed if it outlives 60 s)."""
    try:
        ready()
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
