"""asyncpp-train's optimizer and mitigation flags: every bad value or combination ends with one line
``asyncpp-train: error: --flag: ...`` on stderr and exit code 2, before any run starts; good
values reach config.json pinned."""
import json
import sys

import pytest

from asyncpp_ext.training.cli import main
from asyncpp_ext.training.config import ConfigError, RunConfig

PIPEDREAM = ["--schedule", "pipedream", "--microbatches", "1", "--stages", "2"]


@pytest.mark.parametrize("argv,words", [
    (["--optimizer", "adamax"], ["--optimizer", "'adamax'", "adamw", "muon", "sgd"]),
    (["--mitigation", "dcasgd"], ["--mitigation", "'dcasgd'", "none, ef, predict, dc, lr-rescale"]),
    (["--ef-beta", "-0.5"], ["--ef-beta", "-0.5"]),
    (["--ef-beta", "nan"], ["--ef-beta", "nan"]),
    (["--ef-beta", "2.5"], ["--ef-beta", "at most 2"]),
    (["--ef-source", "ring"], ["--ef-source", "buffer, weights"]),
    (["--ef-source", "weights", "--schedule", "sync"], ["--ef-source", "--schedule sync", "2bw"]),
    (["--ef-source", "weights", "--schedule", "1f1b", "--simulate"], ["--ef-source", "--schedule 1f1b"]),
    (["--ef-source", "weights", "--ef-beta", "0"], ["--ef-source", "--ef-beta"]),
    (["--ef-source", "weights", "--schedule", "pipedream", "--microbatches", "1"],  # one stage: no delay
     ["--ef-source", "--schedule pipedream at --stages 1 keeps one version"]),
    (["--mitigation", "predict", "--stages", "2"], ["--mitigation", "'predict'", "--simulate"]),
    (["--mitigation", "dc", "--ef-beta", "0.5"], ["--mitigation", "--ef-beta 0.5"]),
    (["--mitigation", "ef", "--optimizer", "sgd"], ["--mitigation", "--ef-beta"]),
    (["--mitigation", "lr-rescale", "--simulate"] + PIPEDREAM, ["--mitigation", "pipedream", "without --simulate"]),
    (["--mitigation", "dc", "--dc-lambda", "-1"], ["--dc-lambda", ">= 0"]),
    (["--dc-lambda", "0.1"], ["--dc-lambda", "--mitigation dc"]),
    (["--mitigation", "lr-rescale", "--rescale-steps", "0"], ["--rescale-steps", "positive"]),
    (["--rescale-steps", "5"], ["--rescale-steps", "--mitigation lr-rescale"]),
    (["--optimizer", "muon", "--muon-momentum", "1"], ["--muon-momentum", "[0, 1)"]),
    (["--muon-momentum", "0.9"], ["--muon-momentum", "'adamw'"]),
])
def test_bad_inputs_are_one_line_naming_the_flag(tmp_path, capsys, argv, words):
    out = tmp_path / "out"
    assert main(argv + ["--out", str(out), "--no-progress", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"asyncpp-train: error: {words[0]}: "), err
    for word in words[1:]:
        assert word in err, err
    assert not out.exists()


def test_a_library_optimizer_without_its_extra_is_one_line(tmp_path, capsys, monkeypatch):
    library = pytest.importorskip("asyncpp_ext.optim.library")
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import fails as if not installed
    name = next(iter(library.LIBRARY_OPTIMIZERS))
    assert main(["--optimizer", name, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncpp-train: error: --optimizer: "), err
    assert "pip install 'asyncpp_ext[study]'" in err


@pytest.mark.parametrize("argv,pinned", [
    ([], dict(mitigation="ef", ef_beta=0.5, ef_source="buffer", rescale_steps=None)),
    (["--optimizer", "sgd"], dict(mitigation="none", ef_beta=0.0)),
    (["--mitigation", "dc"], dict(mitigation="dc", ef_beta=0.0, dc_lambda=0.04)),
    (["--mitigation", "lr-rescale"], dict(mitigation="lr-rescale", ef_beta=0.0, rescale_steps=1)),
    (["--ef-source", "weights"], dict(mitigation="ef", ef_beta=0.5, ef_source="weights")),
    (["--optimizer", "muon", "--muon-momentum", "0.9"], dict(muon_momentum=0.9, mitigation="ef")),
])
def test_good_values_are_pinned_in_the_run_config(tmp_path, argv, pinned, monkeypatch):
    from asyncpp_ext.training import run

    built = []
    monkeypatch.setattr(run, "_train_single_process", lambda cfg, resume, started_at: built.append(cfg) or 0)
    assert main(argv + ["--simulate", "--steps", "3", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    optim = built[0].optim
    assert {k: getattr(optim, k) for k in pinned} == pinned


def test_the_optimizer_factory_gets_the_muon_momentum_and_ef_source(monkeypatch):
    from asyncpp_ext.training import build

    calls = []
    monkeypatch.setattr(build, "build_optimizer", lambda module, name, lr, **kw: calls.append((name, kw)))
    cfg = RunConfig()
    cfg.optim.name, cfg.optim.muon_momentum, cfg.optim.ef_source = "muon", 0.9, "weights"
    build.optimizer_factory(cfg)(None)
    cfg = RunConfig()  # adamw: no muon momentum; the default source
    build.optimizer_factory(cfg)(None)
    assert calls[0][1]["momentum"] == 0.9 and calls[0][1]["ef_source"] == "weights"
    assert "momentum" not in calls[1][1] and calls[1][1]["ef_source"] == "buffer"


def test_config_round_trip_and_the_explicit_conflict():
    cfg = RunConfig()
    cfg.optim.mitigation, cfg.optim.rescale_steps = "lr-rescale", 7
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.mitigation_kwargs() == dict(mitigation="lr-rescale", dc_lambda=0.04, rescale_steps=7)
    cfg.optim.ef_beta = 0.25
    with pytest.raises(ConfigError, match="optim.mitigation='lr-rescale'.*--ef-beta 0.25"):
        cfg.validate()
