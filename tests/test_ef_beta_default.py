"""The default --ef-beta ("auto"): per-optimizer strength from the delay study; 0 still means off."""
import pytest
import torch

from asyncpp_ext.training.config import EF_BETA_AUTO, ConfigError, RunConfig
from asyncpp_ext.models import GPT, PRESETS
from asyncpp_ext.training.build import optimizer_factory as make_optimizer_factory


def _ef_betas(optimizer):
    """The EF strength of every param group of a fused optimizer."""
    return {g["ef_beta"] for g in optimizer.param_groups}


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_auto_default_turns_on_the_studied_strength(name):
    cfg = RunConfig()
    cfg.optim.name = name
    assert cfg.optim.ef_beta is None
    assert cfg.optim.effective_ef_beta() == EF_BETA_AUTO[name] == 0.5
    cfg.validate()
    opt = make_optimizer_factory(cfg)(GPT(PRESETS["tiny"]))
    assert _ef_betas(opt) == {0.5}


def test_auto_keeps_sgd_plain():
    cfg = RunConfig()
    cfg.optim.name = "sgd"
    assert cfg.optim.effective_ef_beta() == 0.0
    assert type(make_optimizer_factory(cfg)(GPT(PRESETS["tiny"]))) is torch.optim.SGD


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_explicit_zero_means_off(name):
    cfg = RunConfig()
    cfg.optim.name, cfg.optim.ef_beta = name, 0.0
    assert cfg.optim.effective_ef_beta() == 0.0
    assert _ef_betas(make_optimizer_factory(cfg)(GPT(PRESETS["tiny"]))) == {0.0}


def test_negative_ef_beta_is_still_rejected():
    cfg = RunConfig()
    cfg.optim.ef_beta = -0.5
    with pytest.raises(ConfigError, match="optim.ef_beta"):
        cfg.validate()


def test_auto_survives_a_config_round_trip():
    cfg = RunConfig()
    assert RunConfig.from_dict(cfg.to_dict()).optim.ef_beta is None


def test_a_run_records_its_auto_values_and_resumes_with_them(tmp_path, monkeypatch):
    """config.json holds the numbers "auto" stood for; a resumed run keeps them even when the
    defaults have changed since (here: muon's registry entry patched before the resume; config's
    LR_AUTO and EF_BETA_AUTO are live views of it)."""
    import dataclasses
    import json

    from asyncpp_ext.optim import registry
    from asyncpp_ext.training import config
    from asyncpp_ext.training.cli import main

    flags = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "16", "--no-progress",
             "--optimizer", "muon", "--eval-every", "0", "--ckpt-every", "2"]
    assert main(flags + ["--steps", "4", "--out", str(tmp_path / "full")]) == 0
    assert main(flags + ["--steps", "2", "--out", str(tmp_path / "part")]) == 0
    saved = json.loads((tmp_path / "part" / "config.json").read_text())["optim"]
    assert (saved["lr"], saved["adamw_lr"], saved["ef_beta"]) == (
        config.LR_AUTO["muon"], config.MUON_ADAMW_LR_AUTO, config.EF_BETA_AUTO["muon"])
    monkeypatch.setitem(registry.OPTIMIZERS, "muon",
                        dataclasses.replace(registry.OPTIMIZERS["muon"], ef_beta=0.9, lr=0.05, adamw_lr=1e-2))
    assert (config.LR_AUTO["muon"], config.EF_BETA_AUTO["muon"]) == (0.05, 0.9)  # the patch is seen
    assert config.OptimConfig(name="muon").effective_adamw_lr() == 1e-2
    assert main(["--resume", str(tmp_path / "part"), "--steps", "4", "--no-progress"]) == 0

    def losses(run):
        return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert losses("part") == losses("full")  # bitwise: the same numbers drove both
