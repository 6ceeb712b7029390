"""Staleness mitigations (optim/mitigations.py) in the simulator against a reference loop written
from the formulas, over real stage processes against the simulator, and across a resume.

The references keep every weight version W(0..t) of a float64 MLP as plain tensors, compute each
step's gradient with torch.func.functional_call on the version the formula names, and hand it to a
torch optimizer (SGD with momentum, or AdamW) holding W(t). They share nothing with the simulator
but that optimizer. Both sides run in float64: prediction and the lr rescale agree bitwise (the
same operations in the same order); delay compensation groups its product differently, so it is
compared to 1e-12 relative (float64 rounding over a few steps, measured below 1e-15), far below the
mitigation's own effect, which every test also asserts.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.func import functional_call

from asyncpp_ext.optim.mitigations import (MitigationError, default_rescale_steps, delay_compensate_,
                                           lr_rescale_multiplier, predicted_weights, resolve_mitigation)
from asyncpp_ext.training.checkpoint import load_checkpoint
from asyncpp_ext.training.cli import main
from asyncpp_ext.training.checkpoint import merge_engine_states
from asyncpp_ext.training.simulate import DelaySimulator, DelaySimulatorError

STEPS, MICROBATCHES = 7, 2
LR = {"sgd": 0.1, "adamw": 0.03}

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _minibatches(steps: int = STEPS, m: int = MICROBATCHES):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(3, 4, generator=g, dtype=torch.float64),
              torch.randn(3, 3, generator=g, dtype=torch.float64)) for _ in range(m)] for _ in range(steps)]


def _mse(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _optimizer(name: str, model: nn.Module):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[name], momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=LR[name], weight_decay=0.1)


class WeightsEFSGD(torch.optim.Optimizer):
    """Plain SGD with error feedback from the weights, written from its rule: D = -lr g and
    W(t+1) = W(t) + D + beta (D - (W(t) - W(t-1))) where W(t-1) is given, else W(t) + D. It speaks
    the versioned step protocol (sources, previous) only to check what the engines hand it."""

    ef_source = "weights"

    def __init__(self, params, lr: float, ef_beta: float):
        super().__init__(params, dict(lr=lr, ef_beta=ef_beta))

    @torch.no_grad()
    def step_from(self, sources, previous):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                now = sources[p] if sources else p
                update = -group["lr"] * p.grad
                if previous and p in previous:  # previous may alias p: read it before writing
                    update = update + group["ef_beta"] * (update - (now - previous[p]))
                p.copy_(now + update)

    def step(self, closure=None):
        return self.step_from(None, None)


def reference(optimizer: str, mitigation: str, delay: int, minibatches, lam: float = 0.0, rescale_steps: int = 1,
              ef_beta: float = 0.0):
    """Losses and final weights of the delayed rule with ``mitigation``, from the formulas."""
    model = _mlp()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    opt = WeightsEFSGD(params, LR["sgd"], ef_beta) if mitigation == "ef-weights" else _optimizer(optimizer, model)
    base_lr = [g["lr"] for g in opt.param_groups]
    versions = [[p.detach().clone() for p in params]]  # versions[v] = W(v)

    def w(v):
        return versions[max(v, 0)]

    losses = []
    for t, minibatch in enumerate(minibatches):
        if mitigation == "predict":
            compute = [then + delay * (then - before) for then, before in zip(w(t - delay), w(t - delay - 1))]
        else:
            compute = [v.clone() for v in w(t - delay)]
        leaves = [c.requires_grad_() for c in compute]
        grads, total = None, 0.0
        for x, y in minibatch:
            loss = nn.functional.mse_loss(functional_call(model, dict(zip(names, leaves)), (x,)), y)
            step_grads = torch.autograd.grad(loss / len(minibatch), leaves)
            grads = list(step_grads) if grads is None else [a + b for a, b in zip(grads, step_grads)]
            total += loss.item()
        losses.append(total / len(minibatch))
        if mitigation == "dc":
            grads = [g + lam * g * g * (now - then) for g, now, then in zip(grads, w(t), w(t - delay))]
        if mitigation == "lr-rescale":
            for group, lr in zip(opt.param_groups, base_lr):
                group["lr"] = lr * (1 + delay) ** -max(0.0, 1 - t / rescale_steps)
        for p, g in zip(params, grads):
            p.grad = g
        if mitigation == "ef-weights" and t >= 1:
            opt.step_from(None, {p: prev for p, prev in zip(params, w(t - 1))})
        else:
            opt.step()
        versions.append([p.detach().clone() for p in params])
    return losses, versions[-1]


def simulate(optimizer: str, mitigation: str | None, delay: int, minibatches, ef_beta: float = 0.0, **kwargs):
    model = _mlp()
    opt = (WeightsEFSGD(model.parameters(), LR["sgd"], ef_beta) if optimizer == "ef-weights"
           else _optimizer(optimizer, model))
    sim = DelaySimulator(model, opt, "2bw", loss_fn=_mse, delay=None if delay == 1 else delay,
                         mitigation=mitigation, **kwargs)
    losses = [sim.step(mb) for mb in minibatches]
    return losses, [p.detach().clone() for p in model.parameters()], sim


def _max_rel(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


# ---- the shared definitions ------------------------------------------------------------------
def test_the_formulas_on_numbers():
    then, before = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    assert torch.equal(predicted_weights(then, before, 2), torch.tensor([2.0, 0.0]))
    grad = torch.tensor([2.0, -1.0])
    delay_compensate_(grad, torch.tensor([1.0, 1.0]), torch.tensor([0.5, 3.0]), 0.25)
    assert torch.equal(grad, torch.tensor([2.0 + 0.25 * 4 * 0.5, -1.0 + 0.25 * 1 * -2.0]))
    assert lr_rescale_multiplier(1, 0, 10) == 0.5 and lr_rescale_multiplier(3, 0, 10) == 0.25
    assert lr_rescale_multiplier(1, 5, 10) == 2 ** -0.5
    assert lr_rescale_multiplier(1, 10, 10) == lr_rescale_multiplier(1, 50, 10) == lr_rescale_multiplier(0, 0, 10) == 1
    assert default_rescale_steps(200) == 20 and default_rescale_steps(5) == 1
    with pytest.raises(MitigationError, match="rescale_steps"):
        resolve_mitigation("lr-rescale")
    with pytest.raises(MitigationError, match="not one of none, ef, predict, dc, lr-rescale"):
        resolve_mitigation("dcasgd")


# ---- the simulator against the formulas ------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("delay", [1, 2])
def test_predict_equals_the_reference_bitwise(optimizer, delay):
    batches = _minibatches()
    losses, weights, sim = simulate(optimizer, "predict", delay, batches)
    ref_losses, ref_weights = reference(optimizer, "predict", delay, batches)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    plain, _ = reference(optimizer, "none", delay, batches)
    assert losses[:delay + 1] == plain[:delay + 1]  # steps 0..d extrapolate W(0) by nothing
    assert all(abs(a - b) > 1e-9 for a, b in zip(losses[delay + 1:], plain[delay + 1:]))
    assert all(len(ring) == delay + 1 for ring in sim.history)  # W(t-d-1) kept as well


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("delay", [1, 2])
def test_dc_equals_the_reference(optimizer, delay):
    batches, lam = _minibatches(), 2.0
    losses, weights, _ = simulate(optimizer, "dc", delay, batches, dc_lambda=lam)
    ref_losses, ref_weights = reference(optimizer, "dc", delay, batches, lam=lam)
    plain_losses, plain_weights = reference(optimizer, "none", delay, batches)
    assert _max_rel(weights, ref_weights) <= 1e-12
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-12
    assert _max_rel(weights, plain_weights) > 1e-6  # the compensation changes the run


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("delay", [1, 2])
def test_lr_rescale_equals_the_reference_bitwise(optimizer, delay):
    batches, k = _minibatches(), 4
    losses, weights, sim = simulate(optimizer, "lr-rescale", delay, batches, rescale_steps=k)
    ref_losses, ref_weights = reference(optimizer, "lr-rescale", delay, batches, rescale_steps=k)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert sim.optimizer.param_groups[0]["lr"] == LR[optimizer]  # t >= K: the plain lr again
    _, plain_weights = reference(optimizer, "none", delay, batches)
    assert _max_rel(weights, plain_weights) > 1e-3


@pytest.mark.parametrize("delay", [1, 2])
def test_ef_from_the_weights_gets_w_t_minus_1(delay):
    """The engine passes W(t-1) as ``previous`` from the second step on (d = 1 keeps one extra
    version for it); checked through an optimizer that applies the EF rule with it."""
    batches = _minibatches()
    losses, weights, sim = simulate("ef-weights", None, delay, batches, ef_beta=0.5)
    ref_losses, ref_weights = reference("sgd", "ef-weights", delay, batches, ef_beta=0.5)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert all(len(ring) == 2 for ring in sim.history)  # d = 1: one extra; d = 2: W(t-1) is ring[1]
    _, plain = reference("sgd", "ef-weights", delay, batches, ef_beta=0.0)
    assert _max_rel(weights, plain) > 1e-3


def test_lr_rescale_under_simulated_pipedream_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(DelaySimulatorError, match="real pipeline"):
        DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "pipedream", stages=2,
                       mitigation="lr-rescale", rescale_steps=3)


# ---- resume ------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [1, 2])
def test_predict_resumes_bitwise(delay):
    batches = _minibatches(steps=8)
    full, full_weights, _ = simulate("adamw", "predict", delay, batches)
    part, _, sim = simulate("adamw", "predict", delay, batches[:4])
    state = sim.state_dict()
    assert all(len(v) == delay for v in state["older"].values())  # W(t-2)..W(t-d-1)
    model = _mlp()
    resumed = DelaySimulator(model, _optimizer("adamw", model), "2bw", loss_fn=_mse,
                             delay=None if delay == 1 else delay, mitigation="predict")
    resumed.load_state_dict(state)
    rest = [resumed.step(mb) for mb in batches[4:]]
    assert part + rest == full
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), full_weights))
    other = _mlp()
    plain = DelaySimulator(other, _optimizer("adamw", other), "2bw", loss_fn=_mse, delay=None if delay == 1 else delay)
    with pytest.raises(DelaySimulatorError, match="older"):  # prediction's extra version is not optional
        resumed.load_state_dict(plain.state_dict())


def test_ef_weights_resumes_from_a_state_without_the_scratch_version():
    """A pipeline's 2bw checkpoint holds W(t) and W(t-1) only; the simulator's extra EF slot is
    scratch, so such a state continues the run bitwise."""
    batches = _minibatches(steps=6)
    full, _, _ = simulate("ef-weights", None, 1, batches, ef_beta=0.5)
    part, _, sim = simulate("ef-weights", None, 1, batches[:3], ef_beta=0.5)
    state = {k: v for k, v in sim.state_dict().items() if k != "older"}
    model = _mlp()
    resumed = DelaySimulator(model, WeightsEFSGD(model.parameters(), LR["sgd"], 0.5), "2bw", loss_fn=_mse)
    resumed.load_state_dict(state)
    assert part + [resumed.step(mb) for mb in batches[3:]] == full


def test_a_predict_run_resumes_bitwise_through_the_cli(tmp_path):
    flags = ["--model", "tiny", "--n-layer", "1", "--seq-len", "16", "--micro-batch-size", "2", "--no-progress",
             "--threads", "1", "--simulate", "--mitigation", "predict", "--eval-every", "0", "--ckpt-every", "3"]
    assert main(flags + ["--steps", "6", "--out", str(tmp_path / "full")]) == 0
    assert main(flags + ["--steps", "3", "--out", str(tmp_path / "part")]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--steps", "6", "--no-progress"]) == 0
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")
    config = json.loads((tmp_path / "part" / "config.json").read_text())["optim"]
    assert config["mitigation"] == "predict" and config["ef_beta"] == 0.0  # pinned: EF is off


# ---- real stage processes against the simulator -----------------------------------------------
def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


TINY = ["--model", "tiny", "--n-layer", "2", "--seq-len", "16", "--micro-batch-size", "2", "--no-progress",
        "--threads", "1", "--schedule", "2bw", "--microbatches", "2", "--optimizer", "adamw", "--lr", "0.01",
        "--steps", "6", "--eval-every", "0", "--ckpt-every", "6"]


@pytest.mark.multiproc
@pytest.mark.parametrize("mitigation", [["--mitigation", "dc", "--dc-lambda", "1"],
                                        ["--mitigation", "lr-rescale", "--rescale-steps", "4"]])
def test_a_real_2bw_pipeline_equals_the_simulator_bitwise(tmp_path, mitigation):
    assert main(TINY + mitigation + ["--stages", "2", "--out", str(tmp_path / "real")]) == 0
    assert main(TINY + mitigation + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    assert main(TINY + ["--mitigation", "none", "--simulate", "--out", str(tmp_path / "plain")]) == 0
    real, sim, plain = (_losses(tmp_path / run) for run in ("real", "sim", "plain"))
    assert real == sim
    # 2bw computes step t on W(t-1); dc first changes W(2) (step 0 has W(0) - W(-1) = 0) and
    # lr-rescale W(1), so from step 3 on every loss shows the mitigation.
    assert all(a != b for a, b in zip(real[3:], plain[3:])), (real, plain)
    states = [merge_engine_states([s["engine"] for s in load_checkpoint(tmp_path / run / "ckpt-000006")[1]])
              for run in ("real", "sim")]
    for part in ("params", "stash"):
        assert states[0][part].keys() == states[1][part].keys()
        for name, want in states[1][part].items():
            assert torch.equal(states[0][part][name], want), (part, name)


def _blocks() -> list:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Tanh(), nn.Linear(8, 3))]


def _pipedream_batches(steps: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 3, generator=g)) for _ in range(steps)]


def _ef_weights_factory(module):
    return WeightsEFSGD(module.parameters(), lr=0.05, ef_beta=0.5)


def pipedream_worker(steps: int, out_dir: str) -> None:
    """One rank of a 3-stage pipedream run (delays 2, 1, 0) with dc and EF from the weights."""
    from asyncpp_ext.pipeline import Pipeline, init_distributed

    init_distributed(60)
    torch.set_num_threads(1)
    pipe = Pipeline(_blocks(), loss_fn=nn.functional.mse_loss, optimizer=_ef_weights_factory, schedule="pipedream",
                    microbatches=1, mitigation="dc", dc_lambda=2.0)
    losses = [s.loss for s in pipe.train(_pipedream_batches(steps), steps)]
    torch.save({"params": pipe.state_dict()["params"], "losses": losses}, f"{out_dir}/stage{pipe.stage}.pt")


@pytest.mark.multiproc
def test_real_pipedream_stages_apply_dc_and_ef_weights_like_the_simulator(tmp_path):
    """Per-stage delays 2, 1, 0: dc reads W(t-d) from buffer (t+1) % n, EF W(t-1) from buffer
    (t-1) % n (on the 2bw-like stage the very buffer being written), the last stage neither."""
    from asyncpp_ext.pipeline import spawn

    steps = 8
    spawn(pipedream_worker, 3, (steps, str(tmp_path)))
    shards = [torch.load(tmp_path / f"stage{s}.pt") for s in range(3)]
    real_params = {n: t for s in shards for n, t in s["params"].items()}

    def run(dc_lambda, ef_beta):
        model = nn.Sequential(*_blocks())
        sim = DelaySimulator(model, WeightsEFSGD(model.parameters(), lr=0.05, ef_beta=ef_beta), "pipedream",
                             stages=3, loss_fn=lambda net, x, y: nn.functional.mse_loss(net(x), y),
                             mitigation="dc", dc_lambda=dc_lambda)
        return [sim.step([b]) for b in _pipedream_batches(steps)], dict(model.named_parameters())

    sim_losses, sim_params = run(2.0, 0.5)
    assert shards[2]["losses"] == sim_losses
    assert real_params.keys() == sim_params.keys()
    for name, want in sim_params.items():
        assert torch.equal(real_params[name], want), name
    for other in (run(0.0, 0.5), run(2.0, 0.0)):  # each of the two acts
        assert not torch.equal(other[1]["0.weight"], sim_params["0.weight"])

