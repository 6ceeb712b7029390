"""The analytical model of asyncpp_ext.schedule.analytic against the C++ simulator (our schedules)
and against torch's own action orders (the peers' published formulas)."""
import itertools

import pytest

from asyncpp_ext import schedule as sc
from asyncpp_ext.schedule import analytic as an

COSTS = [(1.0, 2.0, 0.0), (1.0, 1.0, 0.0), (2.0, 3.0, 0.5), (1.0, 2.0, 3.0)]  # (fwd, bwd, opt)


def _shapes(schedule):
    for S, m, K in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16), (1, 2, 5)):
        if schedule == "pipedream":
            m = 1
        if schedule == "2bw" and m < S:
            continue
        yield S, m, K


@pytest.mark.parametrize("schedule", an.OURS)
def test_bubble_formulas_equal_the_simulator(schedule):
    checked = 0
    for (S, m, K), (f, b, o) in itertools.product(set(_shapes(schedule)), COSTS):
        sim = sc.simulate(schedule, stages=S, microbatches=m, steps=K, fwd=f, bwd=b, opt=o)
        assert an.makespan(schedule, S, m, K, fwd=f, bwd=b, opt=o) == pytest.approx(sim.makespan, rel=1e-12)
        assert an.bubble_fraction(schedule, S, m, K, fwd=f, bwd=b, opt=o) == pytest.approx(
            sim.bubble_fraction, abs=1e-12), (schedule, S, m, K, f, b, o)
        checked += 1
    assert checked > 50


def test_the_paper_rate_and_the_fraction_are_one_bubble_in_two_units():
    for S, m in [(2, 2), (4, 8), (8, 32)]:
        assert an.bubble_rate("1f1b", S, m) == pytest.approx((S - 1) / m)
        assert an.bubble_fraction("gpipe", S, m) == pytest.approx((S - 1) / (m + S - 1))
        assert an.steady_bubble_fraction("1f1b", S, m) == pytest.approx((S - 1) / (m + S - 1))
        assert an.steady_bubble_fraction("2bw", S, max(m, S)) == 0.0
        # a K-step 2bw stream fills and drains once
        assert an.bubble_fraction("2bw", S, max(m, S), 10) == pytest.approx((S - 1) / (10 * max(m, S) + S - 1))
        assert an.PEER_FORMULAS["1f1b"].rate(S, m) == pytest.approx(an.bubble_rate("1f1b", S, m))


@pytest.mark.parametrize("schedule", an.OURS)
def test_in_flight_and_versions_equal_the_simulator(schedule):
    for S, m in [(2, 2), (3, 5), (4, 8), (8, 8)]:
        m = 1 if schedule == "pipedream" else m
        K = 2 * S  # long enough for pipedream to reach S - s versions
        sim = sc.simulate(schedule, stages=S, microbatches=m, steps=K)
        for s in range(S):
            inflight = an.activations_in_flight(schedule, s, S, m)
            versions = an.weight_versions(schedule, s, S)
            assert inflight == sim.peak_inflight[s], (schedule, S, m, s)
            assert versions == sim.max_versions[s], (schedule, S, m, s)
        mem = an.memory_per_stage(schedule, 0, S, m, params=10.0, activation=3.0)
        assert mem["total"] == pytest.approx(mem["weight_versions"] * 10 + 10 + 20 + mem["in_flight"] * 3)


@pytest.mark.parametrize("schedule", an.OURS)
def test_the_action_simulator_equals_the_engine_on_our_programs(schedule):
    for (S, m, K), (f, b, o) in itertools.product([(2, 2, 1), (4, 8, 3), (3, 5, 2), (8, 8, 2)], COSTS):
        m = 1 if schedule == "pipedream" else m
        built = sc.build(schedule, S, m, K)
        sim = sc.simulate(built, fwd=f, bwd=b, opt=o)
        res = an.simulate_actions(an.orders_of_program(built), {s: s for s in range(S)}, {"F": f, "B": b, "O": o})
        assert res.makespan == pytest.approx(sim.makespan)
        assert res.bubble_fraction == pytest.approx(sim.bubble_fraction)
        assert [int(x) for x in res.peak_inflight] == sim.peak_inflight


def test_the_action_simulator_reports_a_deadlock():
    with pytest.raises(ValueError, match="deadlock"):
        an.simulate_actions({0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}, {0: 0, 1: 1},
                            {"F": 1, "B": 2})


def test_ours_without_a_closed_form_are_refused_by_name():
    with pytest.raises(ValueError, match="no closed form"):
        an.makespan("zbv", 4, 8)
    with pytest.raises(ValueError):
        an.makespan("2bw", 4, 2)  # 2bw needs m >= S: the table's own rule


def test_zero_costs_have_no_bubble_and_misspelled_names_are_refused():
    assert an.bubble_fraction("gpipe", 2, 2, fwd=0, bwd=0) == 0.0 == sc.simulate(
        "gpipe", stages=2, microbatches=2, fwd=0, bwd=0).bubble_fraction
    assert an.PEER_FORMULAS["1f1b"].rate(2, 2, 0, 0, 0) == 0.0
    with pytest.raises(ValueError, match="unknown schedule '2BW'"):
        an.weight_versions("2BW", 0, 4)
    assert an.weight_versions("zb-h1", 0, 4) == 1  # a synchronous peer keeps one version
    with pytest.raises(ValueError, match="steps=5 contradicts the schedule's steps=1"):
        sc.simulate(sc.build("2bw", 2, 2, 1), steps=5)


def _torch_orders(name, S, m):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import peer_schedules

    return peer_schedules.torch_orders(name, S, m)


@pytest.mark.parametrize("S,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_published_peer_formulas_against_torchs_own_orders(S, m):
    """At F = B = W, one step of torch's orders: 1F1B's (p-1)/m and interleaving's (p-1)/(2m) hold
    exactly; torch's zero-bubble orders (m >= 2S) keep p-1 chunk-forwards of fill per rank, (p-1)/(6m),
    not the papers' 0, which counts a step as the overlapping parallelogram of steady training."""
    pytest.importorskip("torch.distributed.pipelining")
    cost = {"F": 0.5, "I": 0.5, "W": 0.5, "B": 1.0}

    def rate(name, chunks):
        orders, stage_to_rank = _torch_orders(name, S, m)
        scaled = {k: v * 2 / chunks for k, v in cost.items()}
        res = an.simulate_actions(orders, stage_to_rank, scaled, chunks=chunks)
        return res.bubble_fraction / (1 - res.bubble_fraction), res

    assert rate("1F1B", 1)[0] == pytest.approx(an.PEER_FORMULAS["1f1b"].rate(S, m))
    assert rate("GPipe", 1)[0] == pytest.approx(an.PEER_FORMULAS["gpipe"].rate(S, m))
    r, res = rate("Interleaved1F1B", 2)
    assert r == pytest.approx(an.PEER_FORMULAS["interleaved-1f1b"].rate(S, m))
    for name in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        r, res = rate(name, 2)
        assert r == pytest.approx((S - 1) / (6 * m))
        assert r < an.PEER_FORMULAS["zb-h1"].rate(S, m)  # two chunks beat one-chunk ZB-H1's (p-1)/(3m)
        assert max(res.peak_inflight) == pytest.approx(S)  # 1F1B's activations on the first rank
