"""``--keep-checkpoints N``: a run directory keeps its newest N checkpoints, in one process and as
a pipeline; a checkpoint being removed is never found half-removed (hidden first, and cleared at the
next start if a crash left it); resumes go on from the newest."""
from pathlib import Path

import pytest

from asyncpp_ext.training.checkpoint import list_checkpoints, prune_checkpoints
from asyncpp_ext.training.cli import main as train

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

COMMON = ["--model", "tiny", "--no-progress", "--eval-batches", "0", "--ckpt-every", "2"]


def _steps(run_dir) -> list:
    return [step for step, _ in list_checkpoints(run_dir)]


@pytest.mark.parametrize("how", [["--simulate"], ["--stages", "2"]], ids=["one-process", "pipeline"])
def test_only_the_newest_checkpoints_stay(tmp_path, how):
    run = tmp_path / "run"
    assert train([*COMMON, *how, "--steps", "10", "--keep-checkpoints", "2", "--out", str(run)]) == 0
    assert _steps(run) == [8, 10]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".") and p.name != ".lock") == []
    # a resume keeps its own count, and goes on from the newest
    assert train(["--resume", str(run), "--steps", "14", "--keep-checkpoints", "1"]) == 0
    assert _steps(run) == [14]


def test_without_the_flag_every_checkpoint_stays(tmp_path):
    run = tmp_path / "run"
    assert train([*COMMON, "--simulate", "--steps", "6", "--out", str(run)]) == 0
    assert _steps(run) == [2, 4, 6]


def test_a_checkpoint_is_hidden_before_it_is_removed_and_a_left_one_is_cleared(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert train([*COMMON, "--simulate", "--steps", "6", "--out", str(run)]) == 0
    removed = []

    def crash(path, ignore_errors=False):  # the process dies between the rename and the removal
        removed.append(Path(path).name)
        assert not (run / "ckpt-000002").exists()  # hidden already: a reader never sees it half-gone
        raise KeyboardInterrupt

    monkeypatch.setattr("asyncpp_ext.training.checkpoint.shutil.rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(run, 2)
    monkeypatch.undo()
    assert removed == [".del-ckpt-000002"] and _steps(run) == [4, 6]
    assert train(["--resume", str(run), "--steps", "8"]) == 0  # its next start clears what was left
    assert not (run / ".del-ckpt-000002").exists()
    assert "removed 1 unfinished checkpoint(s) (.del-ckpt-000002)" in capsys.readouterr().err
    assert _steps(run) == [4, 6, 8]


def test_keep_zero_is_one_line(tmp_path, capsys):
    assert train([*COMMON, "--simulate", "--keep-checkpoints", "0", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "asyncpp-train: error: --keep-checkpoints: train.keep_checkpoints must be a positive integer, got 0"]
    assert not (tmp_path / "run").exists()
