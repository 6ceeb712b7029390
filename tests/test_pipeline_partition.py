"""Partitioning a model into stages, and how a stage looks to its optimizer (no processes)."""
import pytest
import torch.nn as nn

from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.optim.routing import split_named_parameters
from asyncpp_ext.pipeline import PartitionError, balanced_split_points, split
from asyncpp_ext.pipeline.partition import GlobalView
from asyncpp_ext.pipeline.ties import block_prefixes as _block_prefixes


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split_points([1, 1, 1, 1], 2) == [2]
    assert balanced_split_points([10, 1, 1, 1, 1, 10], 3) == [1, 5]
    assert balanced_split_points([5, 5, 5], 3) == [1, 2]


@pytest.mark.parametrize("stages,points,message", [
    (5, None, "cannot split 4 blocks into 5 stages"),
    (2, [0], "strictly increasing"),
    (3, [2], "3 stages need 2 split points"),
    (0, None, "stages must be >= 1"),
])
def test_bad_splits_are_named(stages, points, message):
    with pytest.raises(PartitionError, match=message):
        split([nn.Linear(2, 2) for _ in range(4)], stages, points)


def _routing(named_module):
    muon, adamw = split_named_parameters(named_module)
    return {n for n, _ in muon}, {n for n, _ in adamw}


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_stage_routes_like_the_whole_model(stages):
    """Muon for hidden matrices only -- on the whole GPT and on each pipeline stage's view of it.
    (The tiny preset's positional table is as long as the model is wide, which once made every
    hidden projection look like an output head.)"""
    model = GPT(preset_config("tiny", n_layer=2))
    whole_muon, whole_adamw = _routing(model)
    assert whole_muon == {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")}
    blocks = model.blocks()
    seen_muon, seen_adamw = set(), set()
    for indices in split(blocks, stages):
        stage = nn.Sequential(*[blocks[i] for i in indices])
        muon, adamw = _routing(GlobalView(stage, _block_prefixes(model, blocks, indices)))
        seen_muon |= muon
        seen_adamw |= adamw
    assert seen_muon == whole_muon and seen_adamw == whole_adamw
