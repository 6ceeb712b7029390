"""``python -m asyncpp_ext.train``: the ``asyncpp-train`` command (implemented in ``training.cli``,
imported by ``commands.train`` so that a stop request during the imports ends with one line)."""
import os
import sys

from .commands import train as main


def _end_torchrun_rank(code) -> None:
    """A torchrun rank that failed or was stopped leaves without the interpreter's teardown, as a
    spawned rank does (``pipeline/launch.py``): its stage's worker thread may still be inside the
    transport's native code, and tearing that down under it aborts the process ("terminate called
    without an active exception"). Its line is written and its files closed by then."""
    from .pipeline.launch import spawned_locally, under_launcher

    if code not in (0, None) and under_launcher() and not spawned_locally():
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
