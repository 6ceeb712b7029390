"""Schedule engine: bubble fractions, memory (in-flight microbatches, weight versions), the
validator on every generated schedule and on hand-broken ones, and the simulator's timing model
(pipedream-specific checks: test_schedule_pipedream.py)."""
import copy
import itertools
import json
import random
import re

import pytest

from asyncpp_ext.schedule import engine as sc

Op = sc.Op
SIZES = [(S, m, K) for S in range(1, 7) for m in range(1, 11) for K in (1, 2, 3)]
INSTR = re.compile(r"stage (\d+), instruction #(\d+) (\w+) \(step (\d+), mb (\d+)\)")


KINDS = ["gpipe", "1f1b", "2bw", "pipedream"]


def _sizes(kind):
    """SIZES the kind can build: 2bw needs m >= S, pipedream m = 1."""
    return [(S, m, K) for S, m, K in SIZES
            if (kind != "2bw" or m >= S) and (kind != "pipedream" or m == 1)]


# ---- bubble fraction --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("fwd,bwd", [(1.0, 2.0), (0.5, 1.25)])
def test_sync_bubble_is_stages_minus_one_over_m_plus_stages_minus_one(kind, fwd, bwd):
    for S, m in itertools.product(range(1, 9), range(1, 17)):
        res = sc.simulate(kind, stages=S, microbatches=m, fwd=fwd, bwd=bwd)
        assert res.bubble_fraction == pytest.approx((S - 1) / (m + S - 1), abs=1e-12), (S, m)
        assert res.makespan == pytest.approx((m + S - 1) * (fwd + bwd), abs=1e-12)


def test_2bw_bubble_is_only_start_up_and_drain_and_shrinks_with_steps():
    S, m = 4, 8
    bubbles = []
    for K in (1, 10, 100):
        res = sc.simulate("2bw", stages=S, microbatches=m, steps=K)
        assert res.bubble_fraction == pytest.approx((S - 1) / (K * m + S - 1), abs=1e-12), K
        bubbles.append(res.bubble_fraction)
    assert bubbles[0] > bubbles[1] > bubbles[2] and bubbles[2] < 0.004


def test_2bw_has_no_flush_while_sync_schedules_flush_every_step():
    for S, m, K in _sizes("2bw"):
        res = sc.simulate("2bw", stages=S, microbatches=m, steps=K)
        assert res.bubble_fraction == pytest.approx((S - 1) / (K * m + S - 1), abs=1e-12)
        sync = sc.simulate("1f1b", stages=S, microbatches=m, steps=K)
        assert sync.makespan == pytest.approx(K * (m + S - 1) * 3.0, abs=1e-9)


def test_optimizer_cost_and_latency_lengthen_the_run_as_modelled():
    # Every sync step pays the optimizer cost after its flush, on the critical path.
    base = sc.simulate("1f1b", stages=3, microbatches=4, steps=2)
    with_opt = sc.simulate("1f1b", stages=3, microbatches=4, steps=2, opt=0.5)
    assert with_opt.makespan == pytest.approx(base.makespan + 2 * 0.5)
    lat = sc.simulate("gpipe", stages=3, microbatches=4, p2p=0.25)
    # GPipe's critical path crosses S-1 links forward and S-1 links backward.
    assert lat.makespan == pytest.approx((4 + 2) * 3.0 + 2 * 2 * 0.25)


# ---- hand-computed simulation -------------------------------------------------------------------

def test_simulator_matches_a_hand_computed_two_stage_timeline():
    # Stage 0: F0 [0,1] F1 [1,2]; stage 1 (fwd 3, bwd 4, messages take 0.5): F0 [1.5,4.5],
    # F1 [4.5,7.5], B0 [7.5,11.5], B1 [11.5,15.5]; stage 0: B0 [12,14], B1 [16,18].
    res = sc.simulate("gpipe", stages=2, microbatches=2, fwd=[1.0, 3.0], bwd=[2.0, 4.0], p2p=0.5)
    spans = {(e.stage, e.op, e.microbatch): (e.start, e.end) for e in res.timeline}
    assert spans[(1, "forward", 0)] == (1.5, 4.5)
    assert spans[(1, "forward", 1)] == (4.5, 7.5)
    assert spans[(0, "backward", 0)] == (12.0, 14.0)
    assert spans[(0, "backward", 1)] == (16.0, 18.0)
    assert spans[(0, "optimizer_step", -1)] == (18.0, 18.0)
    assert res.makespan == 18.0
    assert res.busy == [6.0, 14.0] and res.idle == [12.0, 4.0]
    assert res.bubble_fraction == pytest.approx(1 - 20 / 36, abs=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_timeline_respects_data_dependencies_with_random_costs(kind):
    rng = random.Random(7)
    sizes = [(4, 1, 9), (3, 1, 5), (5, 1, 2)] if kind == "pipedream" else [(4, 5, 2), (3, 8, 3),
                                                                           (5, 5, 1)]
    for S, m, K in sizes:
        fwd = [rng.uniform(0.5, 2) for _ in range(S)]
        bwd = [rng.uniform(0.5, 3) for _ in range(S)]
        p2p = rng.uniform(0, 0.5)
        res = sc.simulate(kind, stages=S, microbatches=m, steps=K, fwd=fwd, bwd=bwd, p2p=p2p,
                          opt=0.3)
        span = {(e.stage, e.op, e.step, e.microbatch): e for e in res.timeline}
        for (s, op, t, i), e in span.items():
            if op == "forward" and s > 0:
                assert e.start >= span[(s - 1, "forward", t, i)].end + p2p - 1e-12
            if op == "backward":
                assert e.start >= span[(s, "forward", t, i)].end - 1e-12
                if s < S - 1:
                    assert e.start >= span[(s + 1, "backward", t, i)].end + p2p - 1e-12
        for s in range(S):  # one stage runs one instruction at a time
            rows = [e for e in res.timeline if e.stage == s]
            assert all(a.end <= b.start + 1e-12 for a, b in zip(rows, rows[1:]))
            assert res.busy[s] == pytest.approx(sum(e.end - e.start for e in rows))
        assert res.makespan == pytest.approx(max(e.end for e in res.timeline))


# ---- memory: in-flight microbatches and weight versions -----------------------------------------

def test_peak_inflight_gpipe_holds_all_microbatches_1f1b_and_2bw_hold_stages_minus_index():
    for S, m, K in SIZES:
        assert sc.simulate("gpipe", stages=S, microbatches=m, steps=K).peak_inflight == [m] * S
        expected = [min(S - s, m) for s in range(S)]
        assert sc.simulate("1f1b", stages=S, microbatches=m, steps=K).peak_inflight == expected
        if m >= S:
            assert (sc.simulate("2bw", stages=S, microbatches=m, steps=K).peak_inflight
                    == [S - s for s in range(S)])


def test_weight_versions_two_for_2bw_one_for_sync():
    for S, m, K in SIZES:
        for kind in ("gpipe", "1f1b"):
            assert sc.simulate(kind, stages=S, microbatches=m, steps=K).max_versions == [1] * S
        if m >= S:
            res = sc.simulate("2bw", stages=S, microbatches=m, steps=K)
            assert res.max_versions == [2 if K >= 2 else 1] * S


def test_2bw_versions_follow_the_delay_rule_and_switch_after_the_stage_last_backward():
    sched = sc.build("2bw", 3, 4, 4)
    for s, prog in enumerate(sched.programs):
        opt_at = {ins.step: k for k, ins in enumerate(prog) if ins.op == Op.optimizer_step}
        assert [prog[k].version for k in sorted(opt_at.values())] == [1, 2, 3, 4]
        for k, ins in enumerate(prog):
            if ins.op in (Op.forward, Op.backward):
                assert ins.version == max(ins.step - 1, 0)
            if ins.op == Op.backward and ins.microbatch == 3:  # the step's last backward
                # only its gradient message may come between it and the optimizer step
                between = prog[k + 1:opt_at[ins.step]]
                assert all(b.op in (Op.send_grad, Op.recv_act) for b in between), between
    # No flush: some stage starts step 1 before finishing step 0's backwards.
    res = sc.simulate(sched)
    first_f1 = min(e.start for e in res.timeline if e.op == "forward" and e.step == 1)
    last_b0 = max(e.end for e in res.timeline if e.op == "backward" and e.step == 0)
    assert first_f1 < last_b0


# ---- validator: accepts everything generated ----------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_validator_accepts_every_generated_schedule(kind):
    for S, m, K in _sizes(kind):
        sched = sc.build(kind, S, m, K)
        assert sc.validate(sched) == [], (kind, S, m, K)
        for s, prog in enumerate(sched.programs):
            if s == 0:
                assert not any(i.op in (Op.recv_act, Op.send_grad) for i in prog)
            if s == S - 1:
                assert not any(i.op in (Op.send_act, Op.recv_grad) for i in prog)


# ---- validator: rejects hand-broken schedules ---------------------------------------------------

def _with_programs(sched, programs):
    broken = copy.copy(sched)
    broken.programs = programs
    return broken


def _problems(sched, programs):
    problems = sc.validate(_with_programs(sched, programs), raise_on_error=False)
    assert problems, "the broken schedule was accepted"
    return problems


def _names(problems, stage, op, step, mb):
    """Some problem names this stage, an instruction of this op and this microbatch."""
    for p in problems:
        for hit in INSTR.finditer(p):
            if (int(hit[1]), hit[3], int(hit[4]), int(hit[5])) == (stage, op, step, mb):
                return True
    return False


BROKEN_SIZES = [(2, 2, 1), (3, 4, 2), (4, 8, 3), (5, 6, 2), (4, 4, 1)]
PIPEDREAM_BROKEN_SIZES = [(2, 1, 3), (3, 1, 4), (4, 1, 8), (5, 1, 6), (4, 1, 2)]


def _broken_sizes(kind):
    return PIPEDREAM_BROKEN_SIZES if kind == "pipedream" else BROKEN_SIZES


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("send_op", [Op.send_act, Op.send_grad])
def test_dropped_send_is_reported_with_stage_instruction_and_microbatch(kind, send_op):
    rng = random.Random(1)
    for S, m, K in _broken_sizes(kind):
        sched = sc.build(kind, S, m, K)
        progs = sched.programs
        candidates = [(s, k) for s, p in enumerate(progs) for k, i in enumerate(p) if i.op == send_op]
        for s, k in rng.sample(candidates, min(3, len(candidates))):
            progs = sched.programs
            dropped = progs[s].pop(k)
            problems = _problems(sched, progs)
            peer = dropped.peer
            recv = "recv_act" if send_op == Op.send_act else "recv_grad"
            assert _names(problems, peer, recv, dropped.step, dropped.microbatch), problems
            assert any("no matching send_" in p for p in problems), problems


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("send_op", [Op.send_act, Op.send_grad])
def test_two_swapped_sends_are_reported_as_out_of_order(kind, send_op):
    for S, m, K in _broken_sizes(kind):
        sched = sc.build(kind, S, m, K)
        progs = sched.programs
        s = 1 if send_op == Op.send_grad else 0
        idx = [k for k, i in enumerate(progs[s]) if i.op == send_op]
        a, b = idx[-2], idx[-1]  # swap the last two sends' places
        progs[s][a], progs[s][b] = progs[s][b], progs[s][a]
        problems = _problems(sched, progs)
        moved = progs[s][a]
        order = [p for p in problems if "out of order" in p]
        assert order and INSTR.search(order[0])[0] == (
            f"stage {s}, instruction #{a} {sc.C.op_name(send_op)} "
            f"(step {moved.step}, mb {moved.microbatch})"), problems


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_version_on_a_backward_is_reported(kind):
    for S, m, K in _broken_sizes(kind):
        sched = sc.build(kind, S, m, K)
        progs = sched.programs
        s = S - 1
        k = max(k for k, i in enumerate(progs[s]) if i.op == Op.backward)
        ins = progs[s][k]
        ins.version += 1
        progs[s][k] = ins
        problems = _problems(sched, progs)
        hit = [p for p in problems if "its forward" in p and "used version" in p]
        assert hit and hit[0].startswith(
            f"stage {s}, instruction #{k} backward (step {ins.step}, mb {ins.microbatch})"), problems


def test_naive_1f1b_order_deadlocks_under_rendezvous_and_is_reported():
    # Sending the gradient before posting the next activation receive keeps the per-direction
    # orders intact but hangs when sends block: only the rendezvous simulation sees it.
    for kind in ("1f1b", "2bw"):
        sched = sc.build(kind, 4, 8, 2)
        progs = sched.programs
        prog = progs[2]
        k = next(k for k in range(len(prog) - 1)
                 if prog[k].op == Op.recv_act and prog[k + 1].op == Op.send_grad)
        prog[k], prog[k + 1] = prog[k + 1], prog[k]
        problems = _problems(sched, progs)
        assert all("deadlock" in p for p in problems), problems
        assert any(p.startswith(f"stage 2, instruction #{k} send_grad") for p in problems)


def test_other_breakages_name_what_is_wrong():
    sched = sc.build("2bw", 3, 4, 3)
    progs = sched.programs
    k = next(k for k, i in enumerate(progs[1]) if i.op == Op.optimizer_step)
    progs[1].insert(k - 3, progs[1].pop(k))  # optimizer step before the step's last backward
    assert any("optimizer_step (step 0): runs before the backward of (step 0, mb 3)" in p
               for p in _problems(sched, progs))

    progs = sched.programs
    k = next(k for k, i in enumerate(progs[0]) if i.op == Op.forward and i.step == 2)
    del progs[0][k:k + 2]  # the forward and its send
    problems = _problems(sched, progs)
    assert any("stage 0, (step 2, mb 0): no forward instruction" in p for p in problems)

    progs = sched.programs
    progs[0].append(sc.Instruction(Op.recv_act, 0, 0, 0, peer=-1))
    assert any("stage 0 has no upstream stage" in p for p in _problems(sched, progs))

    # Step 2 of 2bw runs on version 1 (the delayed weights), not on its predecessor's output.
    progs = sched.programs
    for p in progs:
        for k, i in enumerate(p):
            if i.op != Op.optimizer_step and i.step == 2:
                i.version = 2
                p[k] = i
    problems = _problems(sched, progs)
    assert any(p.startswith("stage 0, instruction #") and "2bw step 2 must use version 1" in p
               for p in problems)


def test_sync_schedule_with_two_versions_alive_is_rejected():
    # One-stage gpipe: F0 F1 B0 B1 OPT0 ...; moving OPT0 before B1 keeps version 0 in use after
    # version 1 exists, which a synchronous schedule never allows.
    sched = sc.build("gpipe", 1, 2, 2)
    prog = sched.programs[0]
    ops = [(sc.C.op_name(i.op), i.step, i.microbatch) for i in prog]
    assert ops[:5] == [("forward", 0, 0), ("forward", 0, 1), ("backward", 0, 0),
                       ("backward", 0, 1), ("optimizer_step", 0, -1)]
    problems = _problems(sched, [[prog[0], prog[1], prog[2], prog[4], prog[3]] + prog[5:]])
    assert any("2 weight versions alive" in p and "gpipe keeps at most 1" in p for p in problems)
    assert any("stage 0, instruction #3 optimizer_step (step 0): runs before the backward" in p
               for p in problems)


def test_validate_raises_schedule_error_with_every_problem_by_default():
    sched = sc.build("1f1b", 3, 4)
    progs = sched.programs
    del progs[1][3]
    broken = _with_programs(sched, progs)
    with pytest.raises(sc.ScheduleError) as info:
        sc.validate(broken)
    assert info.value.problems and all(p in str(info.value) for p in info.value.problems)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="cannot simulate an invalid schedule"):
        sc.simulate(broken)


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,match", [
    (("1f1b", 0, 4), r"stages must be >= 1 \(got S=0\)"),
    (("1f1b", 2, 0), r"microbatches must be >= 1 \(got m=0\)"),
    (("gpipe", 2, 2, 0), r"steps must be >= 1 \(got K=0\)"),
    (("2bw", 4, 2), r"2bw needs microbatches >= stages \(got m=2, S=4\): raise --microbatches "
                    r"to at least 4"),
    (("zb", 2, 2), r"unknown schedule 'zb': choose one of gpipe, 1f1b, 2bw, pipedream"),
    (("pipedream", 4, 2), r"pipedream runs one microbatch per optimizer step \(got m=2\): use "
                          r"--microbatches 1"),
    (("1f1b", 100, 10000, 10000), r"schedule too large"),
    (("gpipe", 2**31, 2), r"^stages=2147483648 is more than the core takes \(2147483647\); give a smaller count$"),
])
def test_build_rejects_bad_sizes_with_the_fix(args, match):
    with pytest.raises(ValueError, match=match) as info:
        sc.build(*args)
    assert ".cpp:" not in str(info.value)  # the core's source location is for debugging, not for the user


def test_simulate_rejects_bad_costs():
    with pytest.raises(ValueError, match=r"fwd cost of stage 1 is -1.0"):
        sc.simulate("1f1b", stages=2, microbatches=2, fwd=[1.0, -1.0])
    with pytest.raises(ValueError, match=r"bwd has 3 values but the schedule has 2 stages"):
        sc.simulate("1f1b", stages=2, microbatches=2, bwd=[1.0, 1.0, 1.0])
    for name, bad in (("fwd", "12"), ("bwd", [1.0, True]), ("opt", ["1", "2"])):  # "12" ran as the costs 1 and 2
        with pytest.raises(TypeError, match=f"{name} must be a number or a sequence of 2 numbers"):
            sc.simulate("2bw", 2, 2, **{name: bad})
    for bad in (True, "x", None):
        with pytest.raises(TypeError, match=f"p2p must be a number .*got {re.escape(repr(bad))}"):
            sc.simulate("2bw", 2, 2, p2p=bad)
    with pytest.raises(ValueError, match=r"p2p latency is -0.5"):
        sc.simulate("1f1b", stages=2, microbatches=2, p2p=-0.5)
    with pytest.raises(ValueError, match=r"needs stages= and microbatches="):
        sc.simulate("1f1b")
    with pytest.raises(TypeError, match=r"stages must be an integer"):
        sc.build("1f1b", 2.5, 4)
    # The C++ layer checks on its own too (for callers of the raw binding).
    with pytest.raises(ValueError, match=r"optimizer cost of stage 0 is -1"):
        sc.C.simulate_schedule(sc.build("gpipe", 1, 1), [1.0], [1.0], [-1.0], 0.0)


def test_sim_result_json_round_trip():
    res = sc.simulate("2bw", stages=2, microbatches=2, steps=2)
    d = json.loads(res.to_json())
    assert d["bubble_fraction"] == res.bubble_fraction and d["schedule"] == "2bw"
    assert len(d["timeline"]) == len(res.timeline)
    assert d["timeline"][0] == res.timeline[0]._asdict()
    assert "timeline" not in json.loads(res.to_json(include_timeline=False))


def test_dropping_any_single_instruction_is_always_caught():
    pytest.importorskip("hypothesis", reason="needs hypothesis (the [test] extra)")
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(kind=st.sampled_from(KINDS), S=st.integers(1, 5),
           extra=st.integers(0, 4), K=st.integers(1, 3), pick=st.integers(0, 10**6))
    def check(kind, S, extra, K, pick):
        # m >= S keeps 2bw buildable; pipedream takes one microbatch and more steps instead
        sched = (sc.build(kind, S, 1, K + extra) if kind == "pipedream"
                 else sc.build(kind, S, S + extra, K))
        progs = sched.programs
        flat = [(s, k) for s, p in enumerate(progs) for k in range(len(p))]
        s, k = flat[pick % len(flat)]
        dropped = progs[s].pop(k)
        problems = _problems(sched, progs)
        if dropped.op == Op.optimizer_step:
            assert any(f"stage {s}: no optimizer_step for step {dropped.step}" in p
                       for p in problems), problems
        else:  # the dropped instruction's microbatch is named, on its stage or its peer
            mentioned = [p for p in problems
                         if f"(step {dropped.step}, mb {dropped.microbatch})" in p]
            assert mentioned, problems
            assert all(p.startswith("stage ") for p in problems)

    check()

