"""asyncpp-train over real processes equals its one-process simulation, and resumes exactly."""
import json

import pytest
import torch

from asyncpp_ext.training.checkpoint import load_checkpoint
from asyncpp_ext.training.checkpoint import merge_engine_states
from asyncpp_ext.training.cli import main

pytestmark = pytest.mark.multiproc

TINY = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "16", "--no-progress"]


def _losses(run_dir):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r.get("eval_loss") for r in rows], [r["step"] for r in rows]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("schedule,stages,optimizer,ef,ef_source", [
    ("2bw", 2, "muon", "0.5", "buffer"), ("1f1b", 2, "muon", "0.5", "buffer"),
    ("2bw", 4, "adamw", "0.5", "buffer"), ("gpipe", 3, "sgd", "0", "buffer"),
    ("2bw", 2, "muon", "1.0", "weights")])  # EF from the weight versions: out-of-place step reads W(t-1)
def test_real_run_writes_the_simulated_losses(tmp_path, schedule, stages, optimizer, ef, ef_source):
    # --threads 1 on both sides: a matrix product's summation order may depend on the thread
    # count, and with equal counts the stages' arithmetic is the simulator's, op for op.
    flags = TINY + ["--schedule", schedule, "--stages", str(stages), "--microbatches", "4",
                    "--optimizer", optimizer, "--ef-beta", ef, "--lr", "0.01", "--steps", "6",
                    *(["--ef-source", ef_source] if ef_source != "buffer" else []),
                    "--eval-every", "3", "--ckpt-every", "3", "--n-layer", "2", "--threads", "1"]
    assert main(flags + ["--out", str(tmp_path / "real")]) == 0
    assert main(flags + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    real, real_eval, steps = _losses(tmp_path / "real")
    sim, sim_eval, _ = _losses(tmp_path / "sim")
    assert steps == list(range(1, 7))
    assert real == sim
    assert real_eval == sim_eval and sum(e is not None for e in real_eval) == 2
    assert sorted(p.name for p in (tmp_path / "real").glob("ckpt-*")) == ["ckpt-000003", "ckpt-000006"]
    assert (tmp_path / "real" / "loss.png").stat().st_size > 0  # drawn by the launcher once the ranks end
    shards = sorted(p.name for p in (tmp_path / "real" / "ckpt-000006").glob("stage-*.pt"))
    assert len(shards) == stages
    real_state, sim_state = (merge_engine_states([s["engine"] for s in load_checkpoint(
        tmp_path / run / "ckpt-000006")[1]]) for run in ("real", "sim"))
    for part in ("params", "stash"):  # final weights, and W(t-1) for 2bw
        assert real_state[part].keys() == sim_state[part].keys()
        for name, want in sim_state[part].items():
            assert torch.equal(real_state[part][name], want), (part, name)


def test_a_failed_pipeline_run_still_has_the_plot_of_the_losses_that_led_there(tmp_path, capsys):
    # the ranks leave loss.png to the launcher (distributed.launch), which draws it from the rows
    # written before a rank failed too: an SGD step of lr 1e5 makes the loss NaN by step 5
    flags = TINY + ["--stages", "2", "--optimizer", "sgd", "--lr", "1e5", "--steps", "10", "--threads", "1",
                    "--eval-every", "50", "--out", str(tmp_path)]
    assert main(flags) == 1
    assert "non-finite loss" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 1 < len(rows) < 10 and (tmp_path / "loss.png").stat().st_size > 0


def test_a_pipeline_without_evaluation_or_checkpoints_is_one_segment_with_the_same_losses(tmp_path, capsys):
    # --eval-batches 0 --no-checkpoints: the real run has no segment end before its last step, the
    # simulation (evaluating and checkpointing every 3 steps) has two; versions follow the global
    # step, so the losses are the same bit for bit, and nothing is written but the metrics.
    flags = TINY + ["--schedule", "2bw", "--stages", "2", "--microbatches", "4", "--optimizer", "muon",
                    "--lr", "0.01", "--steps", "6", "--n-layer", "2", "--threads", "1"]
    quiet = ["--eval-batches", "0", "--no-checkpoints", "--out", str(tmp_path / "real")]
    assert main(flags + quiet) == 0
    assert main(flags + ["--simulate", "--eval-every", "3", "--ckpt-every", "3", "--out", str(tmp_path / "sim")]) == 0
    real, real_eval, steps = _losses(tmp_path / "real")
    sim, sim_eval, _ = _losses(tmp_path / "sim")
    assert steps == list(range(1, 7)) and real == sim
    assert real_eval == [None] * 6 and sum(e is not None for e in sim_eval) == 2
    assert list((tmp_path / "real").glob("ckpt-*")) == []
    capsys.readouterr()
    assert main(flags + quiet) == 2  # the directory holds a run that cannot be resumed: no --resume hint
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" not in err


@pytest.mark.parametrize("ef_source", ["buffer", "weights"])
def test_pipeline_resume_continues_exactly(tmp_path, ef_source):
    flags = TINY + ["--schedule", "2bw", "--stages", "2", "--microbatches", "2", "--optimizer", "muon",
                    "--ef-beta", "0.5", "--ef-source", ef_source, "--lr", "0.01", "--eval-every", "0",
                    "--ckpt-every", "4"]
    assert main(flags + ["--steps", "8", "--out", str(tmp_path / "full")]) == 0
    assert main(flags + ["--steps", "4", "--out", str(tmp_path / "part")]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--steps", "8", "--no-progress"]) == 0
    full, _, _ = _losses(tmp_path / "full")
    resumed, _, steps = _losses(tmp_path / "part")
    assert steps == list(range(1, 9))
    assert resumed == full  # bitwise


def test_a_pipeline_checkpoint_resumes_at_another_depth(tmp_path):
    """Shards are keyed by global parameter names, so 2 stages can continue as 1 (simulated); at
    the same thread count (the resumed run keeps the checkpoint's --threads 1) exactly."""
    flags = TINY + ["--schedule", "2bw", "--microbatches", "2", "--optimizer", "muon", "--ef-beta", "0.5",
                    "--lr", "0.01", "--eval-every", "0", "--ckpt-every", "3", "--threads", "1"]
    assert main(flags + ["--stages", "2", "--steps", "6", "--out", str(tmp_path / "full")]) == 0
    assert main(flags + ["--stages", "2", "--steps", "3", "--out", str(tmp_path / "part")]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--steps", "6", "--stages", "1", "--no-progress"]) == 0
    full, _, _ = _losses(tmp_path / "full")
    resumed, _, steps = _losses(tmp_path / "part")
    assert steps == list(range(1, 7))
    assert resumed == full


def test_a_checkpoint_resumes_at_another_dp_width(tmp_path):
    """1 replica x 2 sequences continues as 2 replicas x 1 sequence (and 2 stages as 1): the same
    global microbatches, the same state on every replica."""
    flags = ["--model", "tiny", "--seq-len", "16", "--no-progress", "--schedule", "2bw", "--microbatches", "2",
             "--optimizer", "muon", "--ef-beta", "0.5", "--lr", "0.01", "--eval-every", "0", "--ckpt-every", "3",
             "--threads", "1"]
    one = ["--stages", "2", "--micro-batch-size", "2"]
    assert main(flags + one + ["--steps", "6", "--out", str(tmp_path / "full")]) == 0
    assert main(flags + one + ["--steps", "3", "--out", str(tmp_path / "part")]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--steps", "6", "--stages", "1", "--dp", "2",
                 "--micro-batch-size", "1", "--no-progress"]) == 0
    full, _, _ = _losses(tmp_path / "full")
    resumed, _, steps = _losses(tmp_path / "part")
    assert steps == list(range(1, 7))
    assert resumed[:3] == full[:3]
    # Not bitwise after the switch: two replicas of one sequence each take the mean of their own
    # float32 cross-entropy terms and average gradients over the replicas, where one process sums
    # both sequences at once; the grouping moves the last bit or two (measured: 5e-8 relative).
    assert _rel(resumed, full) <= 1e-6


def test_resume_that_changes_the_sequences_per_microbatch_names_the_fix(tmp_path, capsys):
    flags = TINY + ["--stages", "2", "--microbatches", "2", "--steps", "2", "--ckpt-every", "2"]
    assert main(flags + ["--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "run"), "--steps", "4", "--dp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"asyncpp-train: error: checkpoint {tmp_path / 'run' / 'ckpt-000002'} was written with "
                   "--dp 1 x --micro-batch-size 2 = 2 sequences per microbatch but this run has --dp 2 x "
                   "--micro-batch-size 2 = 4; keep the product; with --dp 2 pass --micro-batch-size 1"]


def test_threads_sets_the_simulations_thread_count_and_gives_it_back(tmp_path, monkeypatch):
    from asyncpp_ext.training.trainer import Trainer

    seen, run = [], Trainer.run
    monkeypatch.setattr(Trainer, "run", lambda self: (seen.append(torch.get_num_threads()), run(self))[1])
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1
    flags = TINY + ["--simulate", "--n-layer", "1", "--steps", "1", "--threads", str(wanted)]
    assert main(flags + ["--out", str(tmp_path / "run")]) == 0
    assert seen == [wanted] and torch.get_num_threads() == before  # main() is also a library call
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["threads"] == wanted
