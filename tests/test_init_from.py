"""``asyncpp-train --init-from``: a new run whose model starts from another run's newest weights (a
new phase: its own optimizer, data order and lr schedule), in one process and as a pipeline alike;
its first loss is that of those weights; it resumes without the run it started from; a model whose
weights would not fit is one line."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncpp_ext.models.registry import build_model
from asyncpp_ext.training.build import build_data
from asyncpp_ext.training.checkpoint import load_weights
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config import RunConfig

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

QUIET = ["--no-progress", "--eval-batches", "0"]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The run the others start from: llama-tiny, Muon, 5 steps of 2bw in one process."""
    out = tmp_path_factory.mktemp("init_from") / "first"
    assert train(["--model", "llama-tiny", "--optimizer", "muon", "--simulate", "--steps", "5", *QUIET,
                  "--out", str(out)]) == 0
    return out


def test_the_first_loss_is_the_checkpoints_weights_on_the_new_runs_first_batch(first, tmp_path, capsys):
    out = tmp_path / "second"
    assert train(["--init-from", str(first), "--simulate", "--steps", "3", "--seed", "7", *QUIET,
                  "--out", str(out)]) == 0
    assert f"starting from the weights of {first.resolve()}/ckpt-000005 (step 5)" in capsys.readouterr().err
    cfg = RunConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert cfg.model.to_dict() == RunConfig.from_dict(json.loads((first / "config.json").read_text())).model.to_dict()
    assert cfg.optim.name == "adamw"  # the flags' own defaults, not the first run's
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_weights(model, first / "ckpt-000005")
    stream, _ = build_data(cfg)
    with torch.no_grad():
        want = sum(model(x, y)[1].item() for x, y in stream.next()) / cfg.pipeline.microbatches
    got = _losses(out)
    assert got[0] == pytest.approx(want, rel=1e-6, abs=0)
    # and not the seed's initialisation: the same run without --init-from starts elsewhere
    fresh = tmp_path / "fresh"
    assert train(["--model", "llama-tiny", "--simulate", "--steps", "1", "--seed", "7", *QUIET,
                  "--out", str(fresh)]) == 0
    assert abs(_losses(fresh)[0] - got[0]) > 0.05


def test_a_pipeline_started_from_a_checkpoint_trains_as_its_simulation(first, tmp_path):
    common = ["--init-from", str(first), "--schedule", "2bw", "--microbatches", "2", "--steps", "4", *QUIET]
    assert train([*common, "--simulate", "--out", str(tmp_path / "sim")]) == 0
    assert train([*common, "--stages", "2", "--out", str(tmp_path / "real")]) == 0
    assert _losses(tmp_path / "real") == pytest.approx(_losses(tmp_path / "sim"), rel=0, abs=1e-5)


@pytest.mark.parametrize("how", [["--simulate"], ["--stages", "2", "--microbatches", "2"]], ids=["simulated", "pipeline"])
def test_a_run_started_from_a_checkpoint_resumes_without_it(first, tmp_path, how):
    source = tmp_path / "source"
    shutil.copytree(first, source)
    common = [*how, *QUIET, "--ckpt-every", "2"]
    assert train(["--init-from", str(source), *common, "--steps", "4", "--out", str(tmp_path / "straight")]) == 0
    assert train(["--init-from", str(source), *common, "--steps", "2", "--out", str(tmp_path / "halves")]) == 0
    shutil.rmtree(source)  # a resumed run's weights are its own checkpoint's
    assert train(["--resume", str(tmp_path / "halves"), "--steps", "4"]) == 0
    assert _losses(tmp_path / "halves") == _losses(tmp_path / "straight")


@pytest.mark.parametrize("flags, message", [
    (["--n-layer", "3"], "its model has n_layer=2, this run's 3"),
    (["--model", "tiny"], "its model has arch='llama', this run's 'gpt'"),
    (["--vocab-size", "300"], "its model has vocab_size=256, this run's 300"),
    (["--resume", "{first}"], "pass one of them"),
    (["--hf-model", "{first}"], "--init-from and --hf-model each give the model's first weights"),
])
def test_weights_that_would_not_fit_are_one_line(first, tmp_path, capsys, flags, message):
    out = tmp_path / "refused"
    flags = [f.format(first=first) for f in flags]
    assert train(["--init-from", str(first), *flags, "--simulate", *QUIET, "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("asyncpp-train: error: ") and message in err[0], err
    assert not out.exists()


def test_a_llama_may_start_from_weights_trained_at_another_length_but_a_gpt_may_not(first, tmp_path, capsys):
    assert train(["--init-from", str(first), "--seq-len", "16", "--simulate", "--steps", "1", *QUIET,
                  "--out", str(tmp_path / "shorter")]) == 0  # rotary tables are computed, not stored
    gpt = tmp_path / "gpt"
    assert train(["--model", "tiny", "--simulate", "--steps", "1", *QUIET, "--out", str(gpt)]) == 0
    capsys.readouterr()
    assert train(["--init-from", str(gpt), "--seq-len", "16", "--simulate", *QUIET,
                  "--out", str(tmp_path / "refused")]) == 2
    assert "its model has seq_len=32, this run's 16" in capsys.readouterr().err


@pytest.mark.parametrize("how", [["--simulate"], ["--stages", "2"]], ids=["one-process", "pipeline"])
def test_a_damaged_checkpoint_to_start_from_is_one_line_before_any_rank_starts(first, tmp_path, capsys, how):
    source = tmp_path / "source"
    shutil.copytree(first, source)
    shard = source / "ckpt-000005" / "stage-00.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    out = tmp_path / "refused"
    assert train(["--init-from", str(source), *how, *QUIET, "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"checkpoint shard {shard} is truncated" in err[0], err
    assert not out.exists()
