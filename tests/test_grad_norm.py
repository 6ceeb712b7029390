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


def _block_norms_by_hand(model, microbatches):
    """Each block's gradient norm of a plain backward of the step's loss, parameters grouped by the
    block their name starts with (a tied tensor once, under its first name: the embedding)."""
    for x, y in microbatches:
        (model(x, y)[1] / len(microbatches)).backward()
    prefixes = ["embed", "head", *(f"layers.{i}" for i in range(len(model.layers)))]
    sums = {}
    for name, p in model.named_parameters():
        block = max((b for b in prefixes if name.startswith(b + ".")), key=len)
        sums[block] = sums.get(block, 0.0) + float(p.grad.double().pow(2).sum())
    return {b: s ** 0.5 for b, s in sums.items()}


def test_block_norms_are_a_plain_backwards_per_block(tmp_path):
    run = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--schedule", "sync", "--log-block-grad-norms", "--out", str(run)]) == 0
    rows = _rows(run)
    cfg = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    want = _block_norms_by_hand(build_run_model(cfg, True), build_data(cfg)[0].next())
    got = rows[0]["grad_norms"]
    assert list(got) == ["embed", "layers.0", "layers.1", "head"]
    assert got == pytest.approx(want, rel=1e-5)
    for r in rows:  # the same terms as the global norm: their squares add up to it
        assert sum(v * v for v in r["grad_norms"].values()) == pytest.approx(r["grad_norm"] ** 2, rel=1e-12)


def test_a_pipelines_block_norms_are_its_simulations(tmp_path):
    runs = {}
    for name, flags in (("sim", ["--simulate"]), ("pipe", ["--stages", "3", "--timeout", "30"])):
        assert train([*FLAGS, *flags, "--microbatches", "3", "--log-block-grad-norms", "--clip-grad-norm", "1.0",
                      "--out", str(tmp_path / name)]) == 0
        runs[name] = _rows(tmp_path / name)
    for key in ("grad_norm", "grad_norms", "loss"):
        assert [r[key] for r in runs["pipe"]] == [r[key] for r in runs["sim"]], key


def test_block_norms_reach_tensorboard_and_are_refused_where_norms_are(tmp_path, capsys):
    from asyncpp_ext.training.tensorboard_log import row_scalars

    assert row_scalars({"step": 1, "grad_norms": {"embed": 2.0, "layers.0": 0.5}}) == {
        "train/grad_norm/embed": 2.0, "train/grad_norm/layers.0": 0.5}
    out = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--schedule", "pipedream", "--microbatches", "1", "--log-block-grad-norms",
                  "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log_block_grad_norms is not supported with pipedream" in err[0], err


def test_the_engines_need_the_measurement_for_block_norms():
    from asyncpp_ext.models.registry import build_model, model_config
    from asyncpp_ext.pipeline import Pipeline
    from asyncpp_ext.training.simulate import DelaySimulator, DelaySimulatorError

    model = build_model(model_config("tiny"), seed=0)
    with pytest.raises(ValueError, match="block_grad_norms sums the clipping measurement's norms per block"):
        Pipeline(model, loss_fn=type(model).loss, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                 stages=1, block_grad_norms=True)
    with pytest.raises(DelaySimulatorError, match="block_grad_norms sums the clipping measurement's norms"):
        DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "sync", block_grad_norms=True)
