"""Numerical parity of the fused optimizers with torch.optim and with float64 references."""
import pytest
import torch
from torch import nn

from asyncpp_ext.optim import AdamW, ErrorFeedback, Muon, build_optimizer
from asyncpp_ext.training.build import optimizer_factory as make_optimizer_factory
from asyncpp_ext.training.config import RunConfig
from optim_reference import AdamWRef, MuonHybridRef, MuonRef, hybrid_routing, run

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


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
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


class _HybridNet(nn.Module):
    """Every kind of tensor MuonHybrid routes: an embedding table, hidden Linear layers with biases
    (tall, square and wide weights), a LayerNorm and a separate output head."""

    VOCAB = 11

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.emb = nn.Embedding(self.VOCAB, 8)
            self.fc1 = nn.Linear(8, 16)
            self.mid = nn.Linear(16, 16)
            self.fc2 = nn.Linear(16, 8)
            self.norm = nn.LayerNorm(8)
            self.head = nn.Linear(8, self.VOCAB)
            with torch.no_grad():  # LayerNorm and biases away from their identity/zero init
                for p in self.parameters():
                    p.add_(0.3 * torch.randn(p.shape))

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.fc2(torch.tanh(self.mid(nn.functional.gelu(self.fc1(x)))))
        return self.head(self.norm(x))


def _cli_muon_optimizer(model, weight_decay):
    """The optimizer asyncpp-train --optimizer muon builds (every other optim flag left out)."""
    cfg = RunConfig()
    cfg.optim.name, cfg.optim.weight_decay = "muon", weight_decay
    cfg.optim.pin_auto_values()
    return make_optimizer_factory(cfg)(model), cfg.optim


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])  # the CLI default, and decay on both parts
def test_cli_muon_hybrid_with_ef_matches_float64_reference(weight_decay):
    model = _HybridNet()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, o = _cli_muon_optimizer(model, weight_decay)
    assert (o.lr, o.adamw_lr, o.ef_beta) == (0.02, 3e-3, 0.5)
    muon_names, _ = hybrid_routing(model)
    assert muon_names == ["fc1.weight", "mid.weight", "fc2.weight"]
    names = {id(p): n for n, p in model.named_parameters()}
    got_routing = {g["algorithm"]: [names[id(p)] for p in g["params"]] for g in opt.param_groups}
    assert sorted(got_routing["muon"]) == sorted(muon_names)
    assert opt.param_groups[0]["ns_dtype"] is None  # the CLI leaves it to the device: float32 on CPU
    # MuonHybrid's documented defaults for what the CLI does not set: momentum 0.95 with Nesterov,
    # NS eps 1e-7, AdamW betas (0.9, 0.95) and eps 1e-8, AdamW weight decay = weight_decay.
    ref = MuonHybridRef(start.items(), muon_names, lr=0.02, adamw_lr=3e-3, wd=weight_decay,
                        adamw_wd=weight_decay, ef_beta=0.5)
    # Same-input float32-NS copy of the product: ns_dtype None must be exactly float32 on CPU.
    explicit = _HybridNet()
    explicit_opt = build_optimizer(explicit, "muon", 0.02, weight_decay=weight_decay, ef_beta=0.5,
                                   adamw_lr=3e-3, ns_dtype=torch.float32)
    # Per element, what float32 arithmetic allows after each step: the two W(t+1) are each the
    # float32 rounding of W(t) + update, so when the updates differ by a rounding the results may
    # land on neighbouring floats (one ulp of |W(t+1)|, counted as 2^-23 |W(t+1)|); the updates
    # themselves differ by Newton-Schulz in float32 (1e-5 of the largest entry, the accuracy
    # test_newton_schulz_fp32_matches_float64 holds it to) or by AdamW's ~10 float32 roundings
    # (1e-6), and EF adds D + 0.5 (D - E), carrying a D error 1.5 times and an E error 0.5 times.
    ulp, rel_update = torch.finfo(torch.float32).eps, {"muon": 1e-5, "adamw": 1e-6}
    bound = {n: torch.zeros_like(w, dtype=torch.float64) for n, w in start.items()}
    gen = torch.Generator().manual_seed(7)
    for _ in range(6):
        idx, y = (torch.randint(0, _HybridNet.VOCAB, (4, 6), generator=gen) for _ in range(2))
        for net in (model, explicit):
            net.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(idx).reshape(-1, _HybridNet.VOCAB), y.reshape(-1))
            loss.backward()
        ref.step({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        explicit_opt.step()
        for n, w in ref.weights().items():
            part, i = (ref.muon, ref.muon_names.index(n)) if n in muon_names else \
                (ref.adamw, ref.adamw_names.index(n))
            bound[n] += ulp * w.abs() + 2 * rel_update["muon" if n in muon_names else "adamw"] * part.d[i].abs().max()
    want = ref.weights()
    for n, p in model.named_parameters():
        err = (p.detach().double() - want[n]).abs()
        assert (err <= bound[n]).all(), (n, float((err / bound[n]).max()))
        assert not torch.equal(want[n].float(), start[n])  # every tensor moved
    for (n, p), q in zip(model.named_parameters(), explicit.parameters()):
        assert torch.equal(p, q), n
