"""``--stop-on-signal``: a batch system's warning signal stops the run at the end of its current
segment with a checkpoint, every stage of a pipeline at the same step (whichever rank the signal
reached), and a resume continues it loss for loss as a run that never stopped."""
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.stop_request import signal_name
from asyncpp_ext.training.time_limit import SegmentClock, capped_end
from group_signals import signal_once_training
from stopped_runs import check_resumes_as_never_stopped, check_stopped

COMMON = ["--model", "tiny", "--no-progress", "--eval-every", "50", "--ckpt-every", "1000", "--threads", "1"]


@pytest.mark.parametrize("text, name", [("usr1", "SIGUSR1"), ("SIGUSR2", "SIGUSR2"), (" term ", "SIGTERM"),
                                        ("none", None)])
def test_signal_names(text, name):
    assert signal_name(text) == name


@pytest.mark.parametrize("text", ["INT", "SIGKILL", "9", "", "usr3"])
def test_other_signals_are_refused(text):
    with pytest.raises(ValueError, match="is not one of USR1, USR2, TERM"):
        signal_name(text)


def test_segments_are_capped_at_the_response_time():
    assert capped_end(10, 1000, 5.0, None) == 11  # no time per step yet: one step
    assert capped_end(10, 1000, 5.0, 0.5) == 20  # 5 s of 0.5 s steps
    assert capped_end(10, 15, 5.0, 0.5) == 15  # the segment's own end comes first
    assert capped_end(10, 1000, 5.0, 60.0) == 11  # steps longer than the cap: one at a time
    clock = SegmentClock(None, time.perf_counter(), cap_s=5.0)
    assert clock.sizes_segments and clock.first_end(10, 1000) == 11
    clock.trained(8, 1.0)  # 0.125 s per step
    assert clock.next_end(11, 1000, checkpoint_due=False) == 51
    assert not SegmentClock(None, 0.0).sizes_segments and SegmentClock(None, 0.0).first_end(10, 1000) == 1000


def _rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes, oldest first: the descendants without children of their own
    but multiprocessing's resource tracker (under the forkserver, the ranks are its children)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append((int(entry.name), cmdline))
    leaves, todo = [], [launcher]
    while todo:
        for pid, cmdline in children.get(todo.pop(), []):
            if pid in children:
                todo.append(pid)
            elif b"resource_tracker" not in cmdline:
                leaves.append(pid)
    return sorted(leaves)


def _stopped_run(run, flags, signum, to_first_rank=False):
    """Start a run of 1,000,000 steps, send ``signum`` once its first rows are written (to the
    command, or to its first rank alone), and return its exit status and stdout."""
    def first_rank(proc):
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        return ranks[0]

    # without the stop it would train for an hour: signal_once_training kills it after 120 s
    rc, out, err = signal_once_training([sys.executable, "-m", "asyncpp_ext.train", *COMMON, *flags, "--steps",
                                         "1000000", "--signal-response", "1s", "--out", str(run)], run, signum,
                                        **({"target": first_rank} if to_first_rank else {}))
    assert rc == 0 and err == "", err
    return out


@pytest.mark.parametrize("flags, signum, to_first_rank", [
    (["--simulate", "--stop-on-signal", "usr1"], signal.SIGUSR1, False),
    (["--stages", "2", "--timeout", "30", "--stop-on-signal", "TERM"], signal.SIGTERM, False),
    (["--stages", "2", "--timeout", "30", "--stop-on-signal", "USR2"], signal.SIGUSR2, True),
], ids=["one-process", "2-stage-pipeline", "2-stage-first-rank-only"])
def test_a_signalled_run_stops_with_a_checkpoint_and_resumes_as_if_never_stopped(tmp_path, flags, signum,
                                                                                   to_first_rank):
    run = tmp_path / "run"
    out = _stopped_run(run, flags, signum, to_first_rank)
    name = signal.Signals(signum).name
    stopped = check_stopped(run, name, 2 if "--stages" in flags else 1, out, f"{name} (--stop-on-signal)")
    # resumed 5 steps further, the signal dropped: the losses of a run that never stopped
    plain = [f for f in flags if f not in ("--stop-on-signal", "usr1", "TERM", "USR2")]
    check_resumes_as_never_stopped(run, stopped, ["--stop-on-signal", "none"], [*COMMON, *plain], tmp_path / "straight")
    meta = json.loads((run / f"ckpt-{stopped + 5:06d}" / "meta.json").read_text())
    assert meta["config"]["train"]["stop_signal"] is None


@pytest.mark.parametrize("flags, words", [
    (["--stop-on-signal", "INT"], "--stop-on-signal: 'INT' is not one of USR1, USR2, TERM"),
    (["--stop-on-signal", "usr1", "--no-checkpoints"], "--no-checkpoints writes none"),
    (["--stop-on-signal", "usr1", "--signal-response", "0s"], "--signal-response: '0s' is not a positive"),
])
def test_bad_signal_flags_are_one_line(tmp_path, capsys, flags, words):
    assert train([*COMMON, "--simulate", "--steps", "3", *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "r").exists()


def test_without_the_flag_a_warning_signal_stops_with_a_line_naming_it(tmp_path):
    """SIGUSR1's default would end the run without a word (a batch job's log: nothing); it stops as
    SIGTERM does, 128 + its number, the line naming the flag that would have checkpointed."""
    run = tmp_path / "run"
    rc, _, err = signal_once_training([sys.executable, "-m", "asyncpp_ext.train", *COMMON, "--simulate",
                                       "--steps", "1000000", "--eval-every", "1", "--out", str(run)], run,
                                      signal.SIGUSR1)
    assert rc == 128 + signal.SIGUSR1, (rc, err)
    assert err.strip() == "asyncpp-train: stopped by SIGUSR1 (--stop-on-signal USR1 stops at a checkpoint instead)"
