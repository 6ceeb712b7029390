"""``grad_norm`` in the metrics rows: with --clip-grad-norm (or --log-grad-norm, which measures
without clipping) every step's row holds the global norm of its gradient before clipping -- the
first step's equals the norm of a plain backward of the run's first minibatch, and a 2-stage
pipeline's equal its simulation's."""
import json

import pytest
import torch

from asyncpp_ext.training.build import build_data, build_run_model
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config import RunConfig

FLAGS = ["--model", "tiny", "--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2", "--steps", "4",
         "--eval-every", "0", "--no-checkpoints", "--no-progress", "--threads", "1", "--head-loss", "plain"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("measure", [["--clip-grad-norm", "0.5"], ["--log-grad-norm"]], ids=["clip", "log"])
def test_the_first_steps_norm_is_a_plain_backwards(tmp_path, measure):
    run = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--schedule", "sync", *measure, "--out", str(run)]) == 0
    rows = _rows(run)
    assert all(r["grad_norm"] > 0 for r in rows) and len({r["grad_norm"] for r in rows}) == len(rows)
    cfg = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    model = build_run_model(cfg, True)
    microbatches = build_data(cfg)[0].next()
    for x, y in microbatches:  # the step's loss: the mean of its microbatches' mean losses
        (model(x, y)[1] / len(microbatches)).backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert rows[0]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)


def test_a_pipelines_norms_are_its_simulations(tmp_path):
    runs = {}
    for name, flags in (("sim", ["--simulate"]), ("pipe", ["--stages", "2", "--timeout", "30"])):
        assert train([*FLAGS, *flags, "--clip-grad-norm", "1.0", "--out", str(tmp_path / name)]) == 0
        runs[name] = _rows(tmp_path / name)
    assert [r["grad_norm"] for r in runs["pipe"]] == [r["grad_norm"] for r in runs["sim"]]
    assert len(runs["sim"]) == 4


def test_no_norm_without_clipping(tmp_path):
    run = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--out", str(run)]) == 0
    assert not any("grad_norm" in r for r in _rows(run))


def test_log_grad_norm_measures_and_leaves_the_run_as_it_was(tmp_path):
    runs = {}
    for name, flags in (("plain", ["--simulate"]), ("sim", ["--simulate", "--log-grad-norm"]),
                        ("pipe", ["--stages", "2", "--timeout", "30", "--log-grad-norm"])):
        assert train([*FLAGS, *flags, "--out", str(tmp_path / name)]) == 0
        runs[name] = _rows(tmp_path / name)
    assert [r["loss"] for r in runs["sim"]] == [r["loss"] for r in runs["pipe"]] == [r["loss"] for r in runs["plain"]]
    assert [r["grad_norm"] for r in runs["pipe"]] == [r["grad_norm"] for r in runs["sim"]]
    assert all(r["grad_norm"] > 0 for r in runs["sim"]) and len(runs["sim"]) == 4


def test_log_grad_norm_where_a_global_norm_cannot_run_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--schedule", "pipedream", "--microbatches", "1", "--log-grad-norm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log_grad_norm is not supported with pipedream" in err[0], err
    assert not out.exists()


def test_an_infinite_threshold_measures_and_never_clips():
    from asyncpp_ext.pipeline.clipping import PreviousNormClipper, check_max_norm

    clipper = PreviousNormClipper(float("inf"))
    grads = [torch.full((3,), 4.0), torch.full((2,), 1e6)]
    for _ in range(2):
        assert clipper.clip(grads, skipped=False) == 1.0
    assert clipper.previous_norm == pytest.approx((3 * 16 + 2 * 1e12) ** 0.5)
    assert torch.equal(grads[1], torch.full((2,), 1e6))
    with pytest.raises(ValueError, match="must be a number > 0"):
        check_max_norm(float("nan"))
