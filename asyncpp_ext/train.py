"""``python -m asyncpp_ext.train``: the ``asyncpp-train`` command (implemented in ``training.cli``,
imported by ``commands.train`` so that a stop request during the imports ends with one line)."""
import os
import sys

from .commands import train as main


def _end_torchrun_rank(code) -> None:
    """A torchrun rank that failed or was stopped while its stage's worker thread still runs
    leaves without the interpreter's teardown, as a spawned rank does (``pipeline/launch.py``):
    the thread may be inside the transport's native code, and ending it there at teardown aborts
    the process ("terminate called without an active exception"). Its line is written and its
    files closed by then. Other ranks end as usual (rank 0 holds the rendezvous store, which the
    other ranks may still be reading to reach their own message)."""
    from .pipeline.launch import spawned_locally, under_launcher
    from .pipeline.stream_worker import stage_workers_running

    if code in (0, None) or not under_launcher() or spawned_locally():
        return
    if stage_workers_running():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as stop:  # a rank that lost its peer (training/distributed.py)
        status = stop.code
    _end_torchrun_rank(status)
    raise SystemExit(status)
