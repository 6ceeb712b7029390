"""``--stop-on-signal``: a signal that asks the run to stop with a checkpoint, to be resumed.

Batch systems warn a job before they end it: SLURM's ``--signal=USR1@120`` sends SIGUSR1 two
minutes before the time limit, a preemption sends SIGTERM and waits a grace time before SIGKILL.
Without a handler the run ends where it is (SIGUSR1's default ends the process; SIGTERM is a stop
with one line, stop_signals.py) and the steps since its last checkpoint are lost. With
``--stop-on-signal SIGNAL`` the signal is only noted here; the trainer asks ``requested()`` at the
end of each segment, whose length ``--signal-response`` bounds, and the ranks of a pipeline agree
on the stop (any rank that noted it stops them all: the same all-reduce as ``--time-limit``'s). The
run then writes a checkpoint and exits 0.

Each process notes its own signals: a spawned pipeline's launcher passes the signal on to its
ranks (``pipeline.launch.spawn``'s ``forward``); ranks started otherwise (torchrun) must each
receive it.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator, Optional

from ..stop_signals import signals_handled, take_early_notes

CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")
"""The signals ``--stop-on-signal`` takes: a batch system's warnings. SIGINT stays Ctrl-C's stop."""

_noted: list[int] = []  # the signals noted in this process since the outermost ``noting`` began
_noting: list[str] = []  # the signal being noted, while a ``noting`` block runs


def signal_name(text: str) -> Optional[str]:
    """"SIGUSR1" for "usr1", "USR1" or "SIGUSR1"; None for "none"; ValueError for anything else."""
    name = text.strip().upper()
    if name == "NONE":
        return None
    name = name if name.startswith("SIG") else "SIG" + name
    if name not in CHECKPOINT_SIGNALS:
        raise ValueError(f"{text!r} is not one of {', '.join(s[3:] for s in CHECKPOINT_SIGNALS)} (or none)")
    return name


@contextlib.contextmanager
def noting(name: Optional[str]) -> Iterator[None]:
    """For the block, signal ``name`` (None: nothing changes) is noted for ``requested()`` instead of
    taking its usual effect; notes from before the block are forgotten, but those of the same
    signal ``stop_signals.notes_early`` took while a spawned rank was starting. Inside a block
    noting the same signal (a torchrun rank: the command's block, then the rank's) nothing
    changes either."""
    if name is None or name in _noting:
        yield
        return
    _noted[:] = [number for number in take_early_notes() if number == getattr(signal, name)]
    _noting.append(name)
    try:
        with signals_handled(lambda number, frame: _noted.append(number), [getattr(signal, name)]):
            yield
    finally:
        _noting.remove(name)


def requested() -> bool:
    """Whether this process noted its stop signal since ``noting`` began."""
    return bool(_noted)


__all__ = ["CHECKPOINT_SIGNALS", "noting", "requested", "signal_name"]
