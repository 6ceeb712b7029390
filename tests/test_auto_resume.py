"""``--auto-resume``: one command for every job of a chain -- it starts the run in --out, continues
it from its latest checkpoint in the next job, drops the rows of an attempt that died before its
first checkpoint, and does nothing more once the run is complete."""
import json

import pytest

from asyncpp_ext.training.cli import main as train

COMMON = ["--model", "tiny", "--no-progress", "--simulate", "--eval-every", "0", "--threads", "1",
          "--seq-len", "16", "--micro-batch-size", "2"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("flags", [[], ["--no-simulate", "--stages", "2", "--timeout", "30"]],
                         ids=["one-process", "2-stage-pipeline"])
def test_the_same_command_starts_continues_and_completes_a_run(tmp_path, capsys, flags):
    run, straight = tmp_path / "run", tmp_path / "straight"
    chain = [*COMMON, *flags, "--auto-resume", "--out", str(run), "--ckpt-every", "3"]
    assert train([*chain, "--steps", "3"]) == 0  # the first job, ended at step 3
    assert "resuming" not in capsys.readouterr().err
    assert train([*chain, "--steps", "8"]) == 0  # the next job continues from ckpt-000003
    assert "asyncpp-train: resuming from ckpt-000003 (step 3)" in capsys.readouterr().err
    assert train([*COMMON, *flags, "--out", str(straight), "--ckpt-every", "3", "--steps", "8"]) == 0
    assert [r["loss"] for r in _rows(run)] == [r["loss"] for r in _rows(straight)]
    assert train([*chain, "--steps", "8"]) == 0  # a job after the end: nothing to do
    assert [r["step"] for r in _rows(run)] == list(range(1, 9))


def test_an_attempt_that_wrote_no_checkpoint_is_started_over(tmp_path):
    run, straight = tmp_path / "run", tmp_path / "straight"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n{"step": 2, "loss": 9.8}\n')
    assert train([*COMMON, "--out", str(run), "--steps", "4"]) == 2  # without the flag: refused
    assert train([*COMMON, "--auto-resume", "--out", str(run), "--steps", "4"]) == 0
    assert train([*COMMON, "--out", str(straight), "--steps", "4"]) == 0
    assert [(r["step"], r["loss"]) for r in _rows(run)] == [(r["step"], r["loss"]) for r in _rows(straight)]


def test_init_from_serves_the_first_job_only(tmp_path, capsys):
    base, run = tmp_path / "base", tmp_path / "run"
    assert train([*COMMON, "--out", str(base), "--steps", "2"]) == 0
    chain = [*COMMON, "--auto-resume", "--init-from", str(base), "--out", str(run), "--ckpt-every", "2"]
    assert train([*chain, "--steps", "2"]) == 0
    assert "starting from the weights of" in capsys.readouterr().err
    assert train([*chain, "--steps", "4"]) == 0  # continued from its own ckpt-000002, not base's
    err = capsys.readouterr().err
    assert "resuming from ckpt-000002 (step 2)" in err and "starting from" not in err
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]


@pytest.mark.parametrize("flags, words", [
    (["--auto-resume"], "--auto-resume needs --out DIR"),
    (["--auto-resume", "--out", "{tmp}/r", "--resume", "{tmp}/r"], "--auto-resume continues the run in --out"),
    (["--auto-resume", "--out", "{tmp}/r", "--no-checkpoints"], "--no-checkpoints writes none"),
])
def test_bad_auto_resume_flags_are_one_line(tmp_path, capsys, flags, words):
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert train([*COMMON, "--steps", "3", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "r").exists()
