"""Checks shared by the tests of runs that stop themselves to be resumed (--time-limit,
--stop-on-signal)."""
import json

from asyncpp_ext.training.cli import main as train


def rows_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def check_stopped(run, marked: str, stages: int, out: str, why: str, steps: int = 1_000_000) -> int:
    """The stop step of ``run``, a run of ``steps`` that stopped itself: its last row (alone) marked
    ``"stopped": marked``, rows for every step up to it, a checkpoint there with a shard per stage,
    and the line ``RUN: WHY: stopped at step N of STEPS with checkpoint ...`` in ``out``."""
    rows = rows_of(run)
    stopped = rows[-1]["step"]
    assert 1 <= stopped < steps and rows[-1]["stopped"] == marked
    assert not any("stopped" in r for r in rows[:-1])
    assert [r["step"] for r in rows] == list(range(1, stopped + 1))
    shards = sorted(p.name for p in (run / f"ckpt-{stopped:06d}").iterdir())
    assert len([s for s in shards if s.startswith("stage")]) == stages, shards
    assert f"{why}: stopped at step {stopped} of {steps} with checkpoint ckpt-{stopped:06d}" in out, out
    return stopped


def check_resumes_as_never_stopped(run, stopped: int, resume_flags: list, straight_argv: list, straight) -> None:
    """``run`` resumed 5 steps past its stop gives the losses of ``straight_argv`` run straight there."""
    assert train(["--resume", str(run), "--steps", str(stopped + 5), *resume_flags]) == 0
    assert train([*straight_argv, "--steps", str(stopped + 5), "--out", str(straight)]) == 0
    assert [r["loss"] for r in rows_of(run)] == [r["loss"] for r in rows_of(straight)]
