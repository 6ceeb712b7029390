"""``--data-seed N``: the batch order's own seed, so that init and data order vary apart; without it
``--seed`` seeds both, as before, and a resume compares the order's seed as it is."""
import json

import torch

from asyncpp_ext.training.build import build_data
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config import RunConfig
from asyncpp_ext.models.registry import build_model

COMMON = ["--model", "tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--steps", "2", "--eval-every", "0", "--simulate", "--ckpt-every", "1"]


def _cfg(run):
    return RunConfig.from_dict(json.loads((run / "config.json").read_text()))


def _first_batch(run):
    return build_data(_cfg(run))[0].minibatch(0)[0][0]


def test_the_order_and_the_init_vary_apart(tmp_path):
    runs = {}
    for name, flags in (("base", ["--seed", "0"]), ("order", ["--seed", "0", "--data-seed", "7"]),
                        ("init", ["--seed", "5", "--data-seed", "0"])):
        runs[name] = tmp_path / name
        assert train([*COMMON, *flags, "--out", str(runs[name])]) == 0
    assert not torch.equal(_first_batch(runs["order"]), _first_batch(runs["base"]))
    assert torch.equal(_first_batch(runs["init"]), _first_batch(runs["base"]))
    inits = {name: dict(build_model(_cfg(run).model, seed=_cfg(run).train.seed).named_parameters())["embed.tok.weight"]
             for name, run in runs.items()}
    assert torch.equal(inits["order"], inits["base"]) and not torch.equal(inits["init"], inits["base"])
    assert _cfg(runs["base"]).data.seed is None and _cfg(runs["base"]).data_seed() == 0


def test_a_resume_compares_the_orders_seed(tmp_path, capsys):
    run = tmp_path / "run"
    assert train([*COMMON, "--seed", "3", "--out", str(run)]) == 0
    assert train(["--resume", str(run), "--steps", "3", "--data-seed", "3", "--no-progress"]) == 0  # the same order
    capsys.readouterr()
    assert train(["--resume", str(run), "--steps", "4", "--data-seed", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.seed" in err[0], err


def test_a_bad_data_seed_is_one_line(tmp_path, capsys):
    assert train([*COMMON, "--data-seed", "-1", "--out", str(tmp_path / "r")]) == 2
    assert "data.seed must be a non-negative integer, got -1" in capsys.readouterr().err
