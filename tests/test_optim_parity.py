"""Numerical parity of the fused optimizers with torch.optim and with float64 references."""
import pytest
import torch

from asyncpp_ext.optim import AdamW, ErrorFeedback, Muon
from optim_reference import AdamWRef, MuonRef, run

SHAPES = [(24, 8), (8, 24), (16, 16), (24, 8)]  # tall, wide, square, and a repeat to exercise batching


def make_weights(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def grad_stream(seed, shapes, steps):
    gen = torch.Generator().manual_seed(seed + 1000)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def rel_err(got, want, start):
    """Max |got - want| relative to how far the reference moved the weights."""
    return max(((g.double() - w.double()).abs().max() / (w.double() - s.double()).abs().max()).item()
               for g, w, s in zip(got, want, start))


def test_muon_bf16_matches_torch_muon():
    weights, grads = make_weights(0), grad_stream(0, SHAPES, 10)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours, _ = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw), weights, grads)
    ref, _ = run(lambda ps: torch.optim.Muon(ps, **kw), weights, grads)
    # bf16 keeps 8 mantissa bits (rel. rounding 2^-9 = 0.2%); NS5 and 10 steps compound it a little.
    assert rel_err(ours, ref, weights) < 3e-2
    fp32, _ = run(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw), weights, grads)
    assert rel_err(fp32, ref, weights) < 3e-2


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_fp32_matches_float64_reference(adjust, nesterov):
    weights, grads = make_weights(1), grad_stream(1, SHAPES, 10)
    ours, _ = run(lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust,
                                  ns_dtype=torch.float32), weights, grads)
    ref = MuonRef(weights, lr=0.02, wd=0.1, nesterov=nesterov, adjust=adjust)
    for gs in grads:
        ref.step(gs)
    assert rel_err(ours, ref.w, weights) < 1e-5


def test_newton_schulz_fp32_matches_float64():
    from asyncpp_ext.optim import orthogonalize
    from optim_reference import ns5_f64

    for v in make_weights(6, SHAPES + [(64, 256)]):
        o = orthogonalize(v[None], v.norm()[None], ns_dtype=torch.float32)[0]
        r = ns5_f64(v)
        assert ((o.double() - r).abs().max() / r.abs().max()).item() < 1e-5


def test_fused_adamw_matches_torch_adamw():
    shapes = SHAPES + [(7,), (3, 5, 2)]
    weights, grads = make_weights(2, shapes), grad_stream(2, shapes, 10)
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, _ = run(lambda ps: AdamW(ps, **kw), weights, grads)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, **kw), weights, grads)
    # Relative to the weights' scale: elements crossing zero carry the rounding of |W|-sized terms.
    for o, r in zip(ours, ref):
        assert ((o - r).abs().max() / r.abs().max()).item() < 1e-6


def test_ef_beta_zero_is_bitwise_the_base():
    weights, grads = make_weights(3), grad_stream(3, SHAPES, 4)
    for make in (lambda ps, b: Muon(ps, lr=0.02, ef_beta=b), lambda ps, b: AdamW(ps, lr=0.01, ef_beta=b)):
        plain, _ = run(lambda ps: make(ps, 0.0), weights, grads)
        # EF's first step is the plain update (only E is recorded): bitwise equal too.
        first, opt = run(lambda ps: make(ps, 0.7), weights, grads[:1])
        plain1, _ = run(lambda ps: make(ps, 0.0), weights, grads[:1])
        assert all(torch.equal(a, b) for a, b in zip(first, plain1))
        _, opt0 = run(lambda ps: make(ps, 0.0), weights, grads)
        assert all("ef_buffer" not in st for st in opt0.state.values())  # beta=0 allocates nothing
        assert len(plain) == len(weights)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    base, _ = run(sgd, weights, grads)
    wrapped, _ = run(lambda ps: ErrorFeedback(sgd(ps), 0.0), weights, grads)
    assert all(torch.equal(a, b) for a, b in zip(base, wrapped))


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_fused_ef_matches_float64_formula(beta):
    weights, grads = make_weights(4), grad_stream(4, SHAPES, 6)
    ours, _ = run(lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1, ef_beta=beta), weights, grads)
    ref = AdamWRef(weights, lr=0.01, wd=0.1, ef_beta=beta)
    for gs in grads:
        ref.step(gs)
    assert rel_err(ours, ref.w, weights) < 1e-5
    ours, _ = run(lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ef_beta=beta, ns_dtype=torch.float32),
                  weights, grads)
    ref = MuonRef(weights, lr=0.02, wd=0.1, ef_beta=beta)
    for gs in grads:
        ref.step(gs)
    assert rel_err(ours, ref.w, weights) < 1e-5
    # and EF really changes the trajectory
    plain, _ = run(lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32), weights, grads)
    assert rel_err(plain, ref.w, weights) > 1e-2


def test_generic_wrapper_ef_matches_formula():
    weights, grads = make_weights(5), grad_stream(5, SHAPES, 5)
    lr, beta = 0.1, 0.5
    ours, _ = run(lambda ps: ErrorFeedback(torch.optim.SGD(ps, lr=lr), beta), weights, grads)
    w, e = [x.double() for x in weights], [None] * len(weights)
    for gs in grads:
        for i, g in enumerate(gs):
            d = -lr * g.double()
            w[i] = (w[i] + d + (0 if e[i] is None else beta * (d - e[i]))).float().double()
            e[i] = d
    # The wrapper recovers D from rounded weights (documented caveat): ~1 ulp of |W| per step.
    assert rel_err(ours, w, weights) < 1e-5
