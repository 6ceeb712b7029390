"""``--average N`` (asyncpp-eval, asyncpp-export): the mean of the weights of a checkpoint and the
N-1 before it in its run -- each parameter the float64 mean of the checkpoints' own, evaluated and
exported as one model."""
import json

import pytest
import torch

from asyncpp_ext.eval import main as evaluate
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.evaluation import evaluation_set, mean_loss
from asyncpp_ext.training.export import load_average, load_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("average") / "run"
    assert train(["--model", "tiny", "--steps", "6", "--ckpt-every", "2", "--no-progress", "--threads", "1",
                  "--eval-every", "0", "--seq-len", "16", "--micro-batch-size", "2", "--out", str(out)]) == 0
    return out


def test_each_parameter_is_the_mean_of_the_checkpoints(run):
    cfg, step, model, what = load_average(run / "ckpt-000006", 3)
    assert step == 6 and what == "mean of ckpt-000002..ckpt-000006 (3)"
    singles = [dict(load_model(run / f"ckpt-00000{s}")[2].named_parameters()) for s in (2, 4, 6)]
    for name, p in model.named_parameters():
        want = (sum(m[name].double() for m in singles) / 3).float()
        assert torch.equal(p, want), name
    assert not torch.equal(singles[0]["embed.tok.weight"], singles[2]["embed.tok.weight"])
    _, _, earlier, what = load_average(run / "ckpt-000004", 2)  # the window ends at the one named
    assert what == "mean of ckpt-000002..ckpt-000004 (2)"
    first = dict(earlier.named_parameters())["embed.tok.weight"]
    assert torch.equal(first, ((singles[0]["embed.tok.weight"].double() + singles[1]["embed.tok.weight"].double())
                               / 2).float())


def test_asyncpp_eval_scores_the_average(run, tmp_path):
    rows = {}
    for n in (1, 3):
        assert evaluate([str(run), "--average", str(n), "--json", str(tmp_path / f"{n}.json")]) == 0
        (rows[n],) = json.loads((tmp_path / f"{n}.json").read_text())
    cfg, _, model, _ = load_average(run / "ckpt-000006", 3)
    batches, _ = evaluation_set(cfg, None, None, None)
    assert rows[3]["loss"] == pytest.approx(mean_loss(model, batches, torch.device("cpu")), rel=1e-6)
    assert rows[3]["averaged"] == 3 and rows[1]["averaged"] == 1 and rows[3]["loss"] != rows[1]["loss"]


def test_asyncpp_export_writes_the_average(run, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    from asyncpp_ext.export import main as export
    from asyncpp_ext.models.hf_export import to_transformers

    out = tmp_path / "avg"
    assert export([str(run), "--average", "2", "--no-check", "--out", str(out)]) == 0
    written = safetensors_torch.load_file(str(out / "model.safetensors"))
    cfg, _, model, _ = load_average(run / "ckpt-000006", 2)
    _, want = to_transformers(model, cfg.model, torch.float32)
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)


@pytest.mark.parametrize("command, flags, words", [
    ("eval", ["--average", "4"], "--average 4: {run} has 3 checkpoint(s) up to ckpt-000006; pass --average 3 or less"),
    ("eval", ["--average", "0"], "--average must be at least 1"),
    ("eval", ["--average", "2", "--every-checkpoint"], "--average N with --every-checkpoint"),
    ("export", ["--average", "5", "--no-check", "--out", "{tmp}/x"], "has 3 checkpoint(s)"),
])
def test_bad_averages_are_one_line(run, tmp_path, capsys, command, flags, words):
    from asyncpp_ext.export import main as export

    if command == "export":  # without the hf extra asyncpp-export refuses for that first
        pytest.importorskip("safetensors")
    main = evaluate if command == "eval" else export
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert main([str(run), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.replace("{run}", str(run)) in err[0], err
    assert not (tmp_path / "x").exists()
