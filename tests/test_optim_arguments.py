"""Argument checks of the optimizer API: each parameter listed once, only known param group keys,
and every numeric hyperparameter a real number (not a bool, not a string), named when refused."""
import re

import numpy as np
import pytest
import torch
from torch import nn

from asyncpp_ext.models import Llama, llama_preset_config
from asyncpp_ext.optim import AdamW, ErrorFeedback, Muon, MuonHybrid, build_optimizer
from asyncpp_ext.optim.lr_schedule import LRSchedule, apply_lr
from asyncpp_ext.optim.mitigations import resolve_mitigation


def W(*shape):
    return nn.Parameter(torch.randn(*shape))


def small_model():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


# ---- a parameter listed twice --------------------------------------------------------------------
def test_a_parameter_listed_twice_is_refused_naming_both_names():
    p = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="parameter 'b' is the same tensor as parameter 'a'.*list each parameter"):
        AdamW([("a", p), ("b", p)], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match="parameter 'b' is the same tensor as parameter 'a'"):
        AdamW([{"params": [("a", p)]}, {"params": [("b", p)], "lr": 0.5}])
    with pytest.raises(ValueError, match="parameter 1 of param group 0 is the same tensor as parameter 0 of param group 0"):
        Muon([W(3, 3)] * 2)


def test_a_parameter_added_again_is_refused_and_the_group_not_kept():
    p, q = nn.Parameter(torch.zeros(4)), W(4)
    opt = AdamW([("a", p)], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match="parameter 'c' is the same tensor as parameter 'a'"):
        opt.add_param_group({"params": [("q", q), ("c", p)]})
    assert len(opt.param_groups) == 1
    p.grad = torch.ones(4)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((4,), -0.1), atol=1e-6)  # stepped once


def test_a_refused_group_is_not_kept():
    opt = AdamW([("a", W(4))])
    with pytest.raises(ValueError, match="lr must be a finite float > 0"):
        opt.add_param_group({"params": [("b", W(4))], "lr": -1.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", ["muon", "adamw", "sgd"])
def test_a_model_with_tied_weights_still_builds_with_the_tie_listed_once(name):
    model = Llama(llama_preset_config("llama-tiny", seq_len=8), seed=0)
    assert model.embed.tok.weight is model.head.proj.weight
    opt = build_optimizer(model, name)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len({id(p) for p in held}) == len(list(model.parameters()))


# ---- unknown param group keys --------------------------------------------------------------------
def test_a_misspelt_group_key_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match="unknown param group key 'weight_decy'; a group of algorithm 'adamw' "
                                         "takes only: .*betas.*weight_decay"):
        AdamW([{"params": [("a", W(4))], "weight_decy": 0.0}])
    opt = AdamW([("a", W(4))])
    with pytest.raises(ValueError, match="unknown param group key 'bogus'"):
        opt.add_param_group({"params": [("b", W(4))], "bogus": 3})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="unknown param group key 'betas'; a group of algorithm 'muon'"):
        Muon([{"params": [W(3, 3)], "betas": (0.9, 0.99)}])
    with pytest.raises(ValueError, match="unknown param group keys 'foreach', 'maximize'"):
        AdamW([{"params": [W(4)], "maximize": True, "foreach": False}])


def test_the_keys_the_package_and_torch_set_are_accepted_and_states_still_load():
    opt = AdamW([{"params": [("a", W(4))], "lr": 0.1, "initial_lr": 0.2, "ef_beta": 0.5, "eps": 1e-6}])
    opt.add_param_group({"params": [("b", W(3, 3))], "algorithm": "muon", "momentum": 0.9, "nesterov": False,
                         "ns_steps": 3, "ns_coefficients": (3.4445, -4.775, 2.0315), "adjust_lr_fn": None,
                         "ns_dtype": None, "normuon": True, "normuon_beta2": 0.9})
    model = small_model()
    hybrid = build_optimizer(model, "muon")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(hybrid, max_lr=0.1, total_steps=10, cycle_momentum=False)
    apply_lr(hybrid, 0.5)
    state = hybrid.state_dict()
    assert "max_lr" in state["param_groups"][0] and "initial_lr" in state["param_groups"][0]
    again = build_optimizer(model, "muon")
    again.load_state_dict(state)
    assert again.param_groups[0]["max_lr"] == 0.1 and scheduler.last_epoch == 0


# ---- numbers: bools, strings, None, NumPy scalars --------------------------------------------------
NUMBER_ARGUMENTS = [  # (build with the value, the argument's name, whether None takes a default)
    (lambda v: AdamW([("a", W(4))], lr=v), "lr", False),
    (lambda v: Muon([("a", W(4, 4))], lr=v), "lr", False),
    (lambda v: build_optimizer(small_model(), "muon", lr=v), "lr", True),
    (lambda v: build_optimizer(small_model(), "sgd", lr=v), "lr", True),
    (lambda v: build_optimizer(small_model(), "muon", adamw_lr=v), "adamw_lr", True),
    (lambda v: build_optimizer(small_model(), "muon", ef_beta=v), "ef_beta", True),
    (lambda v: build_optimizer(small_model(), "adamw", ef_beta=v), "ef_beta", True),
    (lambda v: build_optimizer(small_model(), "muon", weight_decay=v), "weight_decay", False),
    (lambda v: AdamW([("a", W(4))], weight_decay=v), "weight_decay", False),
    (lambda v: AdamW([("a", W(4))], ef_beta=v), "ef_beta", False),
    (lambda v: AdamW([("a", W(4))], eps=v), "eps", False),
    (lambda v: AdamW([("a", W(4))], betas=(0.9, v)), r"betas\[1\]", False),
    (lambda v: Muon([("a", W(4, 4))], momentum=v), "momentum", False),
    (lambda v: build_optimizer(small_model(), "muon", momentum=v), "momentum", True),
    (lambda v: build_optimizer(small_model(), "sgd", momentum=v), "momentum", True),
    (lambda v: MuonHybrid(small_model(), adamw_weight_decay=v), "weight_decay", True),
    (lambda v: Muon([("a", W(4, 4))], normuon=True, normuon_beta2=v), "normuon_beta2", False),
    (lambda v: ErrorFeedback(torch.optim.SGD([W(4)], lr=0.1), v), "beta", False),
    (lambda v: resolve_mitigation("dc", dc_lambda=v), "dc_lambda", False),
]


@pytest.mark.parametrize("build, arg, none_is_default", NUMBER_ARGUMENTS)
@pytest.mark.parametrize("bad", [True, "0.1", None])
def test_a_hyperparameter_that_is_no_number_is_named_in_one_line(build, arg, none_is_default, bad):
    if bad is None and none_is_default:
        build(bad)
        return
    with pytest.raises(ValueError) as info:
        build(bad)
    expected = rf"{arg} must be a number, got {re.escape(repr(bad))} \({type(bad).__name__}\)"
    assert re.fullmatch(expected, str(info.value)), str(info.value)


def test_counts_refuse_bools_and_take_numpy_integers():
    with pytest.raises(ValueError, match=r"ns_steps must be an int in \[0, 100\), got True \(bool\)"):
        Muon([W(3, 3)], ns_steps=True)
    opt = Muon([W(3, 3)], ns_steps=np.int64(3))
    assert type(opt.param_groups[0]["ns_steps"]) is int and opt.param_groups[0]["ns_steps"] == 3
    assert resolve_mitigation("lr-rescale", rescale_steps=np.int32(4)).rescale_steps == 4
    with pytest.raises(ValueError, match="rescale_steps must be an integer >= 1, got True"):
        resolve_mitigation("lr-rescale", rescale_steps=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_numpy_scalars_are_taken_as_python_numbers(dtype):
    model = small_model()
    opt = build_optimizer(model, "muon", lr=dtype(1), adamw_lr=dtype(1), weight_decay=dtype(0),
                          ef_beta=dtype(0), momentum=np.float32(0.5) if dtype is not np.int64 else 0.5)
    for group in opt.param_groups:
        assert all(type(group[k]) is float for k in ("lr", "weight_decay", "ef_beta", "eps"))
    adamw = AdamW([W(4)], lr=dtype(1), betas=(np.float32(0.5), np.float32(0.25)), eps=dtype(0))
    assert adamw.param_groups[0]["betas"] == (0.5, 0.25) and type(adamw.param_groups[0]["lr"]) is float
    sgd = build_optimizer(model, "sgd", lr=dtype(1))
    assert type(sgd.param_groups[0]["lr"]) is float
    LRSchedule("cosine", 10, min_lr_ratio=np.float32(0.5)).validate()
    assert apply_lr(adamw, np.float32(0.5)) == [0.5]
    assert resolve_mitigation("dc", dc_lambda=np.float32(0.5)).dc_lambda == 0.5
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("wrapped", [False, True])
def test_optimizers_deep_copy_and_pickle_whole(wrapped):
    """torch's Optimizer pickles only the groups and state: a fused optimizer's own settings, and
    ErrorFeedback's base (whose groups and state it shows), would be lost."""
    import copy
    import pickle

    p = nn.Parameter(torch.arange(4.0))
    ef = AdamW([("a", p)], lr=0.1, weight_decay=0.0, ef_beta=0.5)
    ef = ErrorFeedback(ef, beta=0.5) if wrapped else ef
    p.grad = torch.ones(4)
    ef.step()
    for twin in (copy.deepcopy(ef), pickle.loads(pickle.dumps(ef))):
        q = twin.param_groups[0]["params"][0]
        assert q is not p and torch.equal(q, p)
        q.grad = p.grad.clone()
        twin.step()
    ef.step()
    assert torch.equal(q, p)  # the copy steps as the original does
