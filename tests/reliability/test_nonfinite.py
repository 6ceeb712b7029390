"""NaN/Inf: stop naming stage and step, or skip the step on every stage exactly like the simulator;
never write NaN into weights or checkpoints."""
import json
import math
import re

import pytest
import torch
import torch.nn as nn

from asyncpp_ext.training.checkpoint import NonFiniteCheckpointError, list_checkpoints, save_checkpoint
from asyncpp_ext.pipeline import LaunchError, spawn
from asyncpp_ext.pipeline.nonfinite import NonFiniteError
from asyncpp_ext.training.simulate import DelaySimulator

import pipeline_workers as pw
from . import reliab_workers as rw

M, STEPS = 3, 6


def _simulate(policy, nan_input_step, nan_grad_block, nan_grad_step, nan_rows=(2, 4), optimizer="adamw"):
    model = nn.Sequential(*rw.nan_blocks(M, nan_grad_block, nan_grad_step))
    sim = DelaySimulator(model, pw.optimizer_factory(optimizer)(model), "2bw", on_nonfinite=policy,
                         loss_fn=lambda mod, x, y: nn.functional.mse_loss(mod(x), y))
    losses, skipped = [], []
    for x, y in rw.nan_batches(STEPS, M, nan_input_step, nan_rows):
        losses.append(sim.step(list(zip(x.chunk(M), y.chunk(M)))))
        skipped.append(sim.last_skipped)
    return losses, skipped, [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_intra_op_thread")
def test_skip_is_applied_on_every_stage_and_matches_the_simulator(tmp_path, monkeypatch):
    # step 1: a NaN input microbatch (NaN loss); step 3: a NaN weight gradient on the last stage only
    args = ("skip", M, STEPS, 1, 3, 3)
    # The ranks start with one intra-op thread like the simulator below (a product's summation
    # order may depend on the count), so the two agree bitwise.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spawn(rw.nonfinite_worker, 3, args + (str(tmp_path),))
    stats = json.loads((tmp_path / "stats.json").read_text())
    shards = [torch.load(tmp_path / f"stage{s}.pt") for s in range(3)]
    assert [s["skipped"] for s in shards] == [[1, 3]] * 3  # every stage skipped the same steps
    assert [sk for _, sk in stats] == [False, True, False, True, False, False]
    ref_losses, ref_skipped, ref_params = _simulate(*args[:1], *args[3:])
    assert ref_skipped == [sk for _, sk in stats]
    for (loss, _), ref in zip(stats, ref_losses):
        assert (math.isnan(loss) and math.isnan(ref)) or loss == ref
    got = [t for s in shards for t in s["params"].values()]
    assert len(got) == len(ref_params)
    for g, r in zip(got, ref_params):
        assert torch.isfinite(g).all() and torch.equal(g, r)
    # the skips are real: without them the weights would be NaN, and with a finite run they differ
    _, _, clean = _simulate("skip", None, None, 0)
    assert any(not torch.allclose(g, c) for g, c in zip(got, clean))


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_intra_op_thread")
def test_under_data_parallelism_one_replicas_bad_step_is_skipped_by_every_rank(tmp_path, monkeypatch):
    # S = 2 x R = 2. Step 2: a NaN input row in replica 0's share of microbatch 1 only (each replica
    # takes one of a global microbatch's two rows). Replica 0's last stage sees a NaN loss and poisons
    # the gradient it sends upstream; replica 1's stages see finite values of their own and learn of
    # the step from the averaged gradients. 256-byte buckets: several per stage, started inside the
    # backward. Replica 1's first stage judges its gradients only after those all-reduces are done
    # (and its last stage before): what it judges must be its own values, not an average holding
    # replica 0's NaN, or it would stop the run as if the NaN had arisen there. SGD, whose update follows the gradient's
    # rounding linearly (AdamW's per-element normalisation can magnify the replicas' other summation
    # order in an element whose gradient nearly cancels).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nan_rows = (2, 3)
    spawn(rw.nonfinite_worker, 4, ("skip", M, STEPS, 2, None, 0, str(tmp_path), 2, nan_rows, 256, "sgd", 2))
    shards = [[torch.load(tmp_path / f"stage{s}_replica{r}.pt") for s in range(2)] for r in range(2)]
    assert [[s["skipped"] for s in replica] for replica in shards] == [[[2], [2]]] * 2
    stats = json.loads((tmp_path / "stats.json").read_text())
    ref_losses, ref_skipped, ref_params = _simulate("skip", 2, None, 0, nan_rows, "sgd")
    assert [sk for _, sk in stats] == ref_skipped == [False, False, True, False, False, False]
    for (loss, _), ref in zip(stats, ref_losses):
        assert (math.isnan(loss) and math.isnan(ref)) or loss == pytest.approx(ref, rel=1e-6)
    for r in range(2):  # the replicas hold the same weights, those of one process on the global batches
        got = [t for s in shards[r] for t in s["params"].values()]
        assert len(got) == len(ref_params)
        for g, ref in zip(got, ref_params):
            assert torch.isfinite(g).all() and torch.allclose(g, ref, rtol=1e-5, atol=1e-6)
        if r:
            base = [t for s in shards[0] for t in s["params"].values()]
            assert all(torch.equal(g, b) for g, b in zip(got, base))


@pytest.mark.multiproc
def test_under_data_parallelism_a_nan_loss_with_finite_gradients_is_skipped_by_every_rank(tmp_path):
    # step 2: every target of replica 0's share of microbatch 1 ignored: its loss is 0/0 = NaN, its
    # gradient zero, so no gradient, received or averaged, shows it. Replica 1's last stage learns of
    # it from the loss averaged over the replicas; without that it would apply the step that every
    # other rank skips, and the replicas' weights would part.
    spawn(rw.ignored_targets_worker, 4, (str(tmp_path), 2, 2))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert [g["skipped"] for g in got] == [[2]] * 4
    for stage in (0, 1):
        a, b = got[stage]["params"], got[2 + stage]["params"]
        assert a.keys() == b.keys()
        for name in a:
            assert torch.isfinite(a[name]).all() and torch.equal(a[name], b[name]), name
    for last in (got[1], got[3]):  # both last stages report the step's mean loss as NaN, and skipped
        assert [sk for _, sk in last["stats"]] == [False, False, True, False, False]
        assert math.isnan(last["stats"][2][0])


@pytest.mark.multiproc
def test_stop_names_the_stage_and_step_and_every_rank_exits(tmp_path, capfd):
    with pytest.raises(LaunchError, match=r"rank 1 exited with code 1 \(stage 1: non-finite loss "
                                          r"\(nan\) in microbatch 1 at step 3; stopping \(use "
                                          r"--on-nonfinite skip"):
        spawn(rw.nonfinite_worker, 2, ("stop", M, STEPS, 2, None, 0, str(tmp_path)), grace_s=20)
    err = capfd.readouterr().err
    for rank in range(2):
        assert sum(l.startswith(f"asyncpp: rank {rank}: ") for l in err.splitlines()) == 1, err
    # rank 0 lost its peer: its state block, then its error once, read in order (what it waited
    # for, then where)
    assert "asyncpp: rank 0 (stage 0): lost a peer: this rank's state as its transport failed\n" in err, err
    rank0 = next(line for line in err.splitlines() if line.startswith("asyncpp: rank 0: "))
    assert err.count("closed the connection") == 1, err
    assert re.search(r" -- while waiting (to recv|for send) (activation|gradient) \(step \d+, microbatch \d+\) "
                     r"(from|to) stage 1 at stage 0, instruction #\d+ \w+ \(step \d+, microbatch \d+\); "
                     r"last completed: #\d+ \w+ \(step \d+, microbatch \d+\)$", rank0), rank0
    assert "Traceback" not in err
    assert not list(tmp_path.glob("stage*.pt"))


@pytest.mark.multiproc
@pytest.mark.parametrize("dp", [1, 2])  # dp 2: judged from each bucket's scan before its all-reduce
def test_a_gradient_that_turns_nan_on_an_early_stage_only_stops_even_when_skipping(tmp_path, capfd, dp):
    with pytest.raises(LaunchError, match=r"rank [02] exited with code 1 \(stage 0: non-finite gradient "
                                          r"in 0\.1\.w at step 2 arose on this stage while stage 1 .* cannot be "
                                          r"skipped on every stage; stopping\)"):
        spawn(rw.nonfinite_worker, 2 * dp, ("skip", M, STEPS, None, 0, 1, str(tmp_path), dp, (2, 4), 256),
              grace_s=20)
    assert "Traceback" not in capfd.readouterr().err


def test_simulator_stop_and_skip_rules():
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(nan\) in microbatch 1 at step 2; "
                                             r"stopping \(use --on-nonfinite skip"):
        _simulate("stop", 1, None, 0)
    with pytest.raises(NonFiniteError, match=r"non-finite gradient in 3\.1\.w at step 3; stopping"):
        _simulate("stop", None, 3, 2)
    losses, skipped, params = _simulate("skip", 1, None, 0)
    assert skipped == [False, True, False, False, False, False] and math.isnan(losses[1])
    assert all(torch.isfinite(p).all() for p in params)


class _ListStream:
    def __init__(self, minibatches):
        self.minibatches, self.i = minibatches, 0

    def next(self):
        self.i += 1
        return self.minibatches[self.i - 1]

    def state_dict(self):
        return {"i": self.i}


def _trainer(tmp_path, schedule, policy, steps, nan_input_step):
    """A Trainer over the simulator on the reliability blocks, one segment of ``steps`` steps
    (no evaluation or checkpoint inside it), step ``nan_input_step``'s input NaN; and the sim."""
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.trainer import Trainer

    model = nn.Sequential(*pw.make_blocks())
    sim = DelaySimulator(model, pw.optimizer_factory("sgd")(model), schedule, on_nonfinite=policy,
                         loss_fn=lambda mod, x, y: nn.functional.mse_loss(mod(x), y))
    minibatches = [list(zip(x.chunk(2), y.chunk(2))) for x, y in rw.nan_batches(steps, 2, nan_input_step)]
    cfg = RunConfig()
    cfg.train.steps, cfg.train.eval_every, cfg.train.ckpt_every = steps, 0, 0
    return Trainer(cfg, sim, _ListStream(minibatches), [], tmp_path), sim


def test_trainer_records_the_skip_and_checkpoints_refuse_nan_weights(tmp_path):
    from asyncpp_ext.training.run_files import read_metrics

    trainer, sim = _trainer(tmp_path, "2bw", "skip", 3, 1)
    trainer.run()
    rows = read_metrics(tmp_path)
    assert [r.get("skipped", False) for r in rows] == [False, True, False]
    assert rows[1]["loss"] is None and all(r["loss"] is not None for r in (rows[0], rows[2]))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    state = sim.state_dict()
    state["stash"]["0.weight"][0, 0] = float("inf")
    with pytest.raises(NonFiniteCheckpointError, match=r"older weight version \(stash\) of '0.weight' "
                                                        r"of stage 0 holds NaN/Inf.*which --on-nonfinite "
                                                        r"does not catch; lower --lr or clip"):
        save_checkpoint(tmp_path, 4, [state], {"config": {}, "data": {}})
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt" in p.name) == ["ckpt-000003"]


def test_a_stop_inside_a_segment_keeps_the_rows_of_the_steps_before_it(tmp_path):
    # the rows are written at a segment's end (with its checkpoint): a NaN/Inf stop in the middle of
    # one still writes those of the steps that finished
    from asyncpp_ext.training.run_files import read_metrics

    trainer, _ = _trainer(tmp_path, "sync", "stop", 4, 2)
    with pytest.raises(NonFiniteError, match="at step 3"):
        trainer.run()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "loss.png").stat().st_size > 0  # the losses that led to the stop, drawn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_gradient_scan_names_the_first_bad_parameter(dtype):
    from asyncpp_ext.pipeline.nonfinite import all_finite, first_nonfinite_name

    names, sizes = ["a.weight", "b.weight", "c.bias"], [40_000, 70_000, 3]
    flat = torch.randn(sum(sizes)).to(dtype)
    assert all_finite(flat) and first_nonfinite_name(flat, names, sizes) is None
    for index, name in ((0, "a.weight"), (39_999, "a.weight"), (40_000, "b.weight"), (110_002, "c.bias")):
        for bad in (float("nan"), float("inf"), float("-inf")):
            poisoned = flat.clone()
            poisoned[index] = bad
            assert not all_finite(poisoned)
            assert first_nonfinite_name(poisoned, names, sizes) == name


def test_a_non_finite_evaluation_loss_is_written_null(tmp_path):
    # JSON has no NaN: strict readers of metrics.jsonl would refuse the file
    from asyncpp_ext.training.run_files import read_metrics

    trainer, sim = _trainer(tmp_path, "sync", "skip", 2, None)
    trainer.eval_set, trainer.cfg.train.eval_every = [("batch",)], 2
    sim.eval_loss = lambda eval_set: float("nan")
    trainer.run()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and read_metrics(tmp_path)[-1]["eval_loss"] is None
