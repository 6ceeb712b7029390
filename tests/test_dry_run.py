"""``asyncpp-train --dry-run``: the checks of a start, the run it would make and the config.json it
would write -- the same one the start writes -- with nothing written and nothing trained."""
import json

import pytest

from asyncpp_ext.models.registry import MODEL_PRESETS, build_model, model_config
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config import RunConfig
from asyncpp_ext.training.dry_run import parameter_count

COMMON = ["--model", "tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--steps", "4", "--eval-every", "2"]


def _printed_config(out: str) -> dict:
    return json.loads(out.split("config.json:\n", 1)[1])


def _files(path):
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size) for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("flags", [["--simulate"], ["--stages", "2", "--timeout", "30"]], ids=["one", "pipeline"])
def test_the_dry_run_prints_the_config_the_start_writes_and_writes_nothing(tmp_path, capsys, flags):
    run = tmp_path / "run"
    assert train([*COMMON, *flags, "--out", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not run.exists()
    assert out.startswith("asyncpp-train --dry-run: every check passed; nothing was written\n")
    assert f"run: {run}, a new run" in out and "steps: 4 x 128 tokens (4 microbatches of 2 x 16)" in out
    assert "data: --data builtin: " in out and " epochs to step 4\n" in out
    assert train([*COMMON, *flags, "--out", str(run)]) == 0
    assert _printed_config(out) == json.loads((run / "config.json").read_text())


def test_a_dry_run_of_a_resume_checks_the_checkpoint_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert train([*COMMON, "--simulate", "--out", str(run), "--ckpt-every", "2"]) == 0
    before = _files(run)
    capsys.readouterr()
    assert train(["--resume", str(run), "--steps", "8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"run: resuming {run} at step 4 (ckpt-000004)" in out and _printed_config(out)["train"]["steps"] == 8
    assert _files(run) == before


def test_the_parameter_count_is_the_models():
    for name in ("tiny", "llama-tiny"):
        cfg = RunConfig()
        cfg.model = model_config(name)
        assert parameter_count(cfg) == sum(p.numel() for p in build_model(MODEL_PRESETS[name]).parameters())


@pytest.mark.parametrize("flags, words", [
    (["--data", "{tmp}/none.txt"], "none.txt"),
    (["--out", "{tmp}/taken"], "already holds a run"),
    (["--lr", "-1"], "--lr"),
])
def test_a_dry_run_refuses_what_a_start_refuses(tmp_path, capsys, flags, words):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    out = ["--out", str(tmp_path / "fresh")] if "--out" not in flags else []
    assert train([*COMMON, "--simulate", *out, *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "fresh").exists()


def test_a_streams_plan_counts_the_passes_over_its_tokens():
    import numpy as np
    from asyncpp_ext.data import BatchStream

    stream = BatchStream(np.arange(1000, dtype=np.uint16), 2, 4, 8, source="--data x.bin")
    assert stream.plan(10) == "--data x.bin: 1,000 training tokens, 0.64 epochs to step 10"  # 10 x 2 x 4 x 8 = 640


def test_the_stage_line_splits_as_the_pipeline_does(tmp_path, capsys):
    # llama-tiny at 4 layers: embed 256 x 32 = 8,192; a layer 2 x 32 (norms) + 2 x 1,024 (q, o) + 2 x 512 (k, v)
    # + 3 x 2,048 (mlp) = 9,280; the head a norm of 32 and its copy of the tied embedding, 8,224
    assert train(["--model", "llama-tiny", "--n-layer", "4", "--stages", "3", "--out", str(tmp_path / "r"),
                  "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("stages of 6 blocks: 0: blocks 0-1 (17,472 parameters), 1: blocks 2-3 (18,560 parameters), "
            "2: blocks 4-5 (17,504 parameters)\n") in out
    assert "45,344 parameters" in out  # 8,192 + 4 x 9,280 + 32: the tied tensor once


def test_the_dry_run_names_the_z_loss_the_document_mask_and_the_tasks(tmp_path, capsys):
    task = tmp_path / "quiz.jsonl"
    task.write_text(json.dumps({"context": "a", "endings": ["b", "c"], "label": 0}) + "\n")
    assert train([*COMMON, "--simulate", "--z-loss", "1e-4", "--document-mask", "10", "--eval-choices", str(task),
                  "--out", str(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: adamw, lr 0.001, constant schedule, z-loss 0.0001\n" in out
    assert "attention: within documents, each starting at token 10\n" in out
    assert "evaluation: every 2 steps, 4 batches, 1 multiple-choice task(s)\n" in out


@pytest.mark.parametrize("every, line", [("0", "evaluation: at the end, 4 batches\n"), ("3", "evaluation: every 3 steps, 4 batches\n")])
def test_the_dry_run_says_when_a_run_evaluates(tmp_path, capsys, every, line):
    # --eval-every 0 evaluates once, at the end (the last step is always due), as the run does
    assert train([*COMMON, "--simulate", "--eval-every", every, "--out", str(tmp_path / "run"), "--dry-run"]) == 0
    assert line in capsys.readouterr().out
