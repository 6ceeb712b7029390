"""A ``--stop-on-signal`` signal that reaches a spawned rank while it is still starting (before its
noting is in place) is kept for it, not taken as a stop of that rank: the run then stops at a
checkpoint as for a signal that came later."""
import os
import signal
import time

import pytest

from asyncpp_ext.stop_signals import notes_early, take_early_notes
from asyncpp_ext.training import stop_request


def _deliver(signum):
    """Send ``signum`` to this process and give its handler (main thread) a moment to run."""
    os.kill(os.getpid(), signum)
    time.sleep(0.1)


def test_a_note_taken_early_is_the_noting_blocks():
    with notes_early(["SIGUSR1"]):
        _deliver(signal.SIGUSR1)
    with stop_request.noting("SIGUSR1"):
        assert stop_request.requested()
    with stop_request.noting("SIGUSR1"):  # taken once
        assert not stop_request.requested()


def test_an_early_note_of_another_signal_is_not_this_ones():
    with notes_early(["SIGUSR2"]):
        _deliver(signal.SIGUSR2)
    with stop_request.noting("SIGUSR1"):
        assert not stop_request.requested()
    assert take_early_notes() == []


def _rank_signalled_while_starting(result_dir):
    """A rank that gets the forwarded signal before its noting begins (sent to itself here, as its
    launcher would pass it on), then notes as rank_main does."""
    import torch.distributed as dist
    from asyncpp_ext.pipeline import init_distributed

    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.2)
    init_distributed(30)
    with stop_request.noting("SIGUSR1"):
        noted = stop_request.requested()
    with open(os.path.join(result_dir, f"rank{dist.get_rank()}"), "w") as f:
        f.write(str(noted))


@pytest.mark.multiproc
def test_a_spawned_rank_keeps_a_signal_that_came_before_its_noting(tmp_path):
    from asyncpp_ext.pipeline import spawn

    spawn(_rank_signalled_while_starting, 2, (str(tmp_path),), forward=("SIGUSR1",))
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True", "True"]
