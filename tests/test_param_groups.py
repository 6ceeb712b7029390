"""(name, tensor) pairs reach torch.optim as plain tensors plus "param_names" (torch 2.5 takes no pairs)."""
import pytest
import torch

from asyncpp_ext.optim import AdamW, build_optimizer
from asyncpp_ext.optim.param_groups import named_param_groups


def _tensors(n):
    return [torch.nn.Parameter(torch.randn(2, 2)) for _ in range(n)]


def test_pairs_become_one_group_with_names():
    a, b = _tensors(2)
    (group,) = named_param_groups([("a", a), ("b", b)])
    assert group["params"][0] is a and group["params"][1] is b and group["param_names"] == ["a", "b"]


def test_groups_keep_their_options_and_plain_tensors_stay_plain():
    a, b, c = _tensors(3)
    groups = named_param_groups([{"params": [("a", a)], "lr": 0.1}, {"params": [b, c]}])
    assert groups[0] == {"params": [a], "param_names": ["a"], "lr": 0.1}
    assert groups[1]["params"] == [b, c] and "param_names" not in groups[1]
    assert named_param_groups([a, b]) == [a, b] and named_param_groups(a) == [a]


def test_a_group_mixing_pairs_and_tensors_is_refused():
    a, b = _tensors(2)
    with pytest.raises(ValueError, match="all be tensors or all be \\(name, tensor\\) pairs"):
        named_param_groups([("a", a), b])


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
def test_built_optimizers_name_their_parameters(name):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = build_optimizer(model, name, 0.01)
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert [n for g in opt.state_dict()["param_groups"] for n in g["param_names"]] == names


def test_a_group_added_later_is_split_too():
    a, b = _tensors(2)
    opt = AdamW([("a", a)], lr=1e-3)
    opt.add_param_group({"params": [("b", b)]})
    assert opt.param_groups[1]["params"][0] is b and opt.param_groups[1]["param_names"] == ["b"]
