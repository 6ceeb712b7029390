"""The single-process reference of the update rules: sync and 2bw (one-step weight delay)."""
import copy

import pytest
import torch
from torch import nn

from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.optim import ErrorFeedback, Muon, build_optimizer
from asyncpp_ext.training.build import optimizer_factory as make_optimizer_factory
from asyncpp_ext.training.config import RunConfig
from asyncpp_ext.training.simulate import DelaySimulator
from delay_reference import delayed_training

CFG = preset_config("tiny", n_layer=1, n_embd=16, seq_len=8)
M = 3


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _minibatches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mb = []
        for _ in range(M):
            block = torch.randint(0, 256, (2, CFG.seq_len + 1), generator=gen)
            mb.append((block[:, :-1], block[:, 1:]))
        out.append(mb)
    return out


def _sim(schedule, opt="adamw"):
    model = GPT(CFG, seed=0)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return DelaySimulator(model, optimizer, schedule)


def _gpt():
    return GPT(CFG, seed=0)


def _mlp():
    """Bias-free 2-D weights only: what Muon alone can own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False),
                             nn.Tanh(), nn.Linear(16, 4, bias=False))


def _gpt_loss(net, x, y):
    logits = net(x)[0]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _mlp_loss(net, x, y):
    return nn.functional.mse_loss(net(x), y)


def _mlp_minibatches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(M)]
            for _ in range(n)]


def _cli_muon(model):
    """What asyncpp-train --optimizer muon builds: MuonHybrid with EF 0.5 and the CLI's defaults."""
    cfg = RunConfig()
    cfg.optim.name = "muon"
    cfg.optim.pin_auto_values()
    return make_optimizer_factory(cfg)(model)


OPTIMIZERS = {  # name -> (model, optimizer factory, loss, minibatches)
    "torch-sgd": (_gpt, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _gpt_loss, _minibatches),
    "torch-adamw": (_gpt, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), _gpt_loss, _minibatches),
    "muon": (_mlp, lambda m: Muon(m.parameters(), lr=0.02, weight_decay=0.1), _mlp_loss, _mlp_minibatches),
    "muon-hybrid-ef": (_gpt, _cli_muon, _gpt_loss, _minibatches),
    "adamw-ef": (_gpt, lambda m: build_optimizer(m, "adamw", 1e-2, weight_decay=0.1, ef_beta=0.5),
                 _gpt_loss, _minibatches),
    "ef-sgd": (_gpt, lambda m: ErrorFeedback(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 0.5),
               _gpt_loss, _minibatches),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_2bw_equals_the_two_model_reference_bitwise(name):
    make_model, make_optimizer, loss_fn, make_batches = OPTIMIZERS[name]
    batches = make_batches(5)
    model = make_model()
    sim = DelaySimulator(model, make_optimizer(model), "2bw", loss_fn=loss_fn)
    losses = [sim.step(mb) for mb in batches]
    ref_losses, ref_model, ref_previous = delayed_training(make_model, make_optimizer, batches, loss_fn)
    assert losses == ref_losses
    for (n, p), q, old, q_old in zip(sim.model.named_parameters(), ref_model.parameters(), sim.stash,
                                     ref_previous.parameters()):
        assert torch.equal(p, q), n  # W(T)
        assert torch.equal(old, q_old), n  # W(T-1), what step T+1 would differentiate
    sync_losses, _, _ = delayed_training(make_model, make_optimizer, batches, loss_fn, delayed=False)
    assert losses[0] == sync_losses[0] and losses[1:] != sync_losses[1:]  # the delay is real


@pytest.mark.parametrize("schedule", ["sync", "gpipe", "1f1b"])
def test_synchronous_schedules_equal_plain_training(schedule):
    batches = _minibatches(4)
    sim = _sim(schedule)
    losses = [sim.step(mb) for mb in batches]
    ref_losses, ref_model, _ = delayed_training(
        _gpt, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), batches, _gpt_loss, delayed=False)
    assert losses == ref_losses
    for p, q in zip(sim.model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_2bw_matches_sync_for_one_step_then_diverges():
    batches = _minibatches(3)
    sync, delayed = _sim("sync"), _sim("2bw")
    assert sync.step(batches[0]) == delayed.step(batches[0])  # W(-1) = W(0)
    for p, q in zip(sync.model.parameters(), delayed.model.parameters()):
        assert torch.equal(p, q)  # W(1) = W(0) - lr U(g(W(0))) in both
    assert sync.step(batches[1]) != delayed.step(batches[1])  # f_1(W(1)) vs f_1(W(0))
    assert any(not torch.equal(p, q) for p, q in zip(sync.model.parameters(), delayed.model.parameters()))


@pytest.mark.parametrize("schedule", ["sync", "2bw"])
def test_state_dict_round_trip_continues_bitwise(schedule):
    batches = _minibatches(6)
    sim = _sim(schedule)
    for mb in batches[:3]:
        sim.step(mb)
    state = copy.deepcopy(sim.state_dict())
    expected = [sim.step(mb) for mb in batches[3:]]
    resumed = _sim(schedule)
    resumed.load_state_dict(state)
    assert resumed.steps_done == 3
    assert [resumed.step(mb) for mb in batches[3:]] == expected
    names = {n for n, _ in sim.model.named_parameters()}
    assert set(state["params"]) == names and set(state["optimizer"]["state"]) == names
    if schedule == "2bw":
        assert set(state["stash"]) == names  # W(t-1) is part of the asynchronous state
        assert any(not torch.equal(state["stash"][n], state["params"][n]) for n in names)


def test_stash_is_required_to_resume_2bw_exactly():
    batches = _minibatches(5)
    sim = _sim("2bw")
    for mb in batches[:3]:
        sim.step(mb)
    state = copy.deepcopy(sim.state_dict())
    expected = sim.step(batches[3])
    state["stash"] = {n: t.clone() for n, t in state["params"].items()}  # forget W(t-1)
    wrong = _sim("2bw")
    wrong.load_state_dict(state)
    assert wrong.step(batches[3]) != expected


def test_eval_loss_uses_newest_weights_without_touching_gradients_or_state():
    batches = _minibatches(2)
    sim = _sim("2bw")
    sim.step(batches[0])
    before = [p.clone() for p in sim.model.parameters()]
    value = sim.eval_loss(batches[1])
    with torch.no_grad():
        direct = sum(sim.model(x, y)[1].item() for x, y in batches[1]) / M
    assert value == direct
    assert all(torch.equal(a, b) for a, b in zip(before, sim.model.parameters()))


def test_bad_arguments():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="schedule"):
        DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "async")
    with pytest.raises(ValueError, match="does not hold parameter"):
        DelaySimulator(model, torch.optim.SGD(list(model.parameters())[:2], lr=0.1), "sync")
    sim = DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "sync")
    with pytest.raises(ValueError, match="schedule '2bw'"):
        sim.load_state_dict({**sim.state_dict(), "schedule": "2bw"})
    other = GPT(preset_config("tiny", n_layer=2, n_embd=16, seq_len=8))
    other_sim = DelaySimulator(other, torch.optim.SGD(other.parameters(), lr=0.1), "sync")
    with pytest.raises(ValueError, match="same model shape"):
        sim.load_state_dict(other_sim.state_dict())
    with pytest.raises(ValueError, match="at least one microbatch"):
        sim.step([])
