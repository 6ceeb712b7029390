"""A chain of batch jobs running one command from a config file: the first job is warned with
SIGUSR1 and stops with a checkpoint, the second continues the run to its end, a third finds
nothing to do -- and the run's losses are those of one job that ran straight through."""
import json
import signal
import sys

import pytest

from asyncpp_ext.training.cli import main as train
from group_signals import signal_once_training

CONFIG = """\
model = "tiny"
seq-len = 16
steps = {steps}
stages = 2
timeout = 60
threads = 1
eval-every = 50
ckpt-every = 1000
progress = false
[batch-job]
auto-resume = true
stop-on-signal = "USR1"
signal-response = "1s"
log-every = 50
"""


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_command_trains_a_run_across_jobs(tmp_path):
    pytest.importorskip("tomllib", reason="the job's file is TOML (Python 3.11's tomllib)")
    run, straight = tmp_path / "run", tmp_path / "straight"
    (tmp_path / "job.toml").write_text(CONFIG.format(steps=1_000_000))
    job = [sys.executable, "-m", "asyncpp_ext.train", "--config", str(tmp_path / "job.toml"), "--out", str(run)]
    rc, out, err = signal_once_training(job, run, signal.SIGUSR1)
    assert rc == 0 and err == "" and "SIGUSR1 (--stop-on-signal): stopped at step" in out, (out, err)
    stopped = len(_losses(run))
    # the next job, with the run's length now set: it resumes and runs to the end
    (tmp_path / "job.toml").write_text(CONFIG.format(steps=stopped + 20))
    assert train(["--config", str(tmp_path / "job.toml"), "--out", str(run)]) == 0
    assert train(["--config", str(tmp_path / "job.toml"), "--out", str(run)]) == 0  # nothing left to do
    (tmp_path / "straight.toml").write_text(CONFIG.format(steps=stopped + 20).split("[batch-job]")[0])
    assert train(["--config", str(tmp_path / "straight.toml"), "--out", str(straight)]) == 0
    assert _losses(run) == _losses(straight) and len(_losses(run)) == stopped + 20
