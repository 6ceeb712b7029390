"""``Pipeline.gather_weights``: the whole model's newest weights on one rank, by global name, a tied
tensor once -- what a script on the Python API loads into a fresh model or exports."""
import pytest
import torch

from asyncpp_ext.models import Llama, llama_preset_config
from asyncpp_ext.pipeline import spawn
from pipeline_workers import gather_weights_worker

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("dst", [0, 1])
def test_one_rank_gets_every_stages_newest_weights(tmp_path, dst):
    spawn(gather_weights_worker, 2, (str(tmp_path), dst))
    stages = [torch.load(tmp_path / f"params{r}.pt") for r in (0, 1)]
    gathered = [torch.load(tmp_path / f"gathered{r}.pt") for r in (0, 1)]
    assert gathered[1 - dst] is None
    weights = gathered[dst]
    assert set(stages[0]).isdisjoint(stages[1])
    assert sorted(weights) == sorted([*stages[0], *stages[1]])
    assert all(torch.equal(weights[n], t) for s in stages for n, t in s.items())
    # every parameter of the model once: the tied head is its embedding
    model = Llama(llama_preset_config("llama-tiny"), seed=0)
    assert sorted(weights) == sorted(n for n, _ in model.named_parameters())
    before = model.head.proj.weight.detach().clone()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["head.proj.weight"] and unexpected == []
    assert model.head.proj.weight is model.embed.tok.weight and not torch.equal(model.head.proj.weight, before)
