"""TensorBoard logging (asyncpp_ext.training.tensorboard_log): scalars written and read back with
TensorBoard's own EventAccumulator, purge_step on a resumed run, the missing-package error, and the
compute/wait shares of a stage trace."""
import importlib.util
import sys

import numpy as np
import pytest

from asyncpp_ext._ext import C
from asyncpp_ext.training.tensorboard_log import (INSTALL_HINT, StageTraceError, TensorboardLogError,
                                                  TensorboardLogger, TensorboardUnavailableError,
                                                  stage_time_shares)


needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="needs pip install 'asyncpp_ext[tensorboard]'")


def read_scalars(log_dir) -> dict:
    """{tag: [(step, value), ...]} of every scalar in the directory's event files, in file order."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(x):
    """Scalars are stored as 32-bit floats in the event file."""
    return float(np.float32(x))


ROWS = [
    {"step": 1, "loss": 5.25, "lr": 1e-4, "tokens": 512, "elapsed_s": 0.5, "tokens_per_s": 1024.0},
    {"step": 2, "loss": None, "lr": 2e-4, "tokens": 1024, "elapsed_s": 1.0, "skipped": True},
    {"step": 3, "loss": 4.75, "lr": 3e-4, "tokens": 1536, "elapsed_s": 1.4, "tokens_per_s": 1280.0,
     "eval_loss": 4.9, "tflops": 0.5, "mfu": 0.25},
]


@needs_tensorboard
def test_metrics_rows_read_back(tmp_path):
    with TensorboardLogger(tmp_path) as tb:
        for row in ROWS:
            tb.log_metrics(row)
    scalars = read_scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/lr", "eval/loss", "train/tokens_per_s", "train/tflops", "train/mfu"}
    assert scalars["train/tflops"] == [(3, 0.5)] and scalars["train/mfu"] == [(3, 0.25)]
    assert scalars["train/loss"] == [(1, 5.25), (3, 4.75)]  # step 2's None is not logged
    assert scalars["train/lr"] == [(1, f32(1e-4)), (2, f32(2e-4)), (3, f32(3e-4))]
    assert scalars["eval/loss"] == [(3, f32(4.9))]
    assert scalars["train/tokens_per_s"] == [(1, 1024.0), (3, 1280.0)]


@needs_tensorboard
def test_stage_shares_read_back(tmp_path):
    with TensorboardLogger(tmp_path / "tb") as tb:
        tb.log_stage_shares(0, 10, {"compute_share": 0.75, "wait_share": 0.25})
        tb.log_stage_shares(1, 10, {"compute_share": 0.5, "wait_share": 0.5})
        tb.log_stage_shares(1, 20, stage_time_shares([("forward", 0, 0, 0, 0, 3), ("recv_act", 0, 1, 0, 3, 4)]))
    scalars = read_scalars(tmp_path / "tb")
    assert scalars == {"stage0/compute_share": [(10, 0.75)], "stage0/wait_share": [(10, 0.25)],
                       "stage1/compute_share": [(10, 0.5), (20, 0.75)],
                       "stage1/wait_share": [(10, 0.5), (20, 0.25)]}


def log_losses(log_dir, steps, loss_of, purge_step=None):
    with TensorboardLogger(log_dir, purge_step=purge_step) as tb:
        for step in steps:
            tb.log_metrics({"step": step, "loss": loss_of(step), "lr": 1e-3, "tokens": 0, "elapsed_s": 0.0})


@needs_tensorboard
def test_purge_step_drops_the_steps_a_resumed_run_recomputes(tmp_path):
    # First run reached step 6 but its last checkpoint was at step 3: the resumed run logs 4.. again.
    log_losses(tmp_path, range(1, 7), lambda s: 10.0 + s)
    log_losses(tmp_path, range(4, 9), lambda s: 20.0 + s, purge_step=4)
    assert read_scalars(tmp_path)["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0),
                                                    (6, 26.0), (7, 27.0), (8, 28.0)]


@needs_tensorboard
def test_without_purge_step_the_old_steps_stay(tmp_path):
    log_losses(tmp_path, range(1, 7), lambda s: 10.0 + s)
    log_losses(tmp_path, range(4, 6), lambda s: 20.0 + s)
    steps = [s for s, _ in read_scalars(tmp_path)["train/loss"]]
    assert sorted(steps) == [1, 2, 3, 4, 4, 5, 5, 6]


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TensorboardUnavailableError) as info:
        TensorboardLogger(tmp_path)
    message = str(info.value)
    assert INSTALL_HINT == "pip install 'asyncpp_ext[tensorboard]'"
    assert INSTALL_HINT in message and "\n" not in message
    assert isinstance(info.value, ValueError)
    assert list(tmp_path.iterdir()) == []  # nothing written


@needs_tensorboard
def test_bad_rows_and_steps(tmp_path):
    with TensorboardLogger(tmp_path) as tb:
        with pytest.raises(TensorboardLogError, match="needs a 'step'"):
            tb.log_metrics({"loss": 1.0})
        with pytest.raises(TensorboardLogError, match="non-negative integer"):
            tb.log_metrics({"step": -1, "loss": 1.0})
        with pytest.raises(TensorboardLogError, match="stage must be a non-negative integer"):
            tb.log_stage_shares(1.5, 0, {"compute_share": 1.0, "wait_share": 0.0})
    with pytest.raises(TensorboardLogError, match="purge_step"):
        TensorboardLogger(tmp_path, purge_step="3")


# ---- stage_time_shares -----------------------------------------------------------------------

# One microbatch on a middle stage: (op, step, microbatch, version, start_ns, end_ns).
TRACE = [
    ("recv_act", 0, 0, 0, 0, 10),
    ("forward", 0, 0, 0, 10, 30),
    ("send_act", 0, 0, 0, 30, 32),
    ("recv_grad", 0, 0, 0, 32, 50),
    ("backward", 0, 0, 0, 50, 90),
    ("send_grad", 0, 0, 0, 90, 91),
    ("optimizer_step", 0, -1, 1, 95, 100),
]


def test_shares_of_a_synthetic_trace():
    assert stage_time_shares(TRACE) == {"compute_share": 65 / 100, "wait_share": 1 - 65 / 100}
    # window [20, 60): forward 20..30 and backward 50..60
    assert stage_time_shares(TRACE, start_ns=20, end_ns=60)["compute_share"] == 20 / 40
    # window inside one receive: all waiting
    assert stage_time_shares(TRACE, start_ns=33, end_ns=48) == {"compute_share": 0.0, "wait_share": 1.0}
    # window beyond the trace: the stage was idle after its last instruction
    assert stage_time_shares(TRACE, end_ns=200)["compute_share"] == 65 / 200
    # the bindings' Op enum values are read by name like the strings
    as_enums = [(getattr(C.Op, event[0]),) + event[1:] for event in TRACE]
    assert stage_time_shares(as_enums) == stage_time_shares(TRACE)


def test_overlapping_events_count_once():
    doubled = TRACE + [("forward", 0, 0, 0, 15, 35)]  # overlaps forward 10..30 and send 30..32
    assert stage_time_shares(doubled)["compute_share"] == (25 + 40 + 5) / 100


def test_empty_windows_raise():
    with pytest.raises(StageTraceError, match="no duration"):
        stage_time_shares([])
    with pytest.raises(StageTraceError, match="no duration"):
        stage_time_shares(TRACE, start_ns=50, end_ns=50)
    assert stage_time_shares([], start_ns=0, end_ns=10) == {"compute_share": 0.0, "wait_share": 1.0}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "2bw"])
def test_shares_agree_with_the_schedule_simulator(kind):
    # The discrete-event simulator reports each stage's busy (compute) time over the makespan;
    # its timeline, read as a trace, must give the same share.
    sched = C.build_schedule(kind, 3, 4, 3)
    result = C.simulate_schedule(sched, [1000, 2000, 1500], [2000, 4000, 3000], [500, 500, 700], 100)
    makespan = int(result["makespan"])
    for stage in range(3):
        trace = [(op, step, mb, version, int(start), int(end))
                 for s, op, step, mb, version, start, end in result["timeline"] if s == stage]
        shares = stage_time_shares(trace, start_ns=0, end_ns=makespan)
        assert shares["compute_share"] == result["busy"][stage] / result["makespan"]
        assert 0 < shares["compute_share"] < 1
