"""Tied weights (docs/design.md §1.13): found, untied per use, summed in one order by the simulator
and by a real pipeline, the copies bitwise equal on every stage, stored once in a checkpoint."""
import pytest
import torch

from asyncpp_ext.models import GPT, Llama, llama_preset_config, preset_config
from asyncpp_ext.pipeline import spawn
from asyncpp_ext.pipeline.ties import find_ties, untie
from asyncpp_ext.training.simulate import DelaySimulator

import tied_workers as w

TIED = llama_preset_config("llama-tiny", seq_len=8)


def test_the_tied_llama_has_one_tie_and_the_gpt_none():
    model = Llama(TIED, seed=0)
    ties = find_ties(model, model.blocks())
    assert len(ties) == 1
    assert ties[0].owner.name == "embed.tok.weight"
    assert [u.name for u in ties[0].mirrors] == ["head.proj.weight"]
    assert find_ties(GPT(preset_config("tiny")), GPT(preset_config("tiny")).blocks()) == []


def test_untie_keeps_the_logits_and_splits_the_gradient_per_use():
    model = Llama(TIED, seed=0)
    idx = torch.randint(0, TIED.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(idx)[0]
    pairs = untie(model.blocks(), find_ties(model, model.blocks()))
    (owner, mirror), = pairs
    assert owner is model.embed.tok.weight and mirror is model.head.proj.weight and owner is not mirror
    assert mirror.data_ptr() == owner.data_ptr()  # one storage, two autograd leaves
    assert torch.equal(model(idx)[0], before)
    model(idx, idx)[1].backward()
    assert owner.grad is not None and mirror.grad is not None
    assert not torch.equal(owner.grad, mirror.grad)


def test_the_simulator_gives_the_single_tensor_the_sum_owner_plus_mirror():
    """One SGD step (lr 1, no momentum): the tied tensor moves by -(grad as embedding + grad as head),
    added in that order, which is what a pipeline's owner stage adds."""
    model = Llama(TIED, seed=0)
    ref = Llama(TIED, seed=0)
    untie(ref.blocks(), find_ties(ref, ref.blocks()))
    x = torch.randint(0, TIED.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, TIED.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    ref(x, y)[1].backward()
    want = ref.embed.tok.weight.detach() - (ref.embed.tok.weight.grad + ref.head.proj.weight.grad)
    sim = DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=1.0), "sync")
    sim.step([(x, y)])
    assert torch.equal(model.embed.tok.weight, want)
    assert torch.equal(model.head.proj.weight, want)  # the mirror views the owner
    assert "head.proj.weight" not in sim.state_dict()["params"]  # stored once


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("stages", [2, 3])
def test_tied_copies_stay_bitwise_equal_and_match_the_simulator(tmp_path, stages):
    steps, m = 20, stages
    spawn(w.tied_worker, stages, ("2bw", m, steps, str(tmp_path)))
    files = [torch.load(tmp_path / f"stage{s}.pt", weights_only=False) for s in range(stages)]
    owner, mirror = files[0]["raw"], files[-1]["raw"]
    for section in ("params", "stash"):  # the newest version and W(t-1)
        assert torch.equal(owner[section]["embed.tok.weight"], mirror[section]["head.proj.weight"]), section
    assert not torch.equal(owner["params"]["embed.tok.weight"], owner["stash"]["embed.tok.weight"])
    stored = [n for f in files for n in f["checkpoint"]["params"] if n in ("embed.tok.weight", "head.proj.weight")]
    assert stored == ["embed.tok.weight"]
    clip_norms = {f["checkpoint"]["clip"]["previous_norm"] for f in files}
    assert len(clip_norms) == 1 and None not in clip_norms  # every stage knows the same global norm

    model = w.model()
    sim = DelaySimulator(model, w.muon_factory(model), "2bw", clip_grad_norm=w.CLIP)
    sim_losses = [sim.step(batch) for batch in w.minibatches(steps, m)]
    assert files[-1]["losses"] == sim_losses  # bitwise
    sim_state = sim.state_dict()
    assert clip_norms == {sim_state["clip"]["previous_norm"]}
    for f in files:
        for section in ("params", "stash"):
            for name, value in f["checkpoint"][section].items():
                assert torch.equal(value, sim_state[section][name]), (section, name)
