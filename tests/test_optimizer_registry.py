"""One default each: the optimizer registry (optim/registry.py) is the only source of the optimizers'
names and defaults, and the command line's config path and the Python API build the same optimizer.

For every registered optimizer, the optimizer ``asyncpp-train --optimizer NAME`` builds (a RunConfig
with every optim field left out, its auto values pinned, then the CLI's optimizer factory) and
``build_optimizer(model, NAME)`` with every argument left out must agree on the type, every param
group's hyper-parameters and which parameters each group holds.
"""
import dataclasses
import importlib.util

import pytest
import torch

from asyncpp_ext.models import GPT, PRESETS
from asyncpp_ext.optim import ErrorFeedback, MuonHybrid, build_optimizer
from asyncpp_ext.optim import registry
from asyncpp_ext.optim.library import LIBRARY_OPTIMIZERS
from asyncpp_ext.optim.registry import OPTIMIZERS, OptimizerSpec, optimizer_spec
from asyncpp_ext.training import config
from asyncpp_ext.training.config import OptimConfig, RunConfig

HAS_STUDY = importlib.util.find_spec("pytorch_optimizer") is not None


def cli_optimizer_factory(cfg: RunConfig):
    """The function the command line builds its optimizer with (training/build.py)."""
    from asyncpp_ext.training.build import optimizer_factory

    return optimizer_factory(cfg)


def through_the_cli(model, name: str):
    cfg = RunConfig()
    cfg.optim.name = name
    cfg.validate()
    cfg.optim.pin_auto_values(cfg.train.steps)
    return cli_optimizer_factory(cfg)(model)


def describe(opt, model) -> dict:
    """Everything an optimizer was built with: its type (and EF wrapper), per group every
    hyper-parameter and the names of its parameters, and the defaults."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"type": type(opt).__name__}
    if isinstance(opt, ErrorFeedback):
        out.update(ef_wrapper_beta=opt.beta, ef_source=opt.ef_source, base_type=type(opt.base).__name__)
    else:
        out.update(ef_source=getattr(opt, "ef_source", None), shard_group=getattr(opt, "shard_group", None))
    out["groups"] = [{**{k: v for k, v in g.items() if k != "params"},
                      "params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]
    out["defaults"] = {k: v for k, v in opt.defaults.items() if k != "params"}
    return out


def params_of(name):
    marks = [pytest.mark.skipif(not HAS_STUDY, reason="needs pip install 'asyncpp_ext[study]'")] \
        if OPTIMIZERS[name].extra == "study" else []
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [params_of(n) for n in OPTIMIZERS])
def test_the_cli_and_build_optimizer_build_the_same_optimizer(name):
    model = GPT(PRESETS["tiny"], seed=0)
    cli, api = describe(through_the_cli(model, name), model), describe(build_optimizer(model, name), model)
    assert cli == api
    spec = optimizer_spec(name)
    groups = api["groups"]
    assert groups[0]["lr"] == spec.lr
    if spec.family == "muon":  # the routing and the AdamW part: the same in both, and the registry's
        assert [g["algorithm"] for g in groups] == ["muon", "adamw"]
        assert groups[1]["lr"] == spec.adamw_lr == 3e-3
        assert groups[0]["momentum"] == spec.momentum == OptimConfig().muon_momentum
        assert {g["ef_beta"] for g in groups} == {spec.ef_beta}
        assert groups[0]["normuon"] is (name == "normuon")
    elif spec.family == "sgd":
        assert api["type"] == "SGD" and groups[0]["momentum"] == spec.momentum == OptimConfig().momentum
        assert spec.ef_beta == 0
    elif spec.family == "adamw":
        assert {g["ef_beta"] for g in groups} == {spec.ef_beta}
    else:
        assert api["ef_wrapper_beta"] == spec.ef_beta and api["base_type"] == spec.library_class
    assert sorted(n for g in groups for n in g["params"]) == sorted(n for n, _ in model.named_parameters())


def test_the_config_names_and_defaults_are_the_registrys():
    assert config.OPTIMIZERS == tuple(OPTIMIZERS) == ("adamw", "muon", "normuon", "sgd", "lion", "adan", "soap",
                                                      "mars")
    assert config.MUON_FAMILY == registry.muon_family() == ("muon", "normuon")
    assert dict(config.LR_AUTO) == {n: s.lr for n, s in OPTIMIZERS.items()}
    assert dict(config.EF_BETA_AUTO) == {n: s.ef_beta for n, s in OPTIMIZERS.items()}
    assert config.MUON_ADAMW_LR_AUTO == OPTIMIZERS["muon"].adamw_lr == OPTIMIZERS["normuon"].adamw_lr
    assert LIBRARY_OPTIMIZERS == {n: s.library_class for n, s in OPTIMIZERS.items() if s.family == "library"}
    assert all(s.extra == "study" for n, s in OPTIMIZERS.items() if n in LIBRARY_OPTIMIZERS)
    o = OptimConfig()
    assert (o.weight_decay, o.ef_source) == (registry.DEFAULT_WEIGHT_DECAY, registry.DEFAULT_EF_SOURCE)
    for name, spec in OPTIMIZERS.items():
        o = OptimConfig(name=name)
        assert (o.effective_lr(), o.effective_ef_beta(), o.effective_adamw_lr()) == (spec.lr, spec.ef_beta,
                                                                                      spec.adamw_lr)
        assert spec.summary and "\n" not in spec.summary


def test_muon_hybrids_own_defaults_are_the_registrys():
    model = GPT(PRESETS["tiny"], seed=0)
    muon = OPTIMIZERS["muon"]
    groups = MuonHybrid(model).param_groups
    assert (groups[0]["lr"], groups[1]["lr"], groups[0]["momentum"]) == (muon.lr, muon.adamw_lr, muon.momentum)


def test_the_config_views_are_read_only_and_live(monkeypatch):
    with pytest.raises(TypeError):
        config.LR_AUTO["muon"] = 1.0  # change the registry entry instead
    monkeypatch.setitem(OPTIMIZERS, "muon", dataclasses.replace(OPTIMIZERS["muon"], lr=0.05))
    assert config.LR_AUTO["muon"] == OptimConfig(name="muon").effective_lr() == 0.05


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"optimizer name must be one of \('adamw', 'muon'.*got 'adam'"):
        optimizer_spec("adam")
    with pytest.raises(ValueError, match="must be one of"):
        build_optimizer(GPT(PRESETS["tiny"]), "adam")
    with pytest.raises(KeyError):
        config.LR_AUTO["adam"]


def test_a_new_entry_is_built_by_both_paths_with_its_own_defaults(monkeypatch):
    """An entry added to the registry alone: build_optimizer and the CLI's factory build it with its
    defaults, without being told about it anywhere else."""
    spec = OptimizerSpec("heavy-sgd", "sgd", lr=0.123, ef_beta=0.25, momentum=0.5, summary="a test entry")
    monkeypatch.setitem(OPTIMIZERS, spec.name, spec)
    model = GPT(PRESETS["tiny"], seed=0)
    cfg = RunConfig()
    cfg.optim.name = spec.name
    cfg.optim.pin_auto_values()
    assert (cfg.optim.lr, cfg.optim.ef_beta) == (0.123, 0.25)
    cli, api = cli_optimizer_factory(cfg)(model), build_optimizer(model, spec.name)
    assert describe(cli, model) == describe(api, model)
    assert isinstance(api, ErrorFeedback) and api.beta == 0.25
    assert (api.param_groups[0]["lr"], api.param_groups[0]["momentum"]) == (0.123, 0.5)


def test_specs_are_checked():
    with pytest.raises(ValueError, match="family"):
        OptimizerSpec("x", "rmsprop", lr=1e-3, ef_beta=0.0, summary="-")
    with pytest.raises(ValueError, match="adamw_lr"):
        OptimizerSpec("x", "muon", lr=1e-3, ef_beta=0.0, summary="-")
    with pytest.raises(ValueError, match="library_class"):
        OptimizerSpec("x", "library", lr=1e-3, ef_beta=0.0, summary="-")
    with pytest.raises(TypeError):
        OPTIMIZERS["normuon"].build_kwargs["normuon"] = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPTIMIZERS["muon"].lr = 1.0
