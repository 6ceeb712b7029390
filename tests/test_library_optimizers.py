"""The study's optimizers beyond AdamW and Muon: Lion, Adan, SOAP and MARS from pytorch-optimizer
(optim/library.py) and NorMuon inside the fused Muon (optim/normuon.py).

- build_optimizer(name, ef_beta=0) is the library class itself, bitwise, over several steps;
- with ef_beta > 0 the ErrorFeedback wrapper follows a float64 run of the EF rule, within a bound
  derived from float32 rounding (see `ef_tolerance`);
- NorMuon equals a plain float64 reference (Muon + per-row normalisation written out), agrees with
  pytorch_optimizer's NorMuon to bf16 accuracy, gives the same result sharded over two ranks, and
  normuon=False leaves Muon exactly as it was;
- a missing extra fails early with the install command.
"""
import contextlib
import copy
import importlib.util
import math

import pytest
import torch
from torch import nn

from asyncpp_ext.optim import ErrorFeedback, Muon, build_optimizer
from asyncpp_ext.optim import library
from asyncpp_ext.optim.library import LIBRARY_OPTIMIZERS, MissingExtraError, check_available
from asyncpp_ext.optim.normuon import NorMuonArgumentError
from optim_reference import ns5_f64, run as run_fused

needs_study = pytest.mark.skipif(importlib.util.find_spec("pytorch_optimizer") is None,
                                 reason="needs pip install 'asyncpp_ext[study]'")
LIBRARY = sorted(LIBRARY_OPTIMIZERS)
U = 2.0 ** -24  # float32 unit roundoff


class Tiny(nn.Module):
    """Embedding, one hidden matrix, a norm and a head: 2-D and 1-D tensors, as in the GPT."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.norm(torch.relu(self.hidden(self.embed(idx)))))


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    with torch.no_grad():  # LayerNorm starts at exactly 1 and 0: move it so decay and updates show
        for p in model.norm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def direct(name, params, lr, wd, **kwargs):
    """The pytorch_optimizer class built by hand with the arguments library.py documents."""
    import pytorch_optimizer as po

    from asyncpp_ext.optim.param_groups import named_param_groups

    extra = dict(lr_1d=lr, weight_decay_1d=wd) if name == "mars" else {}
    # named pairs split as library.py splits them (torch 2.5 takes no pairs)
    return getattr(po, LIBRARY_OPTIMIZERS[name])(named_param_groups(params), lr=lr, weight_decay=wd, **extra,
                                                 **kwargs)


# Extra keywords per optimizer: SOAP refreshes its eigenbasis every 2 steps so 5 steps reach the
# QR refresh path (and the keyword pass-through is exercised).
KWARGS = {"soap": dict(precondition_frequency=2)}


@needs_study
@pytest.mark.parametrize("name", LIBRARY)
def test_build_optimizer_is_the_library_class_bitwise(name):
    ours_model, lib_model = tiny_model(), tiny_model()
    start = [p.detach().clone() for p in ours_model.parameters()]
    ours = build_optimizer(ours_model, name, 2e-3, weight_decay=0.1, ef_beta=0.0, **KWARGS.get(name, {}))
    lib = direct(name, list(lib_model.named_parameters()), 2e-3, 0.1, **KWARGS.get(name, {}))
    assert type(ours) is type(lib)
    assert ours.param_groups[0]["param_names"] == [n for n, _ in ours_model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        idx, target = torch.randint(0, 11, (4, 6), generator=gen), torch.randint(0, 11, (4, 6), generator=gen)
        for model, opt in ((ours_model, ours), (lib_model, lib)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten()).backward()
            opt.step()
    for (n, a), b, s in zip(ours_model.named_parameters(), lib_model.parameters(), start):
        assert torch.equal(a, b), n
        assert not torch.equal(a, s), f"{n} did not move: the comparison would prove nothing"


@needs_study
def test_build_optimizer_wraps_library_optimizers_in_error_feedback():
    opt = build_optimizer(tiny_model(), "lion", 1e-4, ef_beta=0.5)
    assert isinstance(opt, ErrorFeedback) and opt.beta == 0.5
    assert type(opt.base).__name__ == "Lion"


@pytest.mark.parametrize("name", ["muon", "normuon", "adamw", "sgd"] + [
    pytest.param(name, marks=needs_study) for name in LIBRARY])
def test_ef_source_reaches_the_optimizer_that_runs_error_feedback(name):
    from asyncpp_ext.optim.versioned import wants_previous_weights

    model = tiny_model()
    default = build_optimizer(model, name, 1e-3, ef_beta=0.5)
    weights = build_optimizer(model, name, 1e-3, ef_beta=0.5, ef_source="weights")
    assert default.ef_source == "buffer" and not wants_previous_weights(default)
    assert weights.ef_source == "weights" and wants_previous_weights(weights)


# ---- error feedback against a float64 reference ------------------------------------------------

class Square(nn.Module):
    """Square matrices only: SOAP's Gram matrices G G^T and G^T G of a random gradient are then
    full rank from the first step. (A tall gradient leaves G G^T with a null space, whose
    eigenbasis is arbitrary: float32 and float64 pick different ones, and SOAP's update in that
    subspace differs by O(lr), which is not rounding.)"""

    def __init__(self, width=8):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.second = nn.Linear(width, width, bias=False)


def square_model(seed):
    torch.manual_seed(seed)
    model = Square()
    with torch.no_grad():
        for p in model.norm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def grad_stream(model, steps, seed):
    """Gradients independent of the weights, so float32 and float64 runs see the same ones."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(steps)]


def ef_reference_f64(name, model, grads, lr, wd, beta, **kwargs):
    """The library optimizer on a float64 copy, with W <- W + D + beta*(D - E), E <- D applied to
    its update D (the first step plain). Returns the weights, and per step max|W|, max|D| over all
    tensors and SOAP's eigenvector conditioning (see `ef_tolerance`)."""
    ref = copy.deepcopy(model).double()
    params = list(ref.parameters())
    opt = direct(name, list(ref.named_parameters()), lr, wd, **kwargs)
    previous = [None] * len(params)
    stats = []
    with torch.no_grad():
        for gs in grads:
            before = [p.clone() for p in params]
            for p, g in zip(params, gs):
                p.grad = g.double()
            opt.step()
            max_d = 0.0
            for i, (p, w) in enumerate(zip(params, before)):
                d = p - w
                if previous[i] is not None:
                    p.copy_(w + d + beta * (d - previous[i]))
                previous[i] = d
                max_d = max(max_d, d.abs().max().item())
            stats.append((max(p.abs().max().item() for p in params), max_d, soap_conditioning(opt)))
    return [p.detach() for p in params], stats


def soap_conditioning(opt) -> float:
    """n * ||GG|| / min(smallest eigenvalue gap, smallest eigenvalue) over SOAP's preconditioner
    matrices GG (running means of G G^T and G^T G); 1 for the other optimizers.

    SOAP rotates by GG's eigenvectors: float32 eigh has a backward error of about n*u*||GG||, and
    an eigenvector moves by that over its eigenvalue gap (Davis-Kahan); the refresh by one QR of
    GG @ Q loses accuracy with GG's condition number ||GG|| / lambda_min. SOAP's float32 update
    then carries a relative error of about this factor times u."""
    worst = 1.0
    for st in opt.state.values():
        for gg in st.get("GG", []):
            if isinstance(gg, torch.Tensor) and gg.numel() > 1:
                eig = torch.linalg.eigvalsh(gg.double())
                gap = min((eig[1:] - eig[:-1]).min().item(), eig[0].item())
                worst = max(worst, gg.shape[0] * eig.abs().max().item() / gap)
    return worst


def ef_tolerance(stats, beta) -> float:
    """Largest |W32 - W64| the float32 EF run may show, summed over the steps.

    Per step the float32 run rounds (u = 2^-24): inside the library step, at most 3 in-place
    writes of W (decay, one or two update terms), each <= u|W|; these reach the wrapper's
    D = W_after - W_before and so enter W with weight (1 + beta) this step and beta the next (as
    E); the wrapper's own W + beta*(D - E) adds one more u|W|. Against |D|: the library's float32
    arithmetic from g to D is at most 16 roundings deep (moments, sqrt, division, bias
    corrections, the lr product), times SOAP's eigenvector conditioning k, and enters with weight
    (1 + beta) + beta; the wrapper's d - e, beta*(.) and add cost (1 + 6*beta) u|D|.
    Nothing feeds back: the gradients do not depend on W and the decay lr*wd*W is tiny."""
    total = 0.0
    for max_w, max_d, k in stats:
        total += U * ((3 * (1 + 2 * beta) + 1) * max_w + (16 * (1 + 2 * beta) * k + 1 + 6 * beta) * max_d)
    return total


@needs_study
@pytest.mark.parametrize("name", LIBRARY)
def test_error_feedback_matches_the_float64_rule(name):
    lr, wd, beta, steps = 2e-3, 0.1, 0.5, 5
    model = square_model(3)
    grads = grad_stream(model, steps, seed=4)
    want, stats = ef_reference_f64(name, model, grads, lr, wd, beta, **KWARGS.get(name, {}))
    plain, _ = ef_reference_f64(name, model, grads, lr, wd, 0.0, **KWARGS.get(name, {}))
    opt = build_optimizer(model, name, lr, weight_decay=wd, ef_beta=beta, **KWARGS.get(name, {}))
    params = list(model.parameters())
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    err = max((p.double() - w).abs().max().item() for p, w in zip(params, want))
    tol = ef_tolerance(stats, beta)
    assert err <= tol, f"{name}: max |W32 - W64| {err:.3g} > bound {tol:.3g}"
    # The check can fail: leaving EF out changes W by beta*|D - E| per step, far above the bound.
    assert max((a - b).abs().max().item() for a, b in zip(plain, want)) > 20 * tol


# ---- NorMuon ------------------------------------------------------------------------------------

SHAPES = [(24, 8), (8, 24), (16, 16), (24, 8)]  # tall, wide, square, and a repeat (one batch of two)


def weights_and_grads(seed, steps, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    return weights, [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def normuon_reference(weights, grads, lr, wd, beta2, mu=0.95, eps=1e-10):
    """Muon (nesterov, NS5, lr * sqrt(max(1, rows/cols)), decoupled decay) with NorMuon's rows,
    in float64; weights stored as float32 after each step like the optimizer's."""
    w = [x.double() for x in weights]
    buf = [torch.zeros_like(x) for x in w]
    v = [torch.zeros(x.shape[0], dtype=torch.float64) for x in w]
    for gs in grads:
        for i, g in enumerate(gs):
            g = g.double()
            buf[i] = mu * buf[i] + (1 - mu) * g
            o = ns5_f64((1 - mu) * g + mu * buf[i])
            if beta2 is not None:
                v[i] = beta2 * v[i] + (1 - beta2) * (o * o).mean(dim=1)
                n = o / (v[i].sqrt() + eps)[:, None]
                o = n * (o.norm() / (n.norm() + eps))
            rows, cols = o.shape
            w[i] = (w[i] - lr * wd * w[i] - lr * math.sqrt(max(1.0, rows / cols)) * o).float().double()
    return w, v


def rel_err(got, want, start):
    """Max |got - want| relative to how far the reference moved the weights."""
    return max(((g.double() - w).abs().max() / (w - s.double()).abs().max()).item()
               for g, w, s in zip(got, want, start))


def test_normuon_matches_a_float64_reference():
    weights, grads = weights_and_grads(0, steps=6)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    got, opt = run_fused(lambda ps: Muon(ps, normuon=True, normuon_beta2=0.9, **kw), weights, grads)
    want, want_v = normuon_reference(weights, grads, 0.02, 0.1, beta2=0.9)
    # Plain float32 Muon is within 1e-5 of its float64 reference (test_optim_parity); the
    # normalisation rescales rows by smooth functions of O, which keeps a relative error of O's
    # order, so NorMuon is held to the same bound.
    assert rel_err(got, want, weights) < 1e-5
    for p, v in zip(opt.param_groups[0]["params"], want_v):
        got_v = opt.state[p]["normuon_v"]
        assert got_v.dtype == torch.float32 and got_v.shape == (p.shape[0],)
        assert ((got_v.double() - v).abs().max() / v.abs().max()).item() < 1e-5
    # The check can fail: plain Muon lands far outside that bound.
    muon, _ = normuon_reference(weights, grads, 0.02, 0.1, beta2=None)
    assert rel_err(muon, want, weights) > 1e-2


@needs_study
def test_normuon_agrees_with_pytorch_optimizer_normuon():
    import pytorch_optimizer as po

    if not hasattr(po, "NorMuon"):
        pytest.skip("this pytorch-optimizer predates its NorMuon")
    weights, grads = weights_and_grads(1, steps=8)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours, _ = run_fused(lambda ps: Muon(ps, normuon=True, normuon_beta2=0.95, ns_dtype=torch.bfloat16, **kw),
                        weights, grads)
    lib, _ = run_fused(lambda ps: po.NorMuon([dict(params=ps, use_muon=True)], beta2=0.95,
                                             update_scale="preserve_norm", **kw), weights, grads)
    # Both run Newton-Schulz in bfloat16 (8 significant bits, rounding 2^-9); the bound is the one
    # test_optim_parity allows between our bf16 Muon and torch.optim.Muon.
    assert rel_err(ours, [w.double() for w in lib], weights) < 3e-2


@pytest.mark.cuda
def test_normuon_on_cuda_matches_cpu():
    """Same gradients on both devices. The bound is test_optim_api's for Muon on CUDA vs CPU
    (cuBLAS and CPU BLAS sum Newton-Schulz in different orders; fp32, TF32 off): 1e-5 of how far
    the weights moved; the row normalisation keeps that relative error's order."""
    assert not torch.backends.cuda.matmul.allow_tf32
    weights, grads = weights_and_grads(4, steps=4)
    make = lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, normuon=True)  # noqa: E731
    cpu, cpu_opt = run_fused(make, weights, grads)
    gpu, gpu_opt = run_fused(make, [w.cuda() for w in weights], [[g.cuda() for g in gs] for gs in grads])
    assert rel_err([g.cpu() for g in gpu], [c.double() for c in cpu], weights) < 1e-5
    for a, b in zip(cpu_opt.param_groups[0]["params"], gpu_opt.param_groups[0]["params"]):
        va, vb = cpu_opt.state[a]["normuon_v"], gpu_opt.state[b]["normuon_v"]
        assert vb.is_cuda and vb.dtype == torch.float32
        assert ((vb.cpu() - va).abs().max() / va.abs().max()).item() < 1e-5
    bf16, _ = run_fused(lambda ps: Muon(ps, lr=0.02, normuon=True), [w.cuda() for w in weights],
                        [[g.cuda() for g in gs] for gs in grads])  # the CUDA default: bf16 Newton-Schulz
    assert all(torch.isfinite(w).all() for w in bf16)


def test_normuon_off_leaves_muon_unchanged():
    weights, grads = weights_and_grads(2, steps=4)
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    default, default_opt = run_fused(lambda ps: Muon(ps, **kw), weights, grads)
    off, _ = run_fused(lambda ps: Muon(ps, normuon=False, **kw), weights, grads)

    def without_normuon_keys(ps):  # a param group saved before NorMuon existed
        opt = Muon(ps, **kw)
        for key in ("normuon", "normuon_beta2"):
            del opt.param_groups[0][key]
        return opt

    legacy, _ = run_fused(without_normuon_keys, weights, grads)
    for a, b, c in zip(default, off, legacy):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not any("normuon_v" in st for st in default_opt.state.values())
    assert default_opt.param_groups[0]["normuon"] is False


def test_normuon_hybrid_and_factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 11))
    opt = build_optimizer(model, "normuon", 0.02, adamw_lr=3e-3, normuon_beta2=0.9)
    muon_group, adamw_group = opt.param_groups
    assert muon_group["normuon"] is True and muon_group["normuon_beta2"] == 0.9
    assert "normuon" not in adamw_group
    assert build_optimizer(model, "muon", 0.02).param_groups[0]["normuon"] is False
    model(torch.randint(0, 11, (2, 5))).sum().backward()
    opt.step()
    assert opt.state[model[1].weight]["normuon_v"].shape == (8,)
    with pytest.raises(ValueError, match="name='normuon'"):
        build_optimizer(model, "muon", 0.02, normuon=True)


@pytest.mark.parametrize("kw, message", [
    (dict(normuon="yes"), "normuon must be True or False"),
    (dict(normuon=True, normuon_beta2=1.0), r"normuon_beta2 must be a float in \[0, 1\)"),
    (dict(normuon=True, normuon_beta2=float("nan")), "normuon_beta2"),
])
def test_bad_normuon_options_are_named(kw, message):
    with pytest.raises(NorMuonArgumentError, match=message):
        Muon([torch.zeros(4, 4, requires_grad=True)], **kw)


def _sharded_normuon_worker(weights, grads, out_path):
    from asyncpp_ext.pipeline import init_distributed

    init_distributed(60)
    torch.set_num_threads(1)
    import torch.distributed as dist

    waits = []

    @contextlib.contextmanager
    def record(what):  # a pipeline's watchdog: a stall inside is reported as waiting on a peer
        waits.append(what)
        yield

    def sharded(ps):
        opt = Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, normuon=True,
                   shard_group=dist.group.WORLD)
        opt.peer_wait = record
        return opt
    params, opt = run_fused(sharded, weights, grads)
    assert opt.orthogonalized_last_step < len(params)  # this rank really did only a share
    states = [opt.state[p]["normuon_v"] for p in opt.param_groups[0]["params"]]
    torch.save({"params": params, "v": states, "waits": waits}, f"{out_path}.{dist.get_rank()}")


@pytest.mark.multiproc
def test_sharded_normuon_equals_unsharded_on_every_rank(tmp_path):
    from asyncpp_ext.pipeline import spawn

    weights, grads = weights_and_grads(3, steps=3)
    spawn(_sharded_normuon_worker, 2, (weights, grads, str(tmp_path / "rank")))
    want, opt = run_fused(lambda ps: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, normuon=True),
                          weights, grads)
    want_v = [opt.state[p]["normuon_v"] for p in opt.param_groups[0]["params"]]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank.{rank}")
        # each step's all-gather marked as a wait on the other ranks
        assert got["waits"] == ["waiting for the sharded optimizer's all-gather of updates with the "
                                "data-parallel replicas"] * 3
        for a, b in zip(got["params"], want):
            assert torch.equal(a, b)
        for a, b in zip(got["v"], want_v):
            assert torch.equal(a, b)


# ---- the optional extra -------------------------------------------------------------------------

def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pytorch_optimizer", None)  # import now fails
    for name in LIBRARY:
        with pytest.raises(MissingExtraError, match=r"pip install 'asyncpp_ext\[study\]'") as info:
            check_available(name)
        assert name in str(info.value) and "pytorch-optimizer" in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(MissingExtraError, match=r"pip install 'asyncpp_ext\[study\]'"):
            build_optimizer(tiny_model(), name, 1e-3)
    for name in ("adamw", "muon", "normuon", "sgd"):  # the built-in optimizers need no extra
        check_available(name)


@needs_study
def test_unknown_keywords_and_names_are_rejected():
    with pytest.raises(library.LibraryOptimizerError, match="momentum"):
        build_optimizer(tiny_model(), "lion", 1e-4, momentum=0.9)
    with pytest.raises(library.LibraryOptimizerError, match="must be one of"):
        library.build_library_optimizer(tiny_model().named_parameters(), "adam", 1e-3, 0.0)
