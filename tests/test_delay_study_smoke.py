"""Smoke test of bench/delay_study.py: a few steps of the tiny model, one seed."""
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from asyncpp_ext.training.cli import main as train_main
from asyncpp_ext.training.run_files import read_metrics
from bench_loader import load_bench_script

STUDY_PATH = Path(__file__).resolve().parent.parent / "bench" / "delay_study.py"


@pytest.fixture(scope="module")
def study():
    return load_bench_script("delay_study")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    # Enough varied text for the tiny model's windows; the study must not need the shared corpus.
    path = tmp_path_factory.mktemp("data") / "text.txt"
    words = [f"word{i % 97} line{i % 13}" for i in range(4000)]
    path.write_text("\n".join(words))
    return str(path)


def test_study_runs_and_reports(study, text_file, tmp_path, capsys):
    plot = tmp_path / "curves.png"
    code = study.main(["--data", text_file, "--model", "tiny", "--steps", "4", "--seeds", "1",
                       "--eval-every", "2", "--eval-batches", "1", "--betas", "0.5",
                       "--workers", "1", "--spot-check-steps", "2", "--json", "--plot", str(plot)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    labels = ["adamw", "adamw+ef0.5", "muon", "muon+ef0.5"]
    assert list(out["summary"]) == labels
    assert len(out["runs"]) == 2 * len(labels)
    for run in out["runs"]:
        assert len(run["train_losses"]) == 4 and math.isfinite(run["final_eval_loss"])
        assert [s for s, _ in run["eval_curve"]] == [0, 2, 4]
    by = {(r["label"], r["schedule"]): r for r in out["runs"]}
    # Same init and data: step 0 runs on W(0) in both (W(-1) = W(0)); step 1 on W(1) vs W(0).
    sync, delayed = by["muon", "sync"]["train_losses"], by["muon", "2bw"]["train_losses"]
    assert sync[0] == delayed[0] and sync[1] != delayed[1]
    # The table is made of the runs: each gap is 2bw - sync of the runs' final eval losses.
    for label, row in out["summary"].items():
        gap = by[label, "2bw"]["final_eval_loss"] - by[label, "sync"]["final_eval_loss"]
        assert row["gap"][0] == pytest.approx(gap, rel=1e-12, abs=1e-12)
    assert out["spot_check"]["status"] == "ok", out["spot_check"]
    assert plot.stat().st_size > 0


def test_study_run_matches_the_cli_simulator(study, text_file, tmp_path):
    """The study measures the product: its run equals `asyncpp-train --simulate` step for step."""
    variant = study.Variant("muon+ef0.5", "muon", 0.02, ef_beta=0.5, adamw_lr=2e-3)
    args = {"model": "tiny", "data": text_file, "steps": 3, "microbatches": 2,
            "micro_batch_size": 4, "eval_every": 0, "eval_batches": 4}
    ours = study.run_one(study.RunSpec(variant, "2bw", 1), args)
    out = tmp_path / "cli"
    assert train_main(["--simulate", "--schedule", "2bw", "--optimizer", "muon", "--lr", "0.02",
                       "--adamw-lr", "0.002", "--ef-beta", "0.5", "--model", "tiny", "--data",
                       text_file, "--steps", "3", "--seed", "1", "--microbatches", "2",
                       "--micro-batch-size", "4", "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--out", str(out)]) == 0
    rows = read_metrics(out)
    assert ours["train_losses"] == [r["loss"] for r in rows]
    assert ours["final_eval_loss"] == rows[-1]["eval_loss"]


def test_missing_data_file_is_a_clear_error(study, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        study.main(["--data", str(tmp_path / "nope.txt")])
    assert exc.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_worker_that_cannot_start_stops_the_study(study, text_file, monkeypatch):
    """Loaded by path, the script is not importable in spawned workers (they get this sys.path, here
    without bench/, which other tests add), so each dies at start. The study must end with that
    error, not wait forever for a pool that keeps replacing workers."""
    from concurrent.futures.process import BrokenProcessPool

    bench = STUDY_PATH.parent.resolve()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not p or Path(p).resolve() != bench])
    with pytest.raises(BrokenProcessPool):
        study.main(["--data", text_file, "--model", "tiny", "--steps", "2", "--seeds", "1", "--betas", "0.5",
                    "--workers", "2", "--spot-check-steps", "0", "--json"])


def test_pipedream_depths_run_once_per_depth_against_shared_sync_runs(study, text_file, tmp_path, capsys):
    plot = tmp_path / "depth.png"
    code = study.main(["--data", text_file, "--model", "tiny", "--steps", "3", "--seeds", "1",
                       "--eval-every", "0", "--eval-batches", "1", "--betas", "0.5", "--adamw-ef-beta", "0",
                       "--schedules", "sync,pipedream", "--stages", "3,2", "--workers", "1",
                       "--spot-check-steps", "0", "--json", "--plot", str(plot)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["schedules"] == ["sync", "pipedream"] and out["setup"]["stages"] == [2, 3]
    runs = {(r["label"], r["schedule"], r["stages"]): r for r in out["runs"]}
    labels = ["adamw", "muon", "muon+ef0.5"]
    assert sorted(runs) == sorted((lab, s, d) for lab in labels
                                  for s, d in (("sync", None), ("pipedream", 2), ("pipedream", 3)))
    for label in labels:
        row, sync = out["summary"][label], runs[label, "sync", None]
        assert "gap" not in row and list(row["pipedream"]) == ["2", "3"]
        for depth in (2, 3):
            pd = runs[label, "pipedream", depth]
            # Same init and the same windows (one microbatch of m·B): step 0 runs on W(0) everywhere,
            # equal up to the summation order of one mean over m·B rows vs a mean of m means.
            assert pd["train_losses"][0] == pytest.approx(sync["train_losses"][0], rel=1e-6)
            gap = pd["final_eval_loss"] - sync["final_eval_loss"]
            assert row["pipedream"][str(depth)]["gap"][0] == pytest.approx(gap, rel=1e-12, abs=1e-12)
    assert plot.stat().st_size > 0
    table = study.format_table(out["summary"], 1)
    assert "pipedream" in table and table.count("muon+ef0.5") == 3  # sync row + one per depth


def test_a_pipedream_step_takes_the_windows_of_m_microbatches(text_file):
    from asyncpp_ext.data import BatchStream, load_tokens

    tokens = load_tokens(text_file, 256)
    split_in_two = BatchStream(tokens, 2, 4, 16, seed=3).minibatch(5)
    (whole,) = BatchStream(tokens, 1, 8, 16, seed=3).minibatch(5)
    for part in range(2):  # inputs, targets
        assert torch.equal(whole[part], torch.cat([mb[part] for mb in split_in_two]))


@pytest.mark.parametrize("argv, message", [
    (["--schedules", "sync,pipedream", "--stages", "2,8", "--model", "tiny"],
     "must lie in 1..4 .* raise --n-layer to 6"),
    (["--schedules", "2bw,pipedream"], "sync included"),
    (["--schedules", "sync,async"], "sync included"),
    (["--stages", "two"], "comma-separated integers"),
    (["--plot", "/"], "--plot / is a directory; name a file such as /curves.png"),
    (["--plot", "curves.nope"], "--plot curves.nope: matplotlib cannot write .nope files"),
    (["--adamw-lr", "-1"], "--adamw-lr must be a positive number, got -1.0"),
    (["--muon-lr", "nan"], "--muon-lr must be a positive number, got nan"),
    (["--muon-adamw-lr", "0"], "--muon-adamw-lr must be a positive number, got 0.0"),
    (["--adamw-ef-beta", "inf"], "--adamw-ef-beta must be >= 0"),
    (["--betas", "0.5,inf"], "--betas .* must all be positive numbers"),
    (["--eval-every", "-3"], "--eval-every must be >= 0, got -3"),
    (["--spot-check-steps", "-1"], "--spot-check-steps must be >= 0, got -1"),
])
def test_bad_arguments_are_one_line_before_any_run(study, argv, message, capsys, monkeypatch):
    monkeypatch.setattr(study, "run_all", lambda *a: pytest.fail("the study ran"))
    with pytest.raises(SystemExit) as exc:
        study.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and re.search(message, err), err


def test_data_that_cannot_feed_the_model_is_one_line_before_any_run(study, tmp_path, capsys, monkeypatch):
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    monkeypatch.setattr(study, "run_all", lambda *a: pytest.fail("the study ran"))
    assert study.main(["--data", str(short), "--model", "tiny", "--steps", "2", "--seeds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("delay_study.py: error: adamw sync: data ")
    assert "has 12 tokens but one batch needs at least" in err


def test_a_run_too_short_for_a_gap_reports_no_share(study, text_file, capsys):
    """One step: 2bw's first update has no delay yet, so no gap and no share of it to recover."""
    assert study.main(["--data", text_file, "--model", "tiny", "--steps", "1", "--seeds", "1", "--betas", "0.5",
                       "--eval-batches", "1", "--workers", "1", "--spot-check-steps", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ef = next(line for line in lines if line.startswith("muon+ef0.5"))
    assert "0.0000 ± 0.0000" in ef and ef.split()[-2:] == ["n/a", "n/a"]


def test_paired_runs_on_cuda_all_run_without_cuda_graphs(study):
    """CUDA graphs' auto rule turns them on for sync alone; a study's sync reference must compute
    as its other runs do (graphs also switch the fused head to the chunked kernel)."""
    from asyncpp_ext.training.stage_compute import resolve_cuda_graphs

    args = dict(model="llama-tiny", n_layer=None, data="builtin", steps=2, microbatches=2, micro_batch_size=2,
                eval_every=0, eval_batches=1)
    cuda = {"train.device": "cuda"}
    for schedule in ("sync", "2bw"):
        cfg = study.build_config(args, schedule, 0, cuda)
        assert cfg.train.cuda_graphs is False and resolve_cuda_graphs(cfg, "cuda") is False
    asked = study.build_config(args, "sync", 0, {**cuda, "train.cuda_graphs": True})
    assert asked.train.cuda_graphs is True  # an override still stands
