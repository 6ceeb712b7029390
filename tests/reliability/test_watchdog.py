"""The watchdog in-process: fires only when armed and idle, reports, picks the exit code; the
timeout comes from --timeout, ASYNCPP_TIMEOUT or the default."""
import json
import threading
import time

import pytest

from asyncpp_ext.pipeline.watchdog import (EXIT_PEER_LOST, EXIT_STALLED, Watchdog, default_timeout_s)
from asyncpp_ext.training.cli import main


def _watchdog(timeout_s=0.4, warmup_factor=1.0):
    exits = []
    wd = Watchdog(timeout_s, "rank 7 (stage 2)", pending=lambda: ["stage 2: gradient recv from stage 3"],
                  exit_fn=exits.append, warmup_factor=warmup_factor)
    return wd, exits


def test_a_stuck_instruction_is_reported_once_with_exit_code_stalled(capfd):
    wd, exits = _watchdog()
    release = threading.Event()
    with wd.armed("training"):
        wd.beat("forward (step 0, microbatch 0, version 0)")
        with wd.doing("backward (step 0, microbatch 0, version 0)", waits_on_peer=False):
            assert wd.fired.wait(3)
            release.set()
    assert exits == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert err.count("asyncpp: rank 7 (stage 2): watchdog: no instruction completed for") == 1
    assert "  last completed: forward (step 0, microbatch 0, version 0)" in err
    assert "  in progress:    backward (step 0, microbatch 0, version 0)" in err
    assert "  pending:        stage 2: gradient recv from stage 3" in err


def test_waiting_on_a_peer_exits_as_peer_lost():
    wd, exits = _watchdog()
    with wd.armed("training"), wd.doing("waiting for a recv", waits_on_peer=True):
        assert wd.fired.wait(3)
    assert exits == [EXIT_PEER_LOST]


def test_progress_and_disarming_keep_it_quiet():
    wd, exits = _watchdog(timeout_s=0.3)
    with wd.armed("training"):
        for _ in range(12):  # 1.2 s of steady progress, four timeouts long
            time.sleep(0.1)
            wd.beat("forward")
    time.sleep(0.8)  # idle but not armed (e.g. writing a checkpoint)
    assert exits == [] and not wd.fired.is_set()


def test_the_first_instruction_gets_the_warmup_allowance():
    wd, exits = _watchdog(timeout_s=0.3, warmup_factor=4.0)
    with wd.armed("training"):
        time.sleep(0.7)  # a slow first forward: > timeout, < 4 x timeout
        wd.beat("forward")
        assert not wd.fired.is_set()
        assert wd.fired.wait(2)  # after progress, the normal timeout applies again
    assert exits == [EXIT_PEER_LOST]


def test_timeout_from_flag_env_and_default(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCPP_TIMEOUT", raising=False)
    assert default_timeout_s() == 300.0
    monkeypatch.setenv("ASYNCPP_TIMEOUT", "42.5")
    assert default_timeout_s() == 42.5
    fast = ["--simulate", "--no-progress", "--n-layer", "1", "--micro-batch-size", "4",
            "--microbatches", "2", "--steps", "1"]
    assert main(fast + ["--out", str(tmp_path / "env")]) == 0
    assert main(fast + ["--timeout", "7", "--out", str(tmp_path / "flag")]) == 0
    saved = {k: json.loads((tmp_path / k / "config.json").read_text())["train"] for k in ("env", "flag")}
    assert saved["env"]["timeout_s"] == 42.5 and saved["flag"]["timeout_s"] == 7.0
    assert saved["env"]["on_nonfinite"] == "stop"
    with pytest.raises(ValueError, match="timeout_s=0 is not a positive number of seconds"):
        Watchdog(0, "x")


class _FakeProgress:
    """Stands in for asyncpp_ext._C.Progress.snapshot: what a running executor shows."""

    def __init__(self):
        self.state = {"completed": 0, "current": None, "current_for_s": 0.0, "last_done": None}

    def run(self, instruction):
        self.state = dict(self.state, current=instruction, current_for_s=0.0)

    def finish(self):
        self.state = dict(self.state, completed=self.state["completed"] + 1, current=None,
                          last_done=self.state["current"])

    def __call__(self):
        return dict(self.state)


def test_followed_progress_keeps_it_quiet_while_instructions_complete():
    wd, exits = _watchdog(timeout_s=0.3)
    progress = _FakeProgress()
    wd.follow(progress)
    with wd.armed("training"):
        for mb in range(12):  # 1.2 s, four timeouts long, with no beat(): only the executor's count moves
            progress.run(("forward", 0, mb, 0))
            time.sleep(0.1)
            progress.finish()
    assert exits == [] and not wd.fired.is_set()


@pytest.mark.parametrize("instruction, code, text", [
    (("backward", 3, 1, 2), EXIT_STALLED, "backward (step 3, microbatch 1, version 2)"),
    (("recv_grad", 3, 2, 2), EXIT_PEER_LOST, "recv_grad (step 3, microbatch 2, version 2)"),
    (("optimizer_step", 3, -1, 4), EXIT_STALLED, "optimizer_step (step 3, new version 4)")])
def test_a_followed_instruction_that_never_ends_is_reported_with_its_cause(capfd, instruction, code, text):
    wd, exits = _watchdog()
    progress = _FakeProgress()
    wd.follow(progress)
    with wd.armed("training"):
        progress.run(("forward", 3, 0, 2))
        progress.finish()
        progress.run(instruction)
        assert wd.fired.wait(3)
    assert exits == [code]
    err = capfd.readouterr().err
    assert "  last completed: forward (step 3, microbatch 0, version 2)" in err
    assert f"  in progress:    {text} (for " in err


def test_progress_made_before_arming_does_not_cut_the_warmup_allowance():
    wd, exits = _watchdog(timeout_s=0.3, warmup_factor=4.0)
    progress = _FakeProgress()
    wd.follow(progress)
    progress.run(("forward", 0, 0, 0))
    progress.finish()  # the previous train call's last instruction, not yet seen by a poll
    with wd.armed("training"):
        progress.run(("forward", 1, 0, 0))
        time.sleep(0.7)  # a slow first instruction: > timeout, < 4 x timeout
        assert not wd.fired.is_set()
        progress.finish()
    assert exits == []
