"""The versioned optimizer step (asyncpp_ext/optim/versioned.py): W(t) read from a source, W(t+1)
written into the parameter's own storage, and error feedback with ef_source="weights" (E = W(t) -
W(t-1) from the previous version, no buffer).

The 2bw layout is simulated with two buffer sets: at step t the parameters point at buffer
(t+1) % 2 (the destination, holding W(t-1)) and W(t) lies in buffer t % 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.dlpack import to_dlpack

import asyncpp_ext
from asyncpp_ext._ext import C
from asyncpp_ext.optim import AdamW, ErrorFeedback, Muon, MuonHybrid
from asyncpp_ext.optim.versioned import VersionedStepError, step_versioned, wants_previous_weights
from optim_reference import AdamWRef, MuonRef

ROOT = Path(__file__).resolve().parents[1]
# Tiny tensors: torch's intra-op threads only add contention on a loaded machine (conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
MATRICES = [(12, 6), (6, 12), (8, 8), (12, 6)]  # tall, wide, square, a repeat (batched Newton-Schulz)
NAMED = [("blocks.0.w", (12, 6)), ("blocks.0.b", (12,)), ("blocks.1.w", (6, 12)), ("blocks.1.b", (6,))]
EF = {"off": dict(ef_beta=0.0), "buffer": dict(ef_beta=0.5, ef_source="buffer"),
      "weights": dict(ef_beta=0.5, ef_source="weights")}

OPTIMIZERS = {  # name -> (shapes, factory(list of (name, parameter), ef kwargs))
    "adamw": (MATRICES + [(7,)], lambda named, ef: AdamW([p for _, p in named], lr=0.01, weight_decay=0.1, **ef)),
    "muon": (MATRICES, lambda named, ef: Muon([p for _, p in named], lr=0.02, weight_decay=0.1,
                                              ns_dtype=torch.float32, **ef)),
    "muon_bf16": (MATRICES, lambda named, ef: Muon([p for _, p in named], lr=0.02, weight_decay=0.1,
                                                   ns_dtype=torch.bfloat16, **ef)),
    "hybrid": ([s for _, s in NAMED], lambda named, ef: MuonHybrid(named, lr=0.02, adamw_lr=0.01,
                                                                    weight_decay=0.1, **ef)),
    "ef_sgd": ([(12, 6), (7,)], lambda named, ef: ErrorFeedback(
        torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9, weight_decay=0.01),
        ef["ef_beta"], ef.get("ef_source", "buffer"))),
    "ef_adamw": ([(12, 6), (7,)], lambda named, ef: ErrorFeedback(
        AdamW([p for _, p in named], lr=0.01, weight_decay=0.1), ef["ef_beta"], ef.get("ef_source", "buffer"))),
}


def start_and_grads(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen) for s in shapes]
    return start, [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def run_2bw(make_opt, shapes, ef, how, steps=5, drop=None):
    """Step an optimizer over two weight buffers; returns (W(1)..W(steps), optimizer, params).

    how: "copy" copies W(t) into the destination and steps in place (W(t-1) for EF from the
    weights comes from a copy taken first); "2bw" steps from the W(t) buffer with previous = the
    destination itself; "self" copies like "copy" and passes each parameter as its own source.
    drop: (step, index) of a parameter given no gradient at that step."""
    start, grads = start_and_grads(shapes, steps)
    bufs = [[w.clone() for w in start], [w.clone() for w in start]]
    named = [(f"p{i}", torch.nn.Parameter(w.clone())) for i, w in enumerate(start)]
    params = [p for _, p in named]
    opt = make_opt(named, ef)
    history = []
    for t in range(steps):
        src, dst = bufs[t % 2], bufs[(t + 1) % 2]
        for i, (p, d, g) in enumerate(zip(params, dst, grads[t])):
            p.data = d
            p.grad = None if drop == (t, i) else g.clone()
        if how == "2bw":
            opt.step_from(dict(zip(params, src)), dict(zip(params, dst)) if t else None)
        else:
            prev = dict(zip(params, [d.clone() for d in dst])) if t else None
            for d, s in zip(dst, src):
                d.copy_(s)
            opt.step_from(dict(zip(params, params)) if how == "self" else None, prev)
        history.append([d.clone() for d in dst])
    return history, opt, params


def state_tensors(opt, params):
    return [(k, v) for p in params for k, v in sorted(opt.state[p].items())]


@pytest.mark.parametrize("ef", list(EF))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_out_of_place_is_bitwise_the_copy_and_in_place_step(name, ef):
    shapes, make = OPTIMIZERS[name]
    runs = {how: run_2bw(make, shapes, EF[ef], how, drop=(2, 1)) for how in ("copy", "2bw", "self")}
    ref_hist, ref_opt, ref_params = runs["copy"]
    for how in ("2bw", "self"):
        hist, opt, params = runs[how]
        for t, (got, want) in enumerate(zip(hist, ref_hist)):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (how, t)
        got_state, want_state = state_tensors(opt, params), state_tensors(ref_opt, ref_params)
        assert [k for k, _ in got_state] == [k for k, _ in want_state]
        assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b
                   for (_, a), (_, b) in zip(got_state, want_state)), how
    keys = {k for p in ref_params for k in ref_opt.state[p]}
    assert ("ef_buffer" in keys) == (ef == "buffer"), keys  # "weights" keeps no buffer
    # EF really acts: its trajectory leaves the plain one after the first step.
    if ef != "off":
        plain = run_2bw(make, shapes, EF["off"], "2bw", drop=(2, 1))[0]
        assert all(torch.equal(a, b) for a, b in zip(plain[0], ref_hist[0]))  # first step: plain update
        assert not all(torch.equal(a, b) for a, b in zip(plain[-1], ref_hist[-1]))


def test_a_parameter_without_gradient_gets_w_t_in_its_destination():
    shapes, make = OPTIMIZERS["adamw"]
    hist, _, _ = run_2bw(make, shapes, EF["weights"], "2bw", steps=3, drop=(2, 1))
    assert torch.equal(hist[2][1], hist[1][1])  # W(3) = W(2), though the destination held W(1)
    assert not torch.equal(hist[1][1], hist[0][1])


def weights_ef_reference(ref, grads, beta):
    """A float64 reference with ef_beta=0 (it computes D from its own weights, rounded to float32
    each step) with EF from the weights on top: W(t+1) = W(t) + D + beta*(D - (W(t) - W(t-1)))."""
    prev = None
    for gs in grads:
        w_t = [w.clone() for w in ref.w]
        ref.step(gs)
        if prev is not None:
            ref.w = [(w + d + beta * (d - (w - wp))).float().double() for w, d, wp in zip(w_t, ref.d, prev)]
        prev = w_t
    return ref.w


def rel_err(got, want, start):
    """Max |got - want| relative to how far the reference moved the weights."""
    return max(((g.double() - w.double()).abs().max() / (w.double() - s.double()).abs().max()).item()
               for g, w, s in zip(got, want, start))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_weights_ef_matches_a_float64_reference_of_the_formula(name):
    """D comes from an independent float64 reference (tests/optim_reference.py) fed the same
    gradients, the formula is applied here. The check fails for the buffer rule (E = D(t-1)) or no
    EF, which differ from the reference by more than 100x the bound (asserted below)."""
    shapes, make = OPTIMIZERS[name]
    steps, beta = 6, 0.5
    start, grads = start_and_grads(shapes, steps)
    ref = (AdamWRef(start, lr=0.01, wd=0.1) if name == "adamw" else MuonRef(start, lr=0.02, wd=0.1))
    want = weights_ef_reference(ref, grads, beta)
    errors = {ef: rel_err(run_2bw(make, shapes, EF[ef], "2bw", steps=steps)[0][-1], want, start) for ef in EF}
    assert errors["weights"] < 1e-5, errors
    assert errors["buffer"] > 1e-3 and errors["off"] > 1e-3, errors


def test_a_parameter_missing_from_previous_gets_the_plain_update():
    shapes, make = OPTIMIZERS["muon"]
    start, grads = start_and_grads(shapes, 2)
    results = {}
    for ef in ("off", "weights"):
        bufs = [[w.clone() for w in start], [w.clone() for w in start]]
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = make([("", p) for p in params], EF[ef])
        for t in range(2):
            src, dst = bufs[t % 2], bufs[(t + 1) % 2]
            for p, d, g in zip(params, dst, grads[t]):
                p.data, p.grad = d, g.clone()
            opt.step_from(dict(zip(params, src)), {params[0]: dst[0]} if t else None)
        results[ef] = [d.clone() for d in bufs[0]]
    assert torch.equal(results["weights"][1], results["off"][1])
    assert not torch.equal(results["weights"][0], results["off"][0])


def test_buffer_ef_ignores_previous_and_wants_previous_weights_says_who_reads_it():
    shapes, make = OPTIMIZERS["adamw"]
    a = run_2bw(make, shapes, EF["buffer"], "2bw")[0]  # previous passed, ignored
    b = run_2bw(make, shapes, EF["buffer"], "copy")[0]
    assert all(torch.equal(x, y) for x, y in zip(a[-1], b[-1]))
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    assert wants_previous_weights(AdamW(p, ef_beta=0.5, ef_source="weights"))
    assert not wants_previous_weights(AdamW(p, ef_beta=0.0, ef_source="weights"))
    assert not wants_previous_weights(AdamW(p, ef_beta=0.5))
    sgd = torch.optim.SGD(p, lr=0.1)
    assert wants_previous_weights(ErrorFeedback(sgd, 0.5, ef_source="weights"))
    assert not wants_previous_weights(ErrorFeedback(sgd, 0.5)) and not wants_previous_weights(sgd)
    # the wrapper's beta decides, also over a fused base whose own groups carry ef_beta 0
    assert wants_previous_weights(ErrorFeedback(AdamW(p), 0.5, ef_source="weights"))
    assert not wants_previous_weights(ErrorFeedback(AdamW(p), 0.0, ef_source="weights"))


def test_step_versioned_copies_for_an_optimizer_without_step_from():
    start, grads = start_and_grads([(5, 3), (4,)], 1)
    src = [w.clone() for w in start]
    dst = [torch.full_like(w, 7.0) for w in start]  # stale W(t-1)
    params = [torch.nn.Parameter(d) for d in dst]
    twins = [torch.nn.Parameter(w.clone()) for w in start]
    for p, q, g in zip(params, twins, grads[0]):
        p.grad, q.grad = g.clone(), g.clone()
    step_versioned(torch.optim.SGD(params, lr=0.1, momentum=0.9), dict(zip(params, src)))
    torch.optim.SGD(twins, lr=0.1, momentum=0.9).step()
    assert all(torch.equal(d, q) for d, q in zip(dst, twins))  # W(t+1) landed in the destination
    assert all(torch.equal(s, w) for s, w in zip(src, start))  # W(t) untouched
    with pytest.raises(VersionedStepError, match="SGD cannot use previous weight versions"):
        step_versioned(torch.optim.SGD(params, lr=0.1), None, {params[0]: src[0]})


def test_step_versioned_steps_fused_optimizers_out_of_place():
    shapes, make = OPTIMIZERS["hybrid"]
    start, grads = start_and_grads(shapes, 1)
    src, dst = [w.clone() for w in start], [torch.zeros_like(w) for w in start]
    params = [torch.nn.Parameter(d) for d in dst]
    twins = [torch.nn.Parameter(w.clone()) for w in start]
    for p, q, g in zip(params, twins, grads[0]):
        p.grad, q.grad = g.clone(), g.clone()
    step_versioned(make(list(zip([n for n, _ in NAMED], params)), EF["weights"]), dict(zip(params, src)))
    make(list(zip([n for n, _ in NAMED], twins)), EF["weights"]).step()
    assert all(torch.equal(d, q) for d, q in zip(dst, twins))
    assert all(torch.equal(s, w) for s, w in zip(src, start))


@pytest.mark.parametrize("make", [
    lambda p, s: AdamW(p, ef_source=s), lambda p, s: Muon(p, ef_source=s),
    lambda p, s: MuonHybrid([("w", p[0])], ef_source=s),
    lambda p, s: ErrorFeedback(torch.optim.SGD(p, lr=0.1), 0.5, ef_source=s)])
def test_an_unknown_ef_source_is_refused(make):
    with pytest.raises(ValueError, match=r"ef_source must be one of 'buffer', 'weights' .* got 'weight'"):
        make([torch.nn.Parameter(torch.zeros(4, 4))], "weight")


@pytest.mark.parametrize("name", ["hybrid", "ef_sgd"])
def test_bad_sources_and_previous_name_the_parameter_and_change_nothing(name):
    shapes, make = OPTIMIZERS[name]
    start, grads = start_and_grads(shapes, 1)
    named = [(n, torch.nn.Parameter(w.clone())) for n, w in zip([n for n, _ in NAMED], start)]
    params = [p for _, p in named]
    opt = make(named, EF["weights"])
    for p, g in zip(params, grads[0]):
        p.grad = g
    last = params[-1]
    who = "parameter 'blocks.1.b'" if name == "hybrid" else "parameter 1 of param group 0"
    bad = [({last: torch.zeros(3)}, None, rf"sources for {who} has shape \(3,\)"),
           ({last: last.detach().double()}, None, "dtype torch.float64"),
           ({last: torch.empty(last.shape, device="meta")}, None, "device meta"),
           (None, {last: torch.zeros(2, 2)}, rf"previous for {who} has shape \(2, 2\)"),
           ({torch.zeros(3): torch.zeros(3)}, None, "not a parameter of this optimizer"),
           ([last], None, "sources must be a dict")]
    if name == "hybrid":  # the kernels read them: contiguous too
        bad.append(({params[0]: torch.zeros(6, 12).T}, None, "non-contiguous"))
    before = [p.detach().clone() for p in params]
    for sources, previous, message in bad:
        with pytest.raises(ValueError, match=message):
            opt.step_from(sources, previous)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state


def test_kernel_bindings_check_sources_and_previous():
    p, g, m, v, u = (torch.zeros(4, 4) for _ in range(5))
    k = C.optim
    adamw = lambda **kw: k.adamw_step([to_dlpack(p)], [to_dlpack(g)], [to_dlpack(m)], [to_dlpack(v)],  # noqa: E731
                                      kw.pop("ef", []), [1], kw.pop("first", []), 0.1, 0.9, 0.999, 1e-8, 0.0,
                                      kw.pop("beta", 0.5), **kw)
    apply = lambda **kw: k.apply_update([to_dlpack(p)], [to_dlpack(u)], [], [-0.1], [], 0.1, 0.0, 0.5,  # noqa: E731
                                        **kw)
    cases = [(dict(sources=[to_dlpack(torch.zeros(5))], previous=[None]), r"params\[0\] and sources\[0\].*same shape"),
             (dict(sources=[to_dlpack(torch.zeros(4, 4, dtype=torch.float64))], previous=[None]),
              r"sources\[0\]: expected dtype float32"),
             (dict(sources=[to_dlpack(torch.zeros(4, 4).T)], previous=[None]), r"sources\[0\].*contiguous"),
             (dict(previous=[to_dlpack(torch.zeros(4, 4).T)]), r"previous\[0\].*contiguous"),
             (dict(previous=[to_dlpack(torch.zeros(4, 4, dtype=torch.float64))]), r"previous\[0\].*float32"),
             (dict(previous=[to_dlpack(torch.zeros(3))]), r"params\[0\] and previous\[0\].*same shape"),
             (dict(previous=[None, None]), r"previous: expected 1 tensors"),
             (dict(sources=[to_dlpack(p), to_dlpack(p)], previous=[None]), r"sources: expected 1 tensors")]
    for kw, message in cases:
        for call in (adamw, apply):
            with pytest.raises(ValueError, match=message):
                call(**dict(kw))
    wide = torch.zeros(17)
    with pytest.raises(ValueError, match=r"sources\[0\] partly overlaps params\[0\]"):
        k.apply_update([to_dlpack(wide[:16].view(4, 4))], [to_dlpack(u)], [], [-0.1], [], 0.1, 0.0, 0.0,
                       sources=[to_dlpack(wide[1:].view(4, 4))])
    with pytest.raises(ValueError, match="ef_bufs and previous were both given"):
        adamw(ef=[to_dlpack(torch.zeros(4, 4))], first=[True], previous=[to_dlpack(m)])
    with pytest.raises(ValueError, match="previous was given but ef_beta is 0"):
        adamw(beta=0.0, previous=[to_dlpack(m)])
    with pytest.raises(ValueError, match="needs one buffer in ef_bufs or one tensor in previous"):
        adamw()


# Under one ISA, every EF mode of both final kernels (AdamW; apply with a float32 and a bfloat16
# update), 2bw (sources = W(t), previous = the destination) against copy-and-step-in-place; prints
# a digest of every output bit and whether the two ways agreed in that process. Kernels only: a
# fresh process pays for torch's optimizer machinery once, a few seconds, which adds nothing here.
ISA_SCRIPT = """
import hashlib, json, torch
import asyncpp_ext
from asyncpp_ext.optim import _kernels as K
torch.set_num_threads(1)  # as one_intra_op_thread: the copies and clones here are tiny
g = torch.Generator().manual_seed(0)
new = lambda: [torch.randn(s, generator=g) for s in [(300, 200), (77,), (1000, 33)]]
w_prev, w_t, grad, upd = new(), new(), new(), new()
h, same = hashlib.sha256(), True
for mode in ("off", "first", "corrected", "weights"):
    for kernel in ("adamw", "apply_f32", "apply_bf16"):
        outs = []
        for how in ("2bw", "copy"):
            dst, m, v = [t.clone() for t in w_prev], [t.clone() for t in upd], [t.abs() for t in upd]
            e = [t.clone() for t in grad] if mode in ("first", "corrected") else []
            prev = [t.clone() for t in w_prev] if how == "copy" else dst
            prev = [prev[0], None, prev[2]] if mode == "weights" else []
            if how == "copy":
                for d, s in zip(dst, w_t):
                    d.copy_(s)
            kw = dict(ef_beta=0.0 if mode == "off" else 0.5, sources=w_t if how == "2bw" else [], previous=prev)
            first = [mode == "first"] * 3 if e else []
            if kernel == "adamw":
                K.adamw_step(dst, grad, m, v, e, [3] * 3, first, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.01, **kw)
            else:
                u = [t.bfloat16() for t in upd] if kernel == "apply_bf16" else upd
                K.apply_update(dst, u, e, [-0.02] * 3, first, lr=0.02, weight_decay=0.1, **kw)
            outs.append(dst + m + v + e)
        same &= all(torch.equal(a, b) for a, b in zip(*outs))
        for t in outs[0]:
            h.update(t.numpy().tobytes())
print(json.dumps(dict(digest=h.hexdigest(), same=bool(same), isa=asyncpp_ext.build_info()["cpu_kernel_isa"])))
"""


def test_every_cpu_isa_gives_the_same_bits():
    """The baseline (ASYNCPP_CPU_ISA=baseline), every other runnable variant short of the best,
    and the default (auto: the best), in fresh processes."""
    runnable = asyncpp_ext.build_info()["cpu_kernel_isas_runnable"]
    results = {}
    for isa in runnable[:-1] + [""]:
        env = dict(os.environ, ASYNCPP_CPU_ISA=isa)
        r = subprocess.run([sys.executable, "-c", ISA_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        results[isa or "default"] = json.loads(r.stdout)
    assert all(r["same"] for r in results.values()), results
    assert results["default"]["isa"] == runnable[-1], results
    assert len({r["digest"] for r in results.values()}) == 1, results
