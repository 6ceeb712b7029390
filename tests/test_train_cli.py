"""asyncpp-train end to end on the tiny model: learning, outputs, exact resume, bad inputs."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncpp_ext.training.cli import main
from run_holder import run_dir_held


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FAST = ["--simulate", "--no-progress", "--n-layer", "1", "--micro-batch-size", "4",
        "--microbatches", "2"]


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_tiny_adamw_run_lowers_loss_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--simulate", "--no-progress", "--optimizer", "adamw", "--lr", "3e-3", "--steps", "60",
               "--eval-every", "20", "--ckpt-every", "25", "--out", str(out)])
    assert rc == 0
    assert capsys.readouterr().err == ""  # stderr is not a TTY: no progress bar
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert [r["step"] for r in rows if "eval_loss" in r] == [20, 40, 60]
    assert rows[-1]["tokens"] == 60 * 4 * 8 * 32
    assert all(set(r) >= {"step", "loss", "lr", "tokens", "elapsed_s", "time"} for r in rows)
    # `time` is the wall clock of each step's end: it advances with `elapsed_s`
    spans = (rows[-1]["time"] - rows[0]["time"], rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])
    assert abs(spans[0] - spans[1]) < 0.05 + 0.05 * spans[1], spans
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert first > math.log(256) - 0.2  # starts near uniform over bytes
    assert last < first - 1.5, (first, last)
    assert rows[-1]["eval_loss"] < rows[0]["loss"] - 1.5
    assert sorted(p.name for p in out.iterdir()) == [
        "ckpt-000025", "ckpt-000050", "ckpt-000060", "config.json", "loss.png", "metrics.jsonl"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pipeline"]["schedule"] == "2bw" and cfg["train"]["steps"] == 60


def test_no_checkpoints_and_no_eval_write_neither_and_train_the_same(tmp_path, capsys):
    args = [*FAST, "--steps", "6", "--eval-every", "3", "--ckpt-every", "3"]
    assert main([*args, "--out", str(tmp_path / "full")]) == 0
    assert main([*args, "--no-checkpoints", "--eval-batches", "0", "--out", str(tmp_path / "quiet")]) == 0
    full, quiet = _metrics(tmp_path / "full"), _metrics(tmp_path / "quiet")
    assert [r["step"] for r in full if "eval_loss" in r] == [3, 6]
    assert not any("eval_loss" in r for r in quiet)
    assert [r["loss"] for r in quiet] == [r["loss"] for r in full]
    assert sorted(p.name for p in (tmp_path / "full").glob("ckpt-*")) == ["ckpt-000003", "ckpt-000006"]
    assert list((tmp_path / "quiet").glob("ckpt-*")) == []
    # a resumed run may change how much it evaluates (not what trains) and stop checkpointing
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "full"), "--steps", "8", "--eval-batches", "0", "--no-checkpoints"]) == 0
    # the resume says where it starts and what it changes
    assert capsys.readouterr().err.splitlines() == [
        "asyncpp-train: resuming from ckpt-000006 (step 6); changed: data.eval_batches 4->0, "
        "train.checkpoints True->False, train.steps 6->8"]
    resumed = _metrics(tmp_path / "full")
    assert [r["step"] for r in resumed] == list(range(1, 9)) and not any("eval_loss" in r for r in resumed[6:])
    assert sorted(p.name for p in (tmp_path / "full").glob("ckpt-*")) == ["ckpt-000003", "ckpt-000006"]


@pytest.mark.parametrize("schedule, optimizer", [("2bw", "adamw"), ("sync", "sgd")])
def test_stop_and_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, schedule, optimizer):
    args = FAST + ["--schedule", schedule, "--optimizer", optimizer, "--lr", "1e-2",
                   "--eval-every", "4", "--ckpt-every", "6"]
    assert main(args + ["--steps", "20", "--out", str(tmp_path / "full")]) == 0
    # A run killed after step 15: checkpoint 12 is the latest, metrics rows 13..15 are stale.
    part = tmp_path / "part"
    assert main(args + ["--steps", "15", "--out", str(part)]) == 0
    shutil.rmtree(part / "ckpt-000015")
    with open(part / "metrics.jsonl", "a") as f:  # killed while appending step 16's row
        f.write('{"step": 16, "loss": 5.1, "lr"')
    assert main(["--resume", str(part), "--steps", "20", "--no-progress"]) == 0
    full, resumed = _metrics(tmp_path / "full"), _metrics(part)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [(r["step"], r["eval_loss"]) for r in resumed if "eval_loss" in r] == \
           [(r["step"], r["eval_loss"]) for r in full if "eval_loss" in r]
    a = torch.load(tmp_path / "full/ckpt-000020/stage-00.pt", weights_only=True)
    b = torch.load(part / "ckpt-000020/stage-00.pt", weights_only=True)
    for name, t in a["engine"]["params"].items():
        assert torch.equal(t, b["engine"]["params"][name]), name


def test_a_damaged_metrics_line_before_the_last_is_named_not_dropped(tmp_path):
    from asyncpp_ext.training.run_files import RunDirError, read_metrics, truncate_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 2 is not a metrics row"):
        truncate_metrics(tmp_path, 3)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]  # a torn last line is no row


def test_module_entry_point_and_help(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", "--help"], capture_output=True,
                        text=True, env=env)
    assert ok.returncode == 0 and "--micro-batch-size" in ok.stdout and "default 2bw" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", "--steps", "0", "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "asyncpp-train: error: --steps: train.steps must be a positive integer, got 0"]
    assert not (tmp_path / "o").exists()


# Bad inputs (exit 2, one line, no traceback, nothing left behind) are one table in
# tests/reliability/test_bad_inputs.py.
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("base") / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see _one_intra_op_thread (module fixtures set up before it)
    try:
        assert main(FAST + ["--steps", "3", "--out", str(run)]) == 0
    finally:
        torch.set_num_threads(before)
    return run



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_reported(tmp_path, capsys):
    assert main(FAST + ["--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncpp-train: error: ") and "no CUDA GPU is visible" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_existing_run_is_not_overwritten(tmp_path, finished_run, capsys):
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    assert main(FAST + ["--out", str(run)]) == 2
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err


def test_a_run_in_progress_keeps_its_out_from_a_second_run(tmp_path, capsys):
    """Two runs started together into one --out would each pass the "already holds a run" check
    and write their rows and checkpoints among the other's; the second is refused, naming the
    first, and the --out is free again once the first ends."""
    run = tmp_path / "r"
    with run_dir_held(run) as holder:
        for argv in (FAST + ["--steps", "2", "--out", str(run)], FAST + ["--stages", "2", "--steps", "2", "--out",
                                                                       str(run)]):
            assert main(argv) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and f"--out {run} is in use by another run (pid {holder} on " in err[0], err
    assert not (run / "metrics.jsonl").exists()
    assert main(FAST + ["--steps", "2", "--out", str(run)]) == 0  # the kernel let go of the lock
    assert main(["--resume", str(run), "--steps", "3", "--no-progress"]) == 0  # this process's own, in turn


def test_resume_names_a_checkpoint_given_for_its_run_and_an_empty_path(finished_run, capsys):
    assert main(["--resume", str(finished_run / "ckpt-000003"), "--steps", "4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"asyncpp-train: error: {finished_run / 'ckpt-000003'} is a checkpoint; pass its run's "
                   f"directory, --resume {finished_run} (its latest checkpoint is taken)"]
    assert main(["--resume", "", "--steps", "4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "asyncpp-train: error: --resume is empty; pass the --out directory of an earlier run"]


def test_a_resume_removes_the_checkpoint_temporaries_a_killed_run_left(tmp_path, finished_run, capsys):
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    (run / ".tmp-ckpt-000002").mkdir()  # a run killed while it wrote its checkpoint of step 2
    (run / ".tmp-ckpt-000002" / "stage-00.pt").write_bytes(b"x" * 1000)
    assert main(["--resume", str(run), "--steps", "4", "--no-progress"]) == 0
    assert not (run / ".tmp-ckpt-000002").exists()
    assert "removed 1 unfinished checkpoint(s) (.tmp-ckpt-000002) that a stopped run left" in capsys.readouterr().err


def test_a_run_that_failed_before_its_first_step_leaves_its_out_free_and_a_long_name_is_named(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")  # no row: the run never finished a step
    assert main(FAST + ["--out", str(run)]) == 0
    capsys.readouterr()
    long = tmp_path / "new" / ("x" * 300)
    assert main(FAST + ["--out", str(long)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "File name too long); choose a shorter name" in err, err
    assert not (tmp_path / "new").exists()  # the parent made for it is gone again


def test_checkpoints_must_be_a_bool_in_a_config():
    # A config.json's "checkpoints": "false" is a string, truthy: refused rather than checkpointing.
    from asyncpp_ext.training.config import ConfigError, RunConfig

    cfg = RunConfig()
    cfg.train.checkpoints = "false"
    with pytest.raises(ConfigError, match="train.checkpoints must be true or false, got 'false'"):
        cfg.validate()
    cfg.train.checkpoints = False
    cfg.validate()


@pytest.mark.parametrize("checkpointed", [True, False])
def test_an_interrupted_run_names_resume_only_when_it_has_a_checkpoint(tmp_path, monkeypatch, capsys, checkpointed):
    # main's own handling of an interrupt: the run it dispatches to is replaced by one that stops
    out = tmp_path / "run"

    def interrupted(cfg, resume_dir, started_at):
        out.mkdir(parents=True, exist_ok=True)
        if checkpointed:
            (out / "ckpt-000002").mkdir()
        raise KeyboardInterrupt
    monkeypatch.setattr("asyncpp_ext.training.cli.train", interrupted)
    assert main([*FAST, "--steps", "4", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and (f"--resume {out}" in err) is checkpointed, err


@pytest.mark.multiproc
def test_switches_of_a_resumed_run_turn_off_as_well_as_on(tmp_path):
    """Every on/off flag has its --no- form, so a resume can leave the simulator (or recompute)
    that the checkpoint's config had on: the real pipeline then continues the simulated steps."""
    tiny = ["--model", "llama-tiny", "--stages", "2", "--no-progress", "--ckpt-every", "2"]
    assert main(tiny + ["--simulate", "--recompute", "--steps", "2", "--out", str(tmp_path / "sim")]) == 0
    assert main(["--resume", str(tmp_path / "sim"), "--steps", "4", "--no-simulate", "--no-recompute"]) == 0
    cfg = json.loads((tmp_path / "sim" / "config.json").read_text())
    assert cfg["train"]["simulate"] is False and cfg["pipeline"]["recompute"] is False
    assert main(tiny + ["--steps", "4", "--out", str(tmp_path / "real")]) == 0
    assert [r["loss"] for r in _metrics(tmp_path / "sim")] == [r["loss"] for r in _metrics(tmp_path / "real")]


def test_the_summary_line_of_a_run_whose_last_evaluation_was_non_finite(tmp_path, capsys):
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.run import print_summary

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.0, "elapsed_s": 0.1}\n'
        '{"step": 2, "loss": null, "skipped": true, "eval_loss": null, "elapsed_s": 0.2}\n')
    print_summary(tmp_path, RunConfig(), 0)
    line = capsys.readouterr().out
    assert "step 2 loss skipped eval_loss non-finite (1 step skipped: non-finite values)" in line, line


def test_the_summary_line_gives_the_tokens_per_second_after_the_first_step(tmp_path, capsys):
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.run import print_summary

    (tmp_path / "metrics.jsonl").write_text(  # the first step held a 10 s compile
        '{"step": 1, "loss": 5.0, "tokens": 1000, "elapsed_s": 10.0}\n'
        '{"step": 2, "loss": 4.9, "tokens": 2000, "elapsed_s": 10.5}\n'
        '{"step": 3, "loss": 4.8, "tokens": 3000, "elapsed_s": 11.0}\n')
    print_summary(tmp_path, RunConfig(), 0)
    assert "(11.0 s training, 2,000 tokens/s, " in capsys.readouterr().out
    print_summary(tmp_path, RunConfig(), 2)  # a resumed call: its own rows only, one of them
    assert "(11.0 s training, gpt" in capsys.readouterr().out


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """A full disk shows in torch.save as "enforce fail at inline_container.cc"; the line names the
    shard and the space left instead."""
    import torch

    from asyncpp_ext.training import checkpoint

    def full_disk(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 586944 vs 586832")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    rc = main(["--model", "tiny", "--seq-len", "16", "--steps", "2", "--ckpt-every", "2", "--no-progress",
               "--no-compile", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and "Traceback" not in err, err
    assert "could not write checkpoint shard" in err and "MiB are free there" in err, err
    assert torch.save is full_disk


def test_a_stop_signal_landing_in_a_checkpoint_write_is_the_stop_not_a_full_disk(tmp_path, monkeypatch, capsys):
    """A SIGTERM raised inside torch.save, whose clean-up of the half-written file then fails
    with the error a full disk gives: the run says it was stopped (143), not "free disk space"."""
    import signal

    from asyncpp_ext.stop_signals import Stopped
    from asyncpp_ext.training import checkpoint

    def stopped_while_saving(obj, f):
        try:
            raise Stopped(signal.SIGTERM)
        except KeyboardInterrupt:  # torch's zip writer closing the half-written file
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", stopped_while_saving)
    rc = main(["--model", "tiny", "--seq-len", "16", "--steps", "2", "--ckpt-every", "2", "--no-progress",
               "--no-compile", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 128 + signal.SIGTERM and err == "asyncpp-train: stopped by SIGTERM", err


def test_a_metrics_write_that_fails_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    from asyncpp_ext.training import trainer

    real_open = open

    def open_full(path, *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and args and "a" in args[0]:
            raise OSError(28, "No space left on device", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(trainer, "open", open_full, raising=False)
    rc = main(["--model", "tiny", "--seq-len", "16", "--steps", "2", "--no-checkpoints", "--no-progress",
               "--no-compile", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and "No space left on device" in err, err


def test_a_resume_reads_the_same_data_under_another_path(tmp_path, monkeypatch, capsys):
    """A relative --data resumed from another directory, or data that moved: the path may change,
    the tokens may not."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "text.txt").write_text("to be or not to be, that is the question. " * 300)
    flags = ["--model", "tiny", "--seq-len", "16", "--no-progress", "--no-compile", "--threads", "1"]
    monkeypatch.chdir(first)
    assert main(["--data", "text.txt", "--steps", "4", "--out", str(tmp_path / "whole")] + flags) == 0
    assert main(["--data", "text.txt", "--steps", "2", "--ckpt-every", "2", "--out", str(tmp_path / "cut")] + flags) == 0
    monkeypatch.chdir(second)
    moved = second / "moved.txt"
    shutil.copy(first / "text.txt", moved)
    assert main(["--resume", str(tmp_path / "cut"), "--steps", "4", "--data", str(moved), "--no-progress"]) == 0
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("whole", "cut")]
    assert losses[0] == losses[1]
    moved.write_text(moved.read_text().replace("question", "quest1on"))  # other tokens, same count
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "cut"), "--steps", "6", "--data", str(moved), "--no-progress"]) == 2
    assert "other training tokens than the data now gives" in capsys.readouterr().err


@pytest.mark.parametrize("failure, one_line", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 51539607552 bytes."), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("a bug in a run"), False)])
def test_a_run_out_of_memory_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch, failure, one_line):
    def fails(cfg, resume_dir, started_at):
        raise failure

    monkeypatch.setattr("asyncpp_ext.training.cli.train", fails)
    argv = FAST + ["--steps", "2", "--out", str(tmp_path / "run")]
    if not one_line:  # anything else keeps its traceback
        with pytest.raises(RuntimeError, match="a bug in a run"):
            main(argv)
        return
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncpp-train: error: out of memory (") and err.count("\n") == 1, err
    assert err.endswith("); use a smaller model (--n-embd, --n-layer, --vocab-size), --micro-batch-size or "
                        "--seq-len\n")
