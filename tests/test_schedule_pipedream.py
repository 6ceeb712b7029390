"""Schedule engine, pipedream (1F1B without flush, weight stashing, one microbatch per step):
program order, the per-stage version rule max(t - (S-1-s), 0), at most S-s versions on stage s,
the bubble's closed form, and the validator rejecting programs that break the rule."""
import itertools

import pytest

from asyncpp_ext.schedule import engine as sc

Op = sc.Op


def _problems(sched, programs):
    broken = sc.Schedule(sched.kind, sched.stages, sched.microbatches, sched.steps, programs)
    problems = sc.validate(broken, raise_on_error=False)
    assert problems, "the broken schedule was accepted"
    return problems


def _compute_ops(prog):
    return [(sc.C.op_name(i.op), i.step) for i in prog if i.op in (Op.forward, Op.backward,
                                                                    Op.optimizer_step)]


def test_pipedream_program_is_the_continuous_1f1b_stream_with_per_stage_versions():
    S, K = 4, 10
    sched = sc.build("pipedream", S, 1, K)
    for s, prog in enumerate(sched.programs):
        warmup = S - 1 - s
        expected = [("forward", t) for t in range(warmup)]
        for t in range(K):  # F(t+warmup), B(t), OPTIMIZER_STEP(t); the last `warmup` without F
            if t + warmup < K:
                expected.append(("forward", t + warmup))
            expected += [("backward", t), ("optimizer_step", t)]
        assert _compute_ops(prog) == expected, s
        created = 0  # versions this stage has created so far (the newest is `created`)
        for ins in prog:
            if ins.op == Op.optimizer_step:
                created += 1
                assert ins.version == created == ins.step + 1
                continue
            assert ins.version == max(ins.step - (S - 1 - s), 0)
            assert ins.version == sc.C.version_for(sc.ScheduleKind.pipedream, ins.step, s, S)
            if ins.op == Op.forward:  # forwards run on the newest weights, backwards on the stash
                assert ins.version == created, (s, ins)
    # Stages disagree on a step's version: the last stage is never stale, stage 0 most.
    last_fwd = {s: next(i for i in p if i.op == Op.forward and i.step == K - 1)
                for s, p in enumerate(sched.programs)}
    assert [last_fwd[s].version for s in range(S)] == [K - 1 - (S - 1 - s) for s in range(S)]


def test_version_for_matches_version_for_step_and_refuses_what_it_cannot_answer():
    K = sc.ScheduleKind
    for kind in (K.gpipe, K.one_f_one_b, K.two_bw):
        for step in range(6):
            assert all(sc.C.version_for(kind, step, s, 3) == sc.C.version_for_step(kind, step)
                       for s in range(3))
    with pytest.raises(ValueError, match=r"pipedream's weight version depends on the stage: use "
                                         r"version_for\(kind, step, stage, stages\)"):
        sc.C.version_for_step(K.pipedream, 3)
    with pytest.raises(ValueError, match=r"stage 4 is out of range for 4 stages"):
        sc.C.version_for(K.pipedream, 3, 4, 4)
    assert [sc.C.versions_alive_limit(K.pipedream, s, 4) for s in range(4)] == [4, 3, 2, 1]
    assert [sc.C.versions_alive_limit(k, 0, 4) for k in (K.gpipe, K.one_f_one_b, K.two_bw)] == [
        1, 1, 2]
    with pytest.raises(ValueError, match=r"unknown schedule 'zb': choose one of gpipe, 1f1b, 2bw, "
                                         r"pipedream"):
        sc.C.build_schedule("zb", 2, 2, 1)  # the C++ parser's own message


def test_pipedream_keeps_stages_minus_index_versions_once_steps_fill_the_stash():
    # Stage s reaches S-s versions (steps t-d .. t, d = S-1-s) once K >= 2d; fewer before.
    for S, K in itertools.product(range(1, 7), range(1, 13)):
        res = sc.simulate("pipedream", stages=S, microbatches=1, steps=K)
        for s in range(S):
            d = S - 1 - s
            if K >= 2 * d:
                assert res.max_versions[s] == S - s, (S, K, res.max_versions)
            else:
                assert 1 <= res.max_versions[s] < S - s, (S, K, res.max_versions)
        assert res.peak_inflight == [min(S - s, K) for s in range(S)]
    assert sc.simulate("pipedream", stages=4, microbatches=1, steps=16).max_versions == [4, 3, 2, 1]


def test_continuous_stream_bubble_matches_its_closed_form():
    # Uniform costs, no latency: stage 0 ends last, at (S-1)(f+b) + N(f+b) + K*o with N = K*m, so
    # bubble = (S-1)(f+b) / that; with o = 0 it is (S-1)/(N+S-1) (pipedream: N = K).
    for S, K in itertools.product(range(1, 8), range(1, 21)):
        res = sc.simulate("pipedream", stages=S, microbatches=1, steps=K)
        assert res.bubble_fraction == pytest.approx((S - 1) / (K + S - 1), abs=1e-12), (S, K)
        for f, b, o in [(1.0, 2.0, 0.5), (0.5, 1.25, 2.0), (1.0, 1.0, 0.0)]:
            res = sc.simulate("pipedream", stages=S, microbatches=1, steps=K, fwd=f, bwd=b, opt=o)
            makespan = (S - 1) * (f + b) + K * (f + b + o)
            assert res.makespan == pytest.approx(makespan, abs=1e-9), (S, K, f, b, o)
            assert res.bubble_fraction == pytest.approx((S - 1) * (f + b) / makespan, abs=1e-12)
    for S, m, K in [(2, 2, 3), (4, 4, 2), (3, 7, 4), (4, 6, 3)]:  # 2bw: the same form
        res = sc.simulate("2bw", stages=S, microbatches=m, steps=K, fwd=0.5, bwd=1.25, opt=0.75)
        assert res.makespan == pytest.approx((S - 1) * 1.75 + K * m * 1.75 + K * 0.75, abs=1e-9)


def _restaled(prog, stage, stages, extra):
    """Stage `stage`'s program with every forward/backward/message `extra` versions staler."""
    out = []
    for ins in prog:
        if ins.op != Op.optimizer_step:
            ins.version = max(ins.step - (stages - 1 - stage) - extra, 0)
        out.append(ins)
    return out


def test_pipedream_with_a_wrong_version_or_too_many_versions_is_rejected():
    S, K = 4, 10
    sched = sc.build("pipedream", S, 1, K)
    progs = sched.programs
    k = next(k for k, i in enumerate(progs[0]) if i.op == Op.forward and i.step == 6)
    ins = progs[0][k]
    ins.version = 6  # the sync rule instead of the stage-0 delay of 3
    progs[0][k] = ins
    problems = _problems(sched, progs)
    assert any(p.startswith(f"stage 0, instruction #{k} forward (step 6, mb 0): uses weight "
                            "version 6 but pipedream step 6 must use version 3 on stage 0 "
                            "(max(step - (S-1-s), 0))") for p in problems), problems
    assert any("before it exists" in p for p in problems), problems  # version 6 is created later
    for s in range(S):  # one step staler than the rule: S-s+1 versions, one too many
        progs = sched.programs
        progs[s] = _restaled(progs[s], s, S, extra=1)
        problems = _problems(sched, progs)
        assert any(p.startswith(f"stage {s}, instruction #") and
                   f"{S - s + 1} weight versions alive after it; pipedream keeps at most "
                   f"{S - s} (S-s) on this stage" in p for p in problems), (s, problems)
        assert any("must use version" in p for p in problems), problems


def test_pipedream_rule_is_checked_against_the_schedule_kind_both_ways():
    S, K = 3, 6
    pd, sync = sc.build("pipedream", S, 1, K), sc.build("1f1b", S, 1, K)
    as_sync = sc.Schedule(sc.ScheduleKind.one_f_one_b, S, 1, K, pd.programs)
    problems = sc.validate(as_sync, raise_on_error=False)
    assert any("1f1b step 5 must use version 5 (= step)" in p for p in problems), problems
    assert any("3 weight versions alive" in p and "1f1b keeps at most 1" in p for p in problems)
    as_pd = sc.Schedule(sc.ScheduleKind.pipedream, S, 1, K, sync.programs)
    problems = sc.validate(as_pd, raise_on_error=False)
    assert any("pipedream step 5 must use version 3 on stage 0" in p for p in problems), problems
    two_mb = sc.build("2bw", 2, 2, 2)
    problems = sc.validate(sc.Schedule(sc.ScheduleKind.pipedream, 2, 2, 2, two_mb.programs),
                           raise_on_error=False)
    assert problems == ["schedule header: pipedream runs one microbatch per optimizer step "
                        "(got m=2); set microbatches to 1"]


def test_pipedream_message_versions_differ_across_a_link_but_must_follow_each_stage_rule():
    sched = sc.build("pipedream", 3, 1, 5)
    progs = sched.programs
    sends = [i for i in progs[0] if i.op == Op.send_act]
    recvs = [i for i in progs[1] if i.op == Op.recv_act]
    assert [(i.step, i.version) for i in sends] == [(t, max(t - 2, 0)) for t in range(5)]
    assert [(i.step, i.version) for i in recvs] == [(t, max(t - 1, 0)) for t in range(5)]
    k = next(k for k, i in enumerate(progs[1]) if i.op == Op.recv_act and i.step == 4)
    ins = progs[1][k]
    ins.version = 2  # stage 0's version of step 4, not stage 1's
    progs[1][k] = ins
    problems = _problems(sched, progs)
    assert any(p.startswith(f"stage 1, instruction #{k} recv_act (step 4, mb 0): version 2 does "
                            "not match version 2 of the matching send_act (stage 0, instruction #")
               and p.endswith("this step runs on version 3 here and 2 there") for p in problems)


def test_pipedream_segments_keep_the_global_per_stage_rule():
    for stage in range(4):
        prog = sc.C.segment_program("pipedream", 4, 1, 3, stage, 5)
        for op, step, mb, version, peer in prog:
            assert 5 <= step < 8 and mb in (0, -1)
            expected = step + 1 if op == "optimizer_step" else max(step - (3 - stage), 0)
            assert version == expected, (stage, op, step, version)
