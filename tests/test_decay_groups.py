"""``--no-decay-norms-and-biases`` / ``--no-decay-embeddings`` (optim/decay.py): the parameters they
name take no weight decay in every optimizer family, everything else decays as before, and a
pipeline with them trains as its simulation does."""
import json

import pytest
import torch

from asyncpp_ext.models.registry import MODEL_PRESETS, build_model
from asyncpp_ext.optim import build_optimizer
from asyncpp_ext.optim.decay import undecayed_names
from asyncpp_ext.training.cli import main as train

GPT_NORMS_AND_BIASES = {n for n, p in build_model(MODEL_PRESETS["tiny"]).named_parameters() if p.ndim < 2}
FAMILIES = ["adamw", "muon", "normuon", "sgd", "lion", "mars"]


def _needs(name):
    if name in ("lion", "mars"):
        pytest.importorskip("pytorch_optimizer", reason=f"{name} needs the study extra (pytorch-optimizer)")


def test_what_each_switch_names():
    gpt, llama = build_model(MODEL_PRESETS["tiny"]), build_model(MODEL_PRESETS["llama-tiny"])
    assert undecayed_names(gpt) == set()
    assert undecayed_names(gpt, decay_embeddings=False) == {"embed.tok.weight", "embed.pos.weight"}
    assert undecayed_names(gpt, decay_norms_and_biases=False) == GPT_NORMS_AND_BIASES
    assert "layers.0.attn.qkv.bias" in GPT_NORMS_AND_BIASES and "head.ln.weight" in GPT_NORMS_AND_BIASES
    # llama-tiny's head is tied to the embedding: one tensor, named once, undecayed with it
    assert undecayed_names(llama, decay_embeddings=False) == {"embed.tok.weight"}
    assert "head.proj.weight" not in undecayed_names(gpt, False, False)  # an untied head is a matrix


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("switch", ["decay_norms_and_biases", "decay_embeddings"])
def test_a_step_with_zero_gradients_decays_exactly_the_others(name, switch):
    """With every gradient 0 a step only decays: what it leaves alone must stay bit for bit."""
    _needs(name)
    model = build_model(MODEL_PRESETS["tiny"], seed=0)
    with torch.no_grad():  # biases start at 0, which decay leaves at 0
        for p in model.parameters():
            p.uniform_(0.5, 1.0)
    opt = build_optimizer(model, name, lr=0.1, weight_decay=0.5, ef_beta=0.0, **{switch: False})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    skipped = undecayed_names(model, **{switch: False})
    assert skipped
    for n, p in model.named_parameters():
        if n in skipped:
            assert torch.equal(p, before[n]), f"{n} was decayed"
        elif name != "mars" or p.ndim == 2:  # MARS's 1-D AdamW takes no step without a gradient
            assert not torch.equal(p, before[n]), f"{n} was not decayed"


def test_by_default_every_parameter_decays_in_one_group_as_before():
    model = build_model(MODEL_PRESETS["tiny"], seed=0)
    opt = build_optimizer(model, "adamw", lr=0.1, weight_decay=0.5)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.5
    hybrid = build_optimizer(model, "muon", weight_decay=0.5, decay_norms_and_biases=False)
    undecayed = {n for g in hybrid.param_groups if g["weight_decay"] == 0 for n in g["param_names"]}
    assert undecayed == GPT_NORMS_AND_BIASES
    assert [g["algorithm"] for g in hybrid.param_groups] == ["muon", "adamw", "adamw"]


def test_a_switch_that_is_not_a_bool_is_refused():
    with pytest.raises(ValueError, match="decay_embeddings must be True or False, got 'no'"):
        build_optimizer(build_model(MODEL_PRESETS["tiny"]), "adamw", decay_embeddings="no")


COMMON = ["--model", "llama-tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--eval-every", "0", "--weight-decay", "0.5", "--optimizer", "muon"]
SWITCHES = ["--no-decay-norms-and-biases", "--no-decay-embeddings"]


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_pipeline_with_a_tied_embedding_trains_as_its_simulation_and_resumes_only_alike(tmp_path, capsys):
    sim, real, plain = tmp_path / "sim", tmp_path / "real", tmp_path / "plain"
    assert train([*COMMON, *SWITCHES, "--simulate", "--steps", "6", "--out", str(sim)]) == 0
    assert train([*COMMON, *SWITCHES, "--stages", "2", "--timeout", "30", "--steps", "6", "--ckpt-every", "3",
                  "--out", str(real)]) == 0
    assert _losses(real) == _losses(sim)
    assert train([*COMMON, "--simulate", "--steps", "6", "--out", str(plain)]) == 0
    assert _losses(plain) != _losses(sim)
    half = tmp_path / "half"
    assert train([*COMMON, *SWITCHES, "--stages", "2", "--timeout", "30", "--steps", "3", "--ckpt-every", "3",
                  "--out", str(half)]) == 0
    capsys.readouterr()
    assert train(["--resume", str(half), "--decay-embeddings", "--steps", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decay_embeddings" in err[0], err
    assert train(["--resume", str(half), "--steps", "6", "--no-progress"]) == 0
    assert _losses(half) == _losses(sim)
