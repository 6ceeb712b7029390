"""``--time-limit``: a run stops with a checkpoint before its time is up, every stage of a pipeline
at the same step, and a resume continues it loss for loss as a run without the limit."""
import threading
import time

import pytest

from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.async_checkpoint import BackgroundWriter
from asyncpp_ext.training.time_limit import SLACK, SegmentClock, describe_duration, limited_end, parse_duration
from stopped_runs import check_resumes_as_never_stopped, check_stopped, rows_of

COMMON = ["--model", "tiny", "--no-progress", "--eval-every", "50", "--ckpt-every", "1000", "--threads", "1"]


@pytest.mark.parametrize("text, seconds", [("90", 5400.0), ("45s", 45.0), ("30m", 1800.0), ("2h", 7200.0),
                                           ("1h30m", 5400.0), ("1.5h", 5400.0), (" 2H ", 7200.0),
                                           ("1h2m3s", 3723.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "-5", "abc", "1x", "m", "1h1h", "0s", "nan", "inf", "1h 30m", ""])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_durations_described():
    assert [describe_duration(s) for s in (5400, 45, 3723, 7200)] == ["1h30m", "45s", "1h2m3s", "2h"]


def test_segment_ends():
    assert limited_end(10, 100, 0.0, 60.0, None, 0.0) == 11  # no time per step yet: one step
    assert limited_end(10, 100, 0.0, 60.0, None, 0.0) == limited_end(10, 11, 50.0, 60.0, None, 9.0)
    # 60 s budget, 20 s gone, 5 s kept for a checkpoint: 35 s of 1 s steps counted SLACK slower
    assert limited_end(10, 1000, 20.0, 60.0, 1.0, 5.0) == 10 + int(35 // SLACK)
    assert limited_end(10, 20, 20.0, 60.0, 1.0, 5.0) == 20  # the segment's own end comes first
    assert limited_end(10, 1000, 59.5, 60.0, 1.0, 0.0) == 10  # not one more step fits: stop here
    assert limited_end(10, 1000, 70.0, 60.0, 1.0, 0.0) == 10
    assert limited_end(10, 1000, 20.0, 60.0, 1.0, 50.0) == 10  # the checkpoint alone would not fit


def test_a_background_write_is_kept_in_reserve_once_it_has_run_not_only_at_the_next_checkpoint():
    # A segment is sized before the checkpoint due at its start is saved: a write in the background
    # that finished during the segment before (or runs still) must already count then, or with a
    # run's first two checkpoints before its limit the stop's checkpoint overran by the write.
    release = threading.Event()
    writer = BackgroundWriter()
    began = time.perf_counter()
    clock, plain = SegmentClock(100.0, began), SegmentClock(100.0, began)  # plain: no writer
    clock.write_s = writer.write_s
    for c in (clock, plain):
        c.trained(10, 1.0)  # 0.1 s per step; the loop's part of a checkpoint: nothing

    def kept_s() -> float:  # the time the writer's reserve takes from the segment (twice: one is due)
        return (plain.next_end(10, 10**6, checkpoint_due=True) - clock.next_end(10, 10**6, checkpoint_due=True)) \
            * SLACK * 0.1

    assert kept_s() == 0.0  # no write yet
    writer.start(lambda: release.wait(10))
    time.sleep(0.5)
    assert 2 * 0.5 - 0.2 <= kept_s() < 2 * 10  # a write still running: its time so far
    release.set()
    writer.wait()
    assert writer.write_s() == writer.last_write_s >= 0.5
    assert abs(kept_s() - 2 * writer.last_write_s) < 0.2  # a finished one: its whole time


@pytest.mark.parametrize("flags", [["--simulate"], ["--stages", "2", "--timeout", "30"]],
                         ids=["one-process", "2-stage-pipeline"])
def test_a_run_stops_with_a_checkpoint_and_resumes_as_if_never_stopped(tmp_path, capfd, flags):
    run = tmp_path / "run"
    # the limit counts from the command's start: a 2-stage pipeline's ranks take seconds to start
    assert train([*COMMON, *flags, "--steps", "1000000", "--time-limit", "3s", "--out", str(run)]) == 0
    out = capfd.readouterr().out  # a pipeline's line comes from its last stage's process
    # (the first segment is one step; a machine slow enough may stop right after it)
    stopped = check_stopped(run, "time limit", 2 if "--stages" in flags else 1, out, "--time-limit 3s")
    # resumed to 5 steps past the stop without the limit: the losses of a run that never stopped
    check_resumes_as_never_stopped(run, stopped, ["--time-limit", "1h"], [*COMMON, *flags], tmp_path / "straight")


def test_the_limit_counts_the_start_up(tmp_path, monkeypatch):
    """Three seconds of start-up (a slow data read) are part of a 5 s limit: the steps stop
    before 5 s have passed since the command started, not since its training loop did."""
    import time

    from asyncpp_ext.training import run as run_module

    build_run_data = run_module.build_run_data

    def slow_build_run_data(cfg):
        time.sleep(3.0)
        return build_run_data(cfg)

    monkeypatch.setattr(run_module, "build_run_data", slow_build_run_data)
    run = tmp_path / "run"
    began = time.time()
    assert train([*COMMON, "--simulate", "--steps", "1000000", "--time-limit", "5s", "--out", str(run)]) == 0
    rows = rows_of(run)
    assert rows[-1]["stopped"] == "time limit" and rows[-1]["step"] > 1
    assert rows[0]["time"] - rows[0]["elapsed_s"] > began + 3.0  # the loop started after the start-up
    # the loop had the 2 s the start-up left, not 5 s (steps on a busy machine can outrun the
    # estimate by a little: the stop is an estimate, the start-up's 3 s are not)
    assert rows[-1]["elapsed_s"] < 3.0


@pytest.mark.parametrize("flags, words", [
    (["--time-limit", "0"], "--time-limit: '0' is not a positive duration"),
    (["--time-limit", "1x"], "--time-limit: '1x' is not a duration"),
    (["--time-limit", "1h", "--no-checkpoints"], "--no-checkpoints writes none"),
])
def test_bad_limits_are_one_line(tmp_path, capsys, flags, words):
    assert train([*COMMON, "--simulate", "--steps", "3", *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "r").exists()
