"""Per-parameter weight delays in the simulator: pipedream (stage s of S computes S-1-s steps behind)
and the constant K-step delay (2bw with delay=K), checked against stale per-stage copies."""
import copy

import pytest
import torch
from torch import nn

from asyncpp_ext.models import GPT, Llama, llama_preset_config, preset_config
from asyncpp_ext.pipeline.partition import PartitionError, split
from asyncpp_ext.training.build import optimizer_factory as make_optimizer_factory
from asyncpp_ext.training.config import RunConfig
from asyncpp_ext.training.checkpoint import merge_engine_states
from asyncpp_ext.training.simulate import (DelaySimulator, DelaySimulatorError,
                                           stage_delay)
from delay_reference import delayed_training
from stage_delay_reference import stage_delayed_training

CFG = preset_config("tiny", n_layer=2, n_embd=16, seq_len=8)  # 4 blocks
STEPS = 8

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _gpt():
    return GPT(CFG, seed=0)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _muon_ef(model):
    """What asyncpp-train --optimizer muon builds: the Muon hybrid with EF at the auto beta."""
    cfg = RunConfig()
    cfg.optim.name = "muon"
    cfg.optim.pin_auto_values()
    return make_optimizer_factory(cfg)(model)


OPTIMIZERS = {"adamw": _adamw, "muon-hybrid-ef": _muon_ef}


def _minibatches(n, m, rows=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        block = torch.randint(0, 256, (m, rows, CFG.seq_len + 1), generator=gen)
        out.append([(b[:, :-1], b[:, 1:]) for b in block])
    return out


def _sim(schedule, make_optimizer=_adamw, **kwargs):
    model = _gpt()
    return DelaySimulator(model, make_optimizer(model), schedule, **kwargs)


def _kept_versions_match(sim, ref_model, history, partition, delays):
    """The simulator's params/stash/older equal the reference's newest model and kept copies."""
    state = sim.state_dict()
    t = sim.steps_done
    name_of = {id(p): n for n, p in ref_model.named_parameters()}
    blocks = ref_model.blocks()
    for s, (indices, d) in enumerate(zip(partition, delays)):
        names = [name_of[id(p)] for p in nn.ModuleList(blocks[i] for i in indices).parameters()]
        for k in range(1, d + 1):  # W(t-k), versions before 0 being W(0)
            saved = state["stash"] if k == 1 else {n: v[k - 2] for n, v in state["older"].items()}
            copies = list(history[s][max(t - k, 0)].parameters())
            assert all(torch.equal(saved[n], q) for n, q in zip(names, copies)), (s, k)
        if d < 2:
            assert not any(n in state["older"] for n in names)
        if d == 0:
            assert not any(n in state["stash"] for n in names)
    for n, p in ref_model.named_parameters():
        assert torch.equal(state["params"][n], p), n  # W(t)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_pipedream_equals_the_stage_copies_reference_bitwise(optimizer):
    make_optimizer = OPTIMIZERS[optimizer]
    batches = _minibatches(STEPS, m=1, rows=4)
    sim = _sim("pipedream", make_optimizer, stages=3)
    losses = [sim.step(mb) for mb in batches]
    partition = split(_gpt().blocks(), 3)
    delays = [2, 1, 0]
    ref_losses, ref_model, history = stage_delayed_training(_gpt, make_optimizer, batches, partition,
                                                            delays, GPT.loss)
    assert losses == ref_losses
    _kept_versions_match(sim, ref_model, history, partition, delays)
    # The delays are real and per stage: neither sync nor a uniform one-step delay gives these.
    sync = _sim("sync", make_optimizer)
    delayed = _sim("2bw", make_optimizer)
    sync_losses = [sync.step(mb) for mb in batches]
    assert losses[0] == sync_losses[0] and losses[1:] != sync_losses[1:]
    assert losses[2:] != [delayed.step(mb) for mb in batches][2:]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_constant_delay_equals_the_reference_bitwise(optimizer):
    make_optimizer = OPTIMIZERS[optimizer]
    batches = _minibatches(STEPS, m=3)
    sim = _sim("2bw", make_optimizer, delay=2)
    losses = [sim.step(mb) for mb in batches]
    partition = [list(range(CFG.num_blocks))]
    ref_losses, ref_model, history = stage_delayed_training(_gpt, make_optimizer, batches, partition,
                                                            [2], GPT.loss)
    assert losses == ref_losses
    _kept_versions_match(sim, ref_model, history, partition, [2])
    on_initial = [_sim("sync", make_optimizer).step(mb) for mb in batches[:4]]  # f_t(W(0))
    assert losses[:3] == on_initial[:3] and losses[3] != on_initial[3]  # steps 0..2 on W(0)
    one_step = _sim("2bw", make_optimizer)
    assert losses[2:] != [one_step.step(mb) for mb in batches][2:]


def test_pipedream_on_one_stage_is_sync():
    batches = _minibatches(5, m=1, rows=4)
    pd, sync = _sim("pipedream", stages=1), _sim("sync")
    assert [pd.step(mb) for mb in batches] == [sync.step(mb) for mb in batches]
    assert all(torch.equal(p, q) for p, q in zip(pd.params, sync.params))
    assert pd.history == [[] for _ in pd.params] and pd.state_dict()["stash"] == {}


def test_delay_one_is_2bw():
    batches = _minibatches(5, m=3)
    with_delay, plain = _sim("2bw", delay=1), _sim("2bw")
    losses = [with_delay.step(mb) for mb in batches]
    assert losses == [plain.step(mb) for mb in batches]
    ref_losses, ref_model, _ = delayed_training(_gpt, _adamw, batches,
                                                lambda net, x, y: GPT.loss(net(x)[0], y))
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(with_delay.params, ref_model.parameters()))
    assert with_delay.state_dict()["older"] == {}


@pytest.mark.parametrize("kwargs", [dict(schedule="pipedream", stages=3, m=1),
                                    dict(schedule="2bw", delay=3, m=2)], ids=["pipedream", "delay3"])
def test_state_round_trip_mid_run_continues_bitwise(kwargs):
    kwargs = dict(kwargs)
    schedule, m = kwargs.pop("schedule"), kwargs.pop("m")
    batches = _minibatches(7, m=m, rows=4 // m)
    sim = _sim(schedule, _muon_ef, **kwargs)
    for mb in batches[:4]:
        sim.step(mb)
    state = copy.deepcopy(sim.state_dict())
    expected = [sim.step(mb) for mb in batches[4:]]
    resumed = _sim(schedule, _muon_ef, **kwargs)
    resumed.load_state_dict(state)
    assert [resumed.step(mb) for mb in batches[4:]] == expected
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, sim.params))
    assert all(torch.equal(a, b) for ra, rb in zip(resumed.history, sim.history) for a, b in zip(ra, rb))
    # The older versions are part of the state: without them the run does not continue exactly.
    assert state["older"] and all(len(v) == d - 1 for v, d in
                                  zip(state["older"].values(), [x for x in sim.delays if x >= 2]))
    state["older"] = {n: [state["stash"][n]] * len(v) for n, v in state["older"].items()}
    wrong = _sim(schedule, _muon_ef, **kwargs)
    wrong.load_state_dict(state)
    assert [wrong.step(mb) for mb in batches[4:]] != expected


def test_state_layout_and_merged_shards():
    sim = _sim("pipedream", stages=3)
    for mb in _minibatches(3, m=1, rows=4):
        sim.step(mb)
    state = sim.state_dict()
    stage_of = {}
    for s, indices in enumerate(split(_gpt().blocks(), 3)):
        for i in indices:
            prefix = ["embed", "layers.0", "layers.1", "head"][i]
            stage_of.update({n: s for n in state["params"] if n.startswith(prefix + ".")})
    assert set(stage_of) == set(state["params"])
    assert set(state["stash"]) == {n for n, s in stage_of.items() if s < 2}
    assert set(state["older"]) == {n for n, s in stage_of.items() if s == 0}
    assert all(len(v) == 1 for v in state["older"].values())
    # Per-stage shards (what pipeline ranks write) merge back into the whole state.
    shards = []
    for s in range(3):
        mine = {n for n, st in stage_of.items() if st == s}
        shard = {k: state[k] for k in ("schedule", "steps_done", "clip")}
        for section in ("params", "stash", "older"):
            shard[section] = {n: v for n, v in state[section].items() if n in mine}
        shard["optimizer"] = {"state": {n: v for n, v in state["optimizer"]["state"].items() if n in mine},
                              "param_groups": state["optimizer"]["param_groups"] if s == 0 else []}
        shards.append(shard)
    merged = merge_engine_states(shards)
    assert merged["older"].keys() == state["older"].keys()
    resumed = _sim("pipedream", stages=3)
    resumed.load_state_dict(merged)
    assert all(torch.equal(a, b) for ra, rb in zip(resumed.history, sim.history) for a, b in zip(ra, rb))


def test_the_history_is_a_ring_of_d_copies_reused_in_place():
    sim = _sim("pipedream", stages=3)
    assert sorted(set(map(len, sim.history))) == [0, 1, 2]
    assert [len(r) for r in sim.history] == sim.delays
    buffers = {t.data_ptr() for ring in sim.history for t in ring}
    params = [p.data_ptr() for p in sim.params]
    for mb in _minibatches(4, m=1, rows=4):
        sim.step(mb)
    assert {t.data_ptr() for ring in sim.history for t in ring} == buffers
    assert [p.data_ptr() for p in sim.params] == params


def test_explicit_split_points_set_the_delays():
    sim = _sim("pipedream", stages=2, split_points=[3])  # embed + both layers behind, head not
    assert {n for n in sim.state_dict()["stash"]} == {n for n in sim.names if not n.startswith("head.")}
    assert stage_delay("pipedream", 0, 4) == 3 and stage_delay("2bw", 0, 4, 5) == 5
    assert stage_delay("1f1b", 2, 4) == 0 and stage_delay("2bw", 3, 4) == 1


class _TiedChain(nn.Module):
    """Three square blocks; block 1 reuses block 0's weight (a tie inside one pipeline stage)."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh())
            self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.c = nn.Linear(8, 4)
        self.b[0].weight = self.a[0].weight

    def blocks(self):
        return [self.a, self.b, self.c]

    def forward(self, x):
        for block in self.blocks():
            x = block(x)
        return x

    @staticmethod
    def loss(out, y):
        return nn.functional.mse_loss(out, y)


def test_a_tie_within_one_stage_keeps_working():
    gen = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(3, 8, generator=gen), torch.randn(3, 4, generator=gen))] for _ in range(6)]
    make_optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    model = _TiedChain()
    sim = DelaySimulator(model, make_optimizer(model), "pipedream", stages=2, split_points=[2])
    losses = [sim.step(mb) for mb in batches]
    ref_losses, ref_model, _ = stage_delayed_training(_TiedChain, make_optimizer, batches,
                                                      [[0, 1], [2]], [1, 0], _TiedChain.loss)
    assert losses == ref_losses
    assert torch.equal(model.a[0].weight, ref_model.a[0].weight)
    assert torch.equal(model.b[0].weight, model.a[0].weight)  # the mirror views the owner


def test_a_tie_across_stages_is_refused():
    model = _TiedChain()
    with pytest.raises(DelaySimulatorError, match=r"tied weight 'a.0.weight' \(stage 0\) is also used "
                                                  r"as 'b.0.weight' \(stage 1\).*blocks 0..1 on one stage"):
        DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=0.1), "pipedream", stages=2,
                       split_points=[1])
    assert model.b[0].weight is model.a[0].weight  # refused before the model was untied
    llama = Llama(llama_preset_config("llama-tiny", seq_len=8), seed=0)
    with pytest.raises(DelaySimulatorError, match="'embed.tok.weight'.*'head.proj.weight'.*schedule '2bw'"):
        DelaySimulator(llama, torch.optim.SGD(llama.parameters(), lr=0.1), "pipedream", stages=2)


def test_bad_arguments():
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DelaySimulatorError, match="'pipedream' needs stages"):
        DelaySimulator(model, opt, "pipedream")
    for stages in (0, True, 2.0):
        with pytest.raises(DelaySimulatorError, match="stages must be an integer"):
            DelaySimulator(model, opt, "pipedream", stages=stages)
    with pytest.raises(PartitionError, match="cannot split 4 blocks into 5 stages"):
        DelaySimulator(model, opt, "pipedream", stages=5)
    for schedule in ("sync", "1f1b", "pipedream"):
        with pytest.raises(DelaySimulatorError, match=f"does not apply to schedule '{schedule}'"):
            DelaySimulator(model, opt, schedule, delay=2, stages=2)
    for delay in (0, -1, 1.5, True):
        with pytest.raises(DelaySimulatorError, match="delay must be an integer >= 1"):
            DelaySimulator(model, opt, "2bw", delay=delay)
    sim = DelaySimulator(model, opt, "pipedream", stages=2)
    with pytest.raises(DelaySimulatorError, match=r"pipedream runs one microbatch per optimizer step \(got m=2\): use --microbatches 1"):
        sim.step(_minibatches(1, m=2)[0])
    assert sim.steps_done == 0


def test_states_of_another_delay_or_split_are_refused():
    batches = _minibatches(2, m=1, rows=4)
    sim = _sim("2bw", delay=3)
    for mb in batches:
        sim.step(mb)
    with pytest.raises(DelaySimulatorError, match="saved older do not match.*same schedule, delay and stage split"):
        _sim("2bw").load_state_dict(sim.state_dict())
    with pytest.raises(DelaySimulatorError, match=r"older versions of '.*' are 2, this simulator keeps 1"):
        _sim("2bw", delay=2).load_state_dict(sim.state_dict())
    pd = _sim("pipedream", stages=2)
    pd.step(batches[0])
    with pytest.raises(DelaySimulatorError, match="saved stash do not match"):
        _sim("pipedream", stages=2, split_points=[1]).load_state_dict(pd.state_dict())


# -- delay only one part of the model (the attribution knob) -----------------------------------------
def test_delay_only_matrices_or_others_splits_the_delays_by_muon_routing():
    from asyncpp_ext.optim.routing import split_named_parameters

    model = _gpt()
    muon = {n for n, _ in split_named_parameters(model)[0]}
    assert muon and len(muon) < len(list(model.parameters()))

    def delays(only):
        m = _gpt()
        sim = DelaySimulator(m, _adamw(m), "2bw", delay_only=only)
        return dict(zip(sim.names, sim.delays))

    every, matrices, others = delays(None), delays("matrices"), delays("others")
    assert set(every.values()) == {1}
    assert {n for n, d in matrices.items() if d} == muon
    assert {n for n, d in others.items() if d} == set(every) - muon
    batches = [(torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(i)),) * 2
               for i in range(4)]

    def losses(schedule, only=None):
        m = _gpt()
        sim = DelaySimulator(m, _adamw(m), schedule, delay_only=only)
        return [sim.step([b]) for b in batches]

    runs = {k: losses("2bw", k) for k in (None, "matrices", "others")}
    runs["sync"] = losses("sync")
    assert len({tuple(v) for v in runs.values()}) == 4  # each set of delays is its own run


def test_a_delay_whose_weight_versions_cannot_fit_is_refused_before_any_copy():
    m = _gpt()
    with pytest.raises(DelaySimulatorError, match=r"the delays keep 1000000000 older version\(s\) of the "
                                                  r"weights, .* GiB, more than this machine's memory .*; use a "
                                                  r"smaller delay"):
        DelaySimulator(m, _adamw(m), "2bw", delay=10**9)
    assert len(DelaySimulator(m, _adamw(m), "2bw", delay=3).history[0]) == 3


def test_a_state_of_another_model_shape_is_named_before_anything_is_written():
    wide = GPT(type(preset_config("tiny"))(**{**preset_config("tiny").__dict__, "n_embd": 64}), seed=0)
    m = _gpt()
    sim, before = DelaySimulator(m, _adamw(m), "2bw"), copy.deepcopy(m.state_dict())
    with pytest.raises(DelaySimulatorError, match=r"saved 'embed.tok.weight' has shape \(256, 64\), this "
                                                  r"model's \(256, \d+\); load a state saved from the same"):
        sim.load_state_dict(DelaySimulator(wide, _adamw(wide), "2bw").state_dict())
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_the_simulator_refuses_lr_rescale_over_different_delays():
    # its optimizer has one lr: the rescale would also slow the parameters computed on the newest
    # weights ("others"), or leave the delayed ones alone ("matrices")
    from asyncpp_ext.training.simulate import DelaySimulatorError
    m = _gpt()
    with pytest.raises(DelaySimulatorError, match=r"lr-rescale .* different delays \(\[0, 1\]\)"):
        DelaySimulator(m, _adamw(m), "2bw", delay_only="matrices", mitigation="lr-rescale", rescale_steps=10)
    m = _gpt()
    assert DelaySimulator(m, _adamw(m), "2bw", mitigation="lr-rescale", rescale_steps=10).mitigation.rescales_lr


@pytest.mark.parametrize("flags, words", [
    (["--delay-only", "matrices"], ["--delay-only", "simulator knob", "--schedule 2bw --simulate"]),
    (["--delay-only", "matrices", "--simulate", "--schedule", "sync"], ["--delay-only", "got sync"]),
    # one lr for parameters of which only some are delayed
    (["--delay-only", "matrices", "--simulate", "--schedule", "2bw", "--optimizer", "muon", "--mitigation",
      "lr-rescale"], ["lr-rescale", "--delay-only matrices", "drop one"]),
])
def test_delay_only_outside_a_simulated_2bw_run_is_one_line(tmp_path, capsys, flags, words):
    from asyncpp_ext.training.cli import main

    assert main(flags + ["--steps", "2", "--no-progress", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and all(w in err for w in words), err
    assert not (tmp_path / "run").exists()
