"""Learning-rate schedules (asyncpp_ext.optim.lr_schedule): the multiplier of every step against
an independent float64 formula, the shape of each phase, apply_lr on every optimizer the trainer
builds, its checkpoint round trip, and the one-line errors of validate()."""
import copy
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from asyncpp_ext.optim import AdamW, ErrorFeedback, Muon, MuonHybrid
from asyncpp_ext.optim.state import (load_optimizer_state_by_name, optimizer_state_by_name,
                                     regroup_optimizer_state)
from asyncpp_ext.optim.lr_schedule import LR_SCHEDULES, LRSchedule, LRScheduleError, apply_lr

# (steps T, warmup W, wsd decay D or None, min_lr_ratio r): W = 0, W = T, D = T - W, D = 1, r = 0 / 1.
COMBOS = [
    (1, 0, None, 0.1),
    (1, 1, None, 0.1),
    (10, 0, None, 0.1),
    (10, 3, 7, 0.0),
    (10, 10, None, 0.5),
    (37, 5, 1, 0.25),
    (37, 0, 37, 1.0),
    (200, 20, None, 0.1),
    (1000, 100, 250, 0.03),
]


def reference_multipliers(kind, T, W, D, r):
    """The closed forms, vectorised over all steps in float64 and written from the definitions."""
    t = np.arange(T, dtype=np.float64)
    T, W, r = np.float64(T), np.float64(W), np.float64(r)
    warm = (t + 1) / W if W > 0 else np.ones_like(t)
    if kind == "constant":
        after = np.ones_like(t)
    elif kind == "cosine":
        angles = np.pi * (t - W) / max(T - W, 1)
        # The module calls math.cos (libm); numpy's own cos may take a SIMD path that can differ
        # in the last bit on some CPUs, so the cosine itself is taken from the same libm.
        cos = np.array([math.cos(a) for a in angles])
        after = r + (1 - r) * 0.5 * (1 + cos)
    else:
        D = np.float64(D)
        after = np.where(t < T - D, 1.0, r + (1 - r) * (T - 1 - t) / max(D, 1))
    return np.where(t < W, warm, after)


def schedules():
    for kind in LR_SCHEDULES:
        for T, W, D, r in COMBOS:
            yield LRSchedule(kind, T, W, D if kind == "wsd" else None, r)


@pytest.mark.parametrize("sched", list(schedules()), ids=str)
def test_multiplier_equals_closed_form_at_every_step(sched):
    sched.validate()
    got = np.array(sched.multipliers())
    D = sched.effective_decay_steps
    want = reference_multipliers(sched.kind, sched.steps, sched.warmup_steps, D, sched.min_lr_ratio)
    assert got.dtype == np.float64 and got.shape == (sched.steps,)
    mismatch = np.flatnonzero(got != want)
    assert mismatch.size == 0, f"steps {mismatch[:5]}: {got[mismatch[:5]]} vs {want[mismatch[:5]]}"
    assert all(type(sched.multiplier(t)) is float for t in range(sched.steps))


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_warmup_rises_linearly_to_one(kind):
    sched = LRSchedule(kind, steps=50, warmup_steps=8)
    warm = [sched.multiplier(t) for t in range(8)]
    assert warm[0] == 1 / 8 and warm[-1] == 1.0
    assert all(b > a for a, b in zip(warm, warm[1:]))
    assert np.allclose(np.diff(warm), 1 / 8, rtol=0, atol=1e-15)


@pytest.mark.parametrize("r", [0.0, 0.1, 0.3, 1 / 3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("W", [0, 1, 7])
def test_cosine_peaks_at_one_then_decays_towards_r(W, r):
    sched = LRSchedule("cosine", steps=40, warmup_steps=W, min_lr_ratio=r)
    m = sched.multipliers()
    assert m[W] == 1.0
    after = m[W:]
    if r < 1:
        assert all(b < a for a, b in zip(after, after[1:]))
        # one step short of the end of the curve: the last update runs just above r
        assert m[-1] == pytest.approx(r + (1 - r) * 0.5 * (1 - math.cos(math.pi / (40 - W))), abs=1e-15)
        assert m[-1] > r
    else:
        assert after == [1.0] * len(after)


@pytest.mark.parametrize("T,W,D", [(100, 10, 20), (100, 0, 100), (100, 10, 90), (30, 5, 1)])
@pytest.mark.parametrize("r", [0.0, 0.1, 0.7])
def test_wsd_stable_region_is_exactly_one_and_decay_ends_at_r(T, W, D, r):
    m = LRSchedule("wsd", T, W, D, r).multipliers()
    assert m[W:T - D] == [1.0] * (T - D - W)
    decay = m[T - D:]
    assert len(decay) == D and m[-1] == r
    assert all(x < 1.0 for x in decay) and all(b < a for a, b in zip(decay, decay[1:]))


@pytest.mark.parametrize("shape", ["1-sqrt", "cosine"])
@pytest.mark.parametrize("kind", ["wsd", "linear"])
def test_decay_shapes_equal_their_closed_forms(kind, shape):
    """--decay-shape: r + (1 - r) f(p) over the decay, p = (t - (T - D) + 1) / D its progress,
    f = 1 - sqrt(p) or (1 + cos(pi p)) / 2; warmup and stable phase as the linear decay's."""
    for T, W, D, r in COMBOS:
        sched = LRSchedule(kind, T, W, D if kind == "wsd" else None, r, decay_shape=shape)
        D = sched.effective_decay_steps
        linear = reference_multipliers(kind, T, W, D, r)
        want = []
        for t in range(T):
            if t < W or t < T - D:
                want.append(linear[t])
                continue
            p = (t - (T - D) + 1) / D
            f = 1 - math.sqrt(p) if shape == "1-sqrt" else 0.5 * (1 + math.cos(math.pi * p))
            want.append(r + (1 - r) * f)
        assert sched.multipliers() == want, (T, W, D, r)
        if T - W > 0:
            assert sched.multipliers()[-1] == pytest.approx(r, abs=1e-15)


def test_one_minus_sqrt_decays_below_linear_and_cosine_above_it_early():
    lin, sqrt_, cos_ = (LRSchedule("wsd", 100, 10, 40, 0.1, decay_shape=s).multipliers()
                        for s in ("linear", "1-sqrt", "cosine"))
    assert lin[:60] == sqrt_[:60] == cos_[:60]  # warmup and the stable phase
    assert all(s < x < 1.0 for s, x in zip(sqrt_[60:-1], lin[60:-1]))
    assert all(c > x for c, x in zip(cos_[60:79], lin[60:79])) and lin[-1] == sqrt_[-1] == 0.1
    assert all(b < a for a, b in zip(sqrt_[60:], sqrt_[61:]))


def test_linear_is_wsd_decaying_over_everything_after_warmup():
    assert LRSchedule("linear", 50, 5, None, 0.2).multipliers() == LRSchedule("wsd", 50, 5, 45, 0.2).multipliers()
    assert LRSchedule("linear", 50, 5).effective_decay_steps == 45


def test_wsd_default_decay_is_a_fifth_of_the_run_within_what_warmup_leaves():
    assert LRSchedule("wsd", 200).effective_decay_steps == 40
    assert LRSchedule("wsd", 3).effective_decay_steps == 1
    assert LRSchedule("wsd", 10, warmup_steps=9).effective_decay_steps == 1
    assert LRSchedule("wsd", 10, warmup_steps=10).effective_decay_steps == 0
    assert LRSchedule("wsd", 10, warmup_steps=10).multipliers() == [(t + 1) / 10 for t in range(10)]
    m = LRSchedule("wsd", 200, warmup_steps=10).multipliers()
    assert m[159] == 1.0 and m[160] < 1.0 and m[199] == 0.1


def test_default_min_lr_ratio_and_constant_schedule():
    assert LRSchedule("cosine", 10).min_lr_ratio == 0.1
    assert LRSchedule("cosine", 10).multiplier(np.int64(3)) == LRSchedule("cosine", 10).multiplier(3)
    assert LRSchedule("constant", 10, warmup_steps=2).multipliers() == [0.5] + [1.0] * 9


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(kind="step", steps=10), "kind 'step' is not one of constant, cosine, wsd, linear"),
    (dict(kind="cosine", steps=0), "steps must be a positive integer"),
    (dict(kind="cosine", steps=10, decay_shape="1-sqrt"), "decay_shape 1-sqrt shapes the decay of kind wsd or linear"),
    (dict(kind="wsd", steps=10, decay_shape="sqrt"), "decay_shape 'sqrt' is not one of linear, 1-sqrt, cosine"),
    (dict(kind="linear", steps=10, decay_steps=3), "decay_steps only applies to kind wsd"),
    (dict(kind="cosine", steps=10, warmup_steps=-1), "warmup_steps must be a non-negative integer"),
    (dict(kind="cosine", steps=10, warmup_steps=11), "warmup_steps 11 exceeds steps 10"),
    (dict(kind="cosine", steps=10, warmup_steps=2.5), "warmup_steps must be a non-negative integer"),
    (dict(kind="cosine", steps=10, decay_steps=3), "decay_steps only applies to kind wsd"),
    (dict(kind="constant", steps=10, decay_steps=3), "decay_steps only applies to kind wsd"),
    (dict(kind="wsd", steps=10, decay_steps=0), "decay_steps must be an integer in 1..10"),
    (dict(kind="wsd", steps=10, decay_steps=-2), "decay_steps must be an integer in 1..10"),
    (dict(kind="wsd", steps=10, warmup_steps=4, decay_steps=7), "decay_steps must be an integer in 1..6"),
    (dict(kind="wsd", steps=10, min_lr_ratio=-0.1), "min_lr_ratio must be a number in [0, 1]"),
    (dict(kind="wsd", steps=10, min_lr_ratio=1.5), "min_lr_ratio must be a number in [0, 1]"),
    (dict(kind="cosine", steps=10, min_lr_ratio=float("nan")), "min_lr_ratio must be a number in [0, 1]"),
])
def test_validate_names_the_field_in_one_line(kwargs, fragment):
    sched = LRSchedule(**kwargs)
    with pytest.raises(LRScheduleError) as info:
        sched.validate()
    message = str(info.value)
    assert fragment in message and "\n" not in message and "--" not in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(LRScheduleError):  # multiplier never computes from a bad schedule
        sched.multiplier(0)
    with pytest.raises(LRScheduleError):  # nor multipliers, which for steps <= 0 would be an empty list
        sched.multipliers()


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(kind="cosine", steps=10, warmup_steps=11), "--warmup-steps 11 exceeds --steps 10"),
    (dict(kind="cosine", steps=10, decay_steps=3),
     "--decay-steps only applies to --lr-schedule wsd, not 'cosine'; drop --decay-steps or use --lr-schedule wsd"),
    (dict(kind="wsd", steps=10, warmup_steps=4, decay_steps=7),
     "--decay-steps must be an integer in 1..6 (--steps 10 minus --warmup-steps 4), got 7"),
])
def test_a_command_line_names_its_flags(kwargs, fragment):
    """The run config validates its schedule with the flags' names (what asyncpp-train prints)."""
    from asyncpp_ext.training.config import LR_SCHEDULE_FLAGS

    with pytest.raises(LRScheduleError, match=re.escape(fragment)):
        LRSchedule(**kwargs).validate(LR_SCHEDULE_FLAGS)


def test_edge_settings_validate():
    for sched in (LRSchedule("wsd", 10, 4, 6), LRSchedule("cosine", 10, 10), LRSchedule("wsd", 1, 0, 1, 0.0),
                  LRSchedule("constant", 5, min_lr_ratio=1)):
        sched.validate()


@pytest.mark.parametrize("t", [-1, 10, 1.0, None])
def test_multiplier_rejects_steps_outside_the_run(t):
    with pytest.raises(LRScheduleError, match=r"outside the schedule's steps 0\.\.9 \(steps 10\)"):
        LRSchedule("cosine", 10).multiplier(t)


# ---- apply_lr on the optimizers --------------------------------------------------------------

class TinyLM(nn.Module):
    """Embedding, two hidden matrices, a norm and a head: both MuonHybrid groups are non-empty."""

    def __init__(self, vocab=24, d=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.lm_head(self.norm(h))


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def backward(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 24, (3, 10), generator=gen)
    loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    model.zero_grad(set_to_none=True)
    loss.backward()


def matrices(model):
    return [(n, p) for n, p in model.named_parameters() if n in ("up.weight", "down.weight")]


# name -> (bases per group, builder(model, lr_scale) -> optimizer whose group g has lr bases[g]*scale)
BUILDERS = {
    "adamw": ((1e-3,), lambda m, s: AdamW(list(m.named_parameters()), lr=1e-3 * s, weight_decay=0.1)),
    "adamw_ef": ((2e-3,), lambda m, s: AdamW(list(m.named_parameters()), lr=2e-3 * s, ef_beta=0.5)),
    "muon": ((0.02,), lambda m, s: Muon(matrices(m), lr=0.02 * s, weight_decay=0.1)),
    "muon_hybrid": ((0.02, 3e-3), lambda m, s: MuonHybrid(m, lr=0.02 * s, adamw_lr=3e-3 * s,
                                                            weight_decay=0.1)),
    "muon_hybrid_ef": ((0.02, 3e-3), lambda m, s: MuonHybrid(m, lr=0.02 * s, adamw_lr=3e-3 * s,
                                                               weight_decay=0.1, ef_beta=0.5)),
    "sgd": ((0.05,), lambda m, s: torch.optim.SGD(m.parameters(), lr=0.05 * s, momentum=0.9)),
    "sgd_error_feedback": ((0.05,), lambda m, s: ErrorFeedback(
        torch.optim.SGD(m.parameters(), lr=0.05 * s, momentum=0.9), 0.5)),
}


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise_equal(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_apply_lr_scales_every_group_and_steps_like_a_fresh_optimizer(name):
    bases, build = BUILDERS[name]
    m = LRSchedule("cosine", 100, warmup_steps=10).multiplier(37)
    model = make_model()
    opt = build(model, 1.0)
    assert len(opt.param_groups) == len(bases)
    lrs = apply_lr(opt, m)
    assert lrs == [b * m for b in bases] == [g["lr"] for g in opt.param_groups]
    assert [g["initial_lr"] for g in opt.param_groups] == list(bases)

    fresh_model = make_model()
    fresh = build(fresh_model, m)
    assert [g["lr"] for g in fresh.param_groups] == lrs  # same floats, built directly
    backward(model)
    backward(fresh_model)
    opt.step()
    fresh.step()
    assert_bitwise_equal(weights(model), weights(fresh_model))
    assert not torch.equal(weights(model)[1], weights(make_model())[1])  # the step did move weights


@pytest.mark.parametrize("name", list(BUILDERS))
def test_apply_lr_keeps_the_base_across_calls(name):
    bases, build = BUILDERS[name]
    opt = build(make_model(), 1.0)
    for m in (0.5, 0.01, 1.0, 0.0, 0.75):
        apply_lr(opt, m)
        assert [g["lr"] for g in opt.param_groups] == [b * m for b in bases]
        assert [g["initial_lr"] for g in opt.param_groups] == list(bases)


@pytest.mark.parametrize("name", ["adamw", "muon", "muon_hybrid", "sgd"])
def test_the_optimizer_reads_the_lr_at_step_time(name):
    # weight_decay > 0 in adamw/muon: lr 0 also switches decay off, so W must stay bit for bit.
    # (No error feedback here: its beta*(D - E) term moves W even when this step's D is 0.)
    _, build = BUILDERS[name]
    model = make_model()
    opt = build(model, 1.0)
    apply_lr(opt, 1.0)
    backward(model, seed=0)
    opt.step()
    after_first = weights(model)
    apply_lr(opt, 0.0)
    backward(model, seed=1)
    opt.step()
    assert_bitwise_equal(weights(model), after_first)
    apply_lr(opt, 1.0)
    backward(model, seed=2)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(weights(model), after_first))


def test_apply_lr_rejects_a_bad_multiplier():
    opt = BUILDERS["adamw"][1](make_model(), 1.0)
    for bad in (-0.5, float("nan"), float("inf"), True, "1"):
        with pytest.raises(LRScheduleError, match="multiplier must be a finite number >= 0"):
            apply_lr(opt, bad)
    assert opt.param_groups[0]["lr"] == 1e-3 and "initial_lr" not in opt.param_groups[0]


# ---- checkpoint round trip -------------------------------------------------------------------

def run_steps(model, opt, sched, steps, seed0=0):
    for t in steps:
        apply_lr(opt, sched.multiplier(t))
        backward(model, seed=seed0 + t)
        opt.step()


@pytest.mark.parametrize("name", ["muon_hybrid_ef", "adamw", "sgd_error_feedback"])
def test_checkpoint_round_trip_keeps_the_base_lr(name):
    bases, build = BUILDERS[name]
    sched = LRSchedule("wsd", 8, warmup_steps=2, decay_steps=4, min_lr_ratio=0.1)
    model = make_model()
    opt = build(model, 1.0)
    run_steps(model, opt, sched, range(5))
    saved = copy.deepcopy(optimizer_state_by_name(opt, model))
    assert [g["initial_lr"] for g in saved["param_groups"]] == list(bases)
    assert [g["lr"] for g in saved["param_groups"]] == [b * sched.multiplier(4) for b in bases]

    restored_model = make_model(seed=1)
    restored_model.load_state_dict(model.state_dict())
    restored = build(restored_model, 1.0)
    apply_lr(restored, 1.0)  # a fresh optimizer may already hold its own initial_lr: the load replaces it
    load_optimizer_state_by_name(restored, restored_model,
                                 regroup_optimizer_state(saved, restored, restored_model))
    assert [g["initial_lr"] for g in restored.param_groups] == list(bases)
    assert [g["lr"] for g in restored.param_groups] == [b * sched.multiplier(4) for b in bases]

    run_steps(model, opt, sched, range(5, 8))
    run_steps(restored_model, restored, sched, range(5, 8))
    assert [g["lr"] for g in restored.param_groups] == [b * 0.1 for b in bases]
    assert_bitwise_equal(weights(restored_model), weights(model))


def test_checkpoint_without_initial_lr_takes_its_lr_as_the_base():
    # A checkpoint written before schedules existed holds the constant base lr and no initial_lr.
    bases, build = BUILDERS["muon_hybrid"]
    model = make_model()
    opt = build(model, 1.0)
    backward(model)
    opt.step()
    saved = optimizer_state_by_name(opt, model)
    assert all("initial_lr" not in g for g in saved["param_groups"])
    restored = build(model, 1.0)
    load_optimizer_state_by_name(restored, model, saved)
    assert apply_lr(restored, 0.5) == [b * 0.5 for b in bases]


class Part:
    """The parameters of a pipeline stage: a subset of the model under their global names."""

    def __init__(self, model, names):
        self.named = [(n, p) for n, p in model.named_parameters() if n in names]

    def named_parameters(self):
        return iter(self.named)


def test_regrouped_into_another_split_keeps_each_groups_base():
    _, build = BUILDERS["muon_hybrid"]
    sched = LRSchedule("cosine", 6, warmup_steps=1)
    model = make_model()
    opt = build(model, 1.0)
    run_steps(model, opt, sched, range(3))
    saved = optimizer_state_by_name(opt, model)
    first = Part(model, {"embed.weight", "up.weight", "up.bias"})
    second = Part(model, {n for n, _ in model.named_parameters()} - {n for n, _ in first.named})
    for part in (first, second):
        stage_opt = MuonHybrid(part.named, lr=0.02, adamw_lr=3e-3)
        load_optimizer_state_by_name(stage_opt, part, regroup_optimizer_state(saved, stage_opt, part))
        assert [g["initial_lr"] for g in stage_opt.param_groups] == [0.02, 3e-3]
        assert apply_lr(stage_opt, sched.multiplier(3)) == [0.02 * sched.multiplier(3),
                                                            3e-3 * sched.multiplier(3)]


def test_a_runs_lr_follows_its_decay_shape(tmp_path, capsys):
    import json

    from asyncpp_ext.training.cli import main as train

    flags = ["--model", "tiny", "--seq-len", "16", "--micro-batch-size", "2", "--steps", "10", "--eval-every", "0",
             "--no-checkpoints", "--no-progress", "--threads", "1", "--simulate", "--lr", "0.01"]
    run = tmp_path / "run"
    assert train([*flags, "--lr-schedule", "wsd", "--decay-steps", "4", "--decay-shape", "1-sqrt",
                  "--out", str(run)]) == 0
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    want = LRSchedule("wsd", 10, 0, 4, 0.1, decay_shape="1-sqrt").multipliers()
    assert lrs == pytest.approx([0.01 * m for m in want], rel=1e-12)
    assert train([*flags, "--decay-shape", "cosine", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--decay-shape cosine shapes the decay of --lr-schedule wsd or linear" in err[0], err
    assert not (tmp_path / "bad").exists()
