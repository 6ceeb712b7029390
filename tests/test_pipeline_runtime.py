"""The runtime over real processes (gloo): exact semantics, continuous 2bw stream, failures."""
import json
import time

import pytest
import torch

from asyncpp_ext.pipeline import LaunchError, spawn

import pipeline_workers as w
from delay_reference import delayed_training

pytestmark = pytest.mark.multiproc


def _run(tmp_path, schedule, stages, m, steps, optimizer):
    spawn(w.train_worker, stages, (schedule, m, steps, optimizer, str(tmp_path)))
    losses = json.loads((tmp_path / "losses.json").read_text())
    stage_files = [torch.load(tmp_path / f"stage{s}.pt", weights_only=False) for s in range(stages)]
    return losses, stage_files


@pytest.mark.usefixtures("one_intra_op_thread")  # as the ranks: the same arithmetic, bitwise
@pytest.mark.parametrize("schedule,stages,m,optimizer", [
    ("2bw", 2, 2, "adamw"), ("2bw", 4, 4, "sgd"), ("gpipe", 2, 3, "sgd"),
    # 1f1b at depth 2 stays in the default suite (tests/test_train_pipeline.py)
    pytest.param("1f1b", 4, 4, "adamw", marks=pytest.mark.slow)])
def test_losses_and_weights_match_single_process_reference(tmp_path, schedule, stages, m, optimizer):
    steps = 6
    losses, stage_files = _run(tmp_path, schedule, stages, m, steps, optimizer)
    ref_losses, ref_params = w.reference_losses(schedule, m, steps, optimizer)
    assert losses == ref_losses
    got_params = [p for f in stage_files for i in sorted(f["weights"], key=int) for p in f["weights"][i]]
    assert len(got_params) == len(ref_params)
    for g, r in zip(got_params, ref_params):
        assert torch.equal(g, r)
    if schedule == "2bw":  # the delay is real: 2bw differs from the synchronous run after step 1
        sync_losses, _ = w.reference_losses("1f1b", m, steps, optimizer)
        assert losses[0] == sync_losses[0]
        assert all(abs(a - b) > 1e-6 for a, b in zip(losses[1:], sync_losses[1:]))


def test_2bw_stream_does_not_drain_between_steps(tmp_path):
    _, stage_files = _run(tmp_path, "2bw", 2, 4, 4, "sgd")
    trace = stage_files[0]["trace"]  # (op, step, microbatch, version, start_ns, end_ns)
    for t in range(3):
        next_first_forward = min(e[4] for e in trace if e[0] == "forward" and e[1] == t + 1)
        last_backward_end = max(e[5] for e in trace if e[0] == "backward" and e[1] == t)
        assert next_first_forward < last_backward_end, f"step {t + 1} waited for step {t} to drain"
    for files in stage_files:  # the watchdog's view: every instruction counted, none left running
        progress, last = files["progress"], files["trace"][-1]
        assert progress["completed"] == len(files["trace"]) and progress["current"] is None
        assert progress["last_done"] == tuple(last[:4])


def test_a_stage_that_raises_ends_every_rank_with_a_message(capfd):
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 exited with code 1"):
        spawn(w.failing_worker, 4, (1, 4), grace_s=25)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("asyncpp: rank ")]
    assert any(l.startswith("asyncpp: rank 1: injected failure") for l in lines), err
    for rank in (0, 2, 3):  # each neighbour reports on its own, naming the stage it lost
        mine = [l for l in lines if l.startswith(f"asyncpp: rank {rank}: ")]
        assert len(mine) == 1 and "has probably exited" in mine[0], err
    assert "Traceback" not in err
    assert elapsed < 30, elapsed


def _gpt_loss(net, x, y):
    logits = net(x)[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("schedule,stages,m", [("2bw", 2, 2)])
def test_default_path_equals_the_two_model_reference_bitwise(tmp_path, schedule, stages, m):
    """The GPT under MuonHybrid + EF 0.5 (asyncpp-train's optimizer) over real stage processes, each
    with its own optimizer for its share of the model, against tests/delay_reference.py with one
    optimizer for the whole model."""
    steps = 5
    spawn(w.gpt_train_worker, stages, (schedule, m, steps, str(tmp_path)))
    losses = json.loads((tmp_path / "losses.json").read_text())
    shards = [torch.load(tmp_path / f"stage{s}.pt", weights_only=False) for s in range(stages)]
    params = {n: t for s in shards for n, t in s["params"].items()}
    stash = {n: t for s in shards for n, t in s["stash"].items()}
    ref_losses, ref_model, ref_previous = delayed_training(
        w.gpt_model, w.cli_muon_factory, w.gpt_minibatches(steps, m), _gpt_loss, delayed=schedule == "2bw")
    assert losses == ref_losses
    assert params.keys() == dict(ref_model.named_parameters()).keys()
    for (n, want), (_, want_old) in zip(ref_model.named_parameters(), ref_previous.named_parameters()):
        assert torch.equal(params[n], want), n  # W(T)
        assert torch.equal(stash[n], want_old), n  # W(T-1)


def test_ranks_that_split_the_blocks_differently_are_stopped_at_the_handshake():
    # rank 0 keeps block 0, rank 1 blocks 2 and 3: block 1 would belong to no stage, and the
    # shapes fit, so nothing else would notice
    with pytest.raises(LaunchError, match=r"rank 1 exited with code 1 \(stage 1 and stage 0 split the model's "
                                          r"blocks differently \(this stage's split: 0,1 \| 2,3\)"):
        spawn(w.per_rank_worker, 2, ([{"split_points": [1]}, {"split_points": [2]}],), grace_s=10)
    spawn(w.per_rank_worker, 2, ([{"split_points": [2]}, {"split_points": [2]}],))  # the same split: trains


def test_ranks_given_other_schedules_are_stopped_at_the_handshake_naming_them():
    with pytest.raises(LaunchError, match=r"rank 1 exited with code 1 \(stage 1 and stage 0 disagree on schedule "
                                          r"2bw vs 1f1b: launch every rank with the same settings\)"):
        spawn(w.per_rank_worker, 2, ([{}, {"schedule": "1f1b"}],), grace_s=10)
