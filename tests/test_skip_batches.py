"""Past a loss spike: ``--resume RUN --rewind STEP`` continues from an earlier checkpoint (the later
ones and their rows set aside, kept), and ``--skip-batches N`` continues on the data after the next
N minibatches -- the step after the resume trains on minibatch position step + N, a pipeline skips
as its simulation does, later resumes keep the skip."""
import json

import pytest
import torch

from asyncpp_ext.training.build import build_data
from asyncpp_ext.training.checkpoint import read_meta
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.export import load_model

COMMON = ["--model", "tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--microbatches", "2", "--eval-every", "0", "--ckpt-every", "3"]


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_step_after_the_skip_trains_on_the_minibatch_after_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert train([*COMMON, "--simulate", "--schedule", "sync", "--steps", "3", "--out", str(run)]) == 0
    capsys.readouterr()
    assert train(["--resume", str(run), "--steps", "6", "--skip-batches", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "passing over the next 2 minibatches of the data (--skip-batches)" in err and "changed: train.steps" in err
    assert "skip_batches" not in err
    assert read_meta(run / "ckpt-000006")["data"]["position"] == 8
    cfg, _, model = load_model(run / "ckpt-000003")  # sync: step 4's loss is W(3)'s on its minibatch
    with torch.no_grad():
        want = sum(model(x, y)[1].item() for x, y in build_data(cfg)[0].minibatch(3 + 2)) / 2
    assert _losses(run)[3] == pytest.approx(want, rel=1e-6)


def test_a_pipeline_skips_as_its_simulation_and_later_resumes_keep_it(tmp_path):
    runs = {}
    for name, flags in (("sim", ["--simulate"]), ("pipe", ["--stages", "2", "--timeout", "30"])):
        run = runs[name] = tmp_path / name
        assert train([*COMMON, *flags, "--steps", "3", "--out", str(run)]) == 0
        assert train(["--resume", str(run), "--steps", "6", "--skip-batches", "4", "--no-progress"]) == 0
        assert train(["--resume", str(run), "--steps", "9", "--no-progress"]) == 0
    assert _losses(runs["pipe"]) == _losses(runs["sim"]) and len(_losses(runs["sim"])) == 9
    assert read_meta(runs["pipe"] / "ckpt-000009")["data"]["position"] == 13
    plain = tmp_path / "plain"  # the same resume without the skip trains on other data
    assert train([*COMMON, "--simulate", "--steps", "3", "--out", str(plain)]) == 0
    assert train(["--resume", str(plain), "--steps", "6", "--no-progress"]) == 0
    assert _losses(plain)[:3] == _losses(runs["sim"])[:3] and _losses(plain)[3:] != _losses(runs["sim"])[3:6]


@pytest.mark.parametrize("flags", [["--simulate"], ["--stages", "2", "--timeout", "30"]], ids=["one", "pipeline"])
def test_rewind_continues_from_an_earlier_checkpoint_and_keeps_the_later_ones_aside(tmp_path, capsys, flags):
    run = tmp_path / "run"
    assert train([*COMMON, *flags, "--steps", "9", "--out", str(run)]) == 0
    straight = _losses(run)
    old = {name: (run / name / "meta.json").read_bytes() for name in ("ckpt-000006", "ckpt-000009")}
    capsys.readouterr()
    assert train(["--resume", str(run), "--rewind", "3", "--steps", "9", "--no-progress"]) == 0
    assert "resuming from ckpt-000003 (step 3)" in capsys.readouterr().err
    assert _losses(run) == straight  # the same run again from step 3: nothing differs
    (attic,) = [p for p in run.iterdir() if p.name.startswith("rewound-")]
    assert attic.name == "rewound-1-to-step-3" and not (run / "ckpt-000009").samefile(attic / "ckpt-000009")
    assert [json.loads(line)["step"] for line in (attic / "metrics.jsonl").read_text().splitlines()] == [4, 5, 6, 7,
                                                                                                        8, 9]
    assert {name: (attic / name / "meta.json").read_bytes() for name in old} == old
    assert train(["--resume", str(run), "--rewind", "6", "--skip-batches", "3", "--steps", "9",
                  "--no-progress"]) == 0
    assert _losses(run)[:6] == straight[:6] and _losses(run)[6:] != straight[6:]


@pytest.mark.parametrize("flags, words", [
    (["--resume", "{run}", "--rewind", "2"], "--rewind 2: {run} has no checkpoint at step 2 (its checkpoints: 3)"),
    (["--rewind", "3"], "--rewind STEP resumes a run from an earlier checkpoint; pass it with --resume RUN"),
    (["--skip-batches", "2"], "--skip-batches passes over data at a resume; pass --resume RUN"),
    (["--skip-batches", "2", "--auto-resume"], "--skip-batches with --auto-resume would skip again"),
    (["--resume", "{run}", "--skip-batches", "-1"], "data.skip_batches must be a non-negative integer, got -1"),
])
def test_bad_skips_are_one_line(tmp_path, capsys, flags, words):
    run = tmp_path / "run"
    assert train([*COMMON, "--simulate", "--steps", "3", "--out", str(run)]) == 0
    capsys.readouterr()
    flags = [f.replace("{run}", str(run)) for f in flags]
    out = [] if "--resume" in flags else ["--out", str(tmp_path / "other")]
    assert train([*COMMON, "--simulate", "--steps", "6", *out, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.replace("{run}", str(run)) in err[0], err
