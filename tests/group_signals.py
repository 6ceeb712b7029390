"""A terminal's Ctrl-C for tests: SIGINT to a command's whole process group (helpers shared by the
tests that stop a running command)."""
import os
import signal
import subprocess
import time
from pathlib import Path
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


def signal_once_training(cmd: list, run: Path, signum: int,
                         target: Callable[[subprocess.Popen], int] = lambda proc: proc.pid) -> tuple[int, str, str]:
    """Start ``cmd`` (a training command writing to ``run``), send ``signum`` to ``target(proc)`` once
    its first metrics rows are written, and return its (exit status, stdout, stderr); killed if it
    does not start within 120 s or end within 120 s of the signal."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = Path(run) / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.kill(target(proc), signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err
