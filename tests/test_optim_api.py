"""Routing, the factory, state dicts, bad inputs and NaN/Inf handling of asyncpp_ext.optim."""
import copy
import re

import pytest
import torch
from torch import nn
from torch.utils.dlpack import to_dlpack

from asyncpp_ext._ext import C
from asyncpp_ext.optim import (AdamW, ErrorFeedback, Muon, MuonHybrid, NonFiniteGradientError,
                               build_optimizer, split_named_parameters)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)
        return x + self.out(torch.relu(self.fc(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(8, d))
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        return self.lm_head(self.ln_f(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]])))


def loss_of(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 32, (2, 8), generator=gen)
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())


def hidden_matrix_names(layers=2):
    return {f"blocks.{i}.{m}.weight" for i in range(layers) for m in ("qkv", "proj", "fc", "out")}


def test_hybrid_routing_on_gpt():
    model = TinyGPT()
    opt = build_optimizer(model, "muon", lr=0.02, weight_decay=0.01)
    groups = {g["algorithm"]: set(g["param_names"]) for g in opt.param_groups}
    assert groups["muon"] == hidden_matrix_names()
    assert groups["adamw"] == {n for n, _ in model.named_parameters()} - hidden_matrix_names()
    assert opt.param_groups[1]["lr"] == 3e-3  # the registry's adamw_lr of muon, as on the command line
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model).backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_routing_from_name_pairs_finds_a_top_level_head_like_the_module_rule():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.body = torch.nn.Linear(8, 8)
            self.head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 10))

    net = Net()
    from_module, from_pairs = split_named_parameters(net)[0], split_named_parameters(list(net.named_parameters()))[0]
    assert [n for n, _ in from_module] == [n for n, _ in from_pairs] == ["body.weight"]


def test_routing_on_a_pipeline_stage_and_overrides():
    model = TinyGPT()
    last_stage = nn.ModuleDict(dict(blocks=model.blocks[1:], ln_f=model.ln_f, lm_head=model.lm_head))
    opt = build_optimizer(last_stage, "muon", lr=0.02)
    groups = {g["algorithm"]: set(g["param_names"]) for g in opt.param_groups}
    assert groups["muon"] == {f"blocks.1.{m}.weight" for m in ("qkv", "proj", "fc", "out")}
    assert "lm_head.weight" in groups["adamw"]
    middle = build_optimizer(model.blocks[0], "muon", lr=0.02)  # no embedding, no head
    assert len(middle.param_groups) == 2
    forced = MuonHybrid(model, adamw_names=["blocks.0.qkv.weight"], muon_names=["lm_head.weight"])
    groups = {g["algorithm"]: set(g["param_names"]) for g in forced.param_groups}
    assert "blocks.0.qkv.weight" in groups["adamw"] and "lm_head.weight" in groups["muon"]
    with pytest.raises(ValueError, match="2-D"):
        MuonHybrid(model, muon_names=["ln_f.weight"])


@pytest.mark.parametrize("name", ["muon", "adamw", "sgd"])
def test_state_dict_round_trip_is_bitwise(name):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = build_optimizer(model, name, lr=0.01, weight_decay=0.01, ef_beta=0.5)
    for s in range(3):
        opt.zero_grad()
        loss_of(model, s).backward()
        opt.step()
    twin = copy.deepcopy(model)
    saved = copy.deepcopy(opt.state_dict())
    fresh = build_optimizer(twin, name, lr=0.01, weight_decay=0.01, ef_beta=0.5)
    fresh.load_state_dict(saved)
    keys = {k for st in opt.state.values() for k in st}
    assert "ef_buffer" in keys and ("step" in keys or name == "sgd")
    for s in range(3, 6):
        for m, o in ((model, opt), (twin, fresh)):
            o.zero_grad()
            loss_of(m, s).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def _one_step_then_gradients(name):
    """(model, optimizer, a check that nothing moved): one step taken, the next gradients in place."""
    model = TinyGPT()
    opt = build_optimizer(model, name, lr=0.01, ef_beta=0.5)
    loss_of(model).backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    loss_of(model, 1).backward()

    def nothing_moved():
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        after = opt.state_dict()
        for pid, st in state["state"].items():
            for k, v in st.items():
                assert torch.equal(v, after["state"][pid][k]) if torch.is_tensor(v) else v == after["state"][pid][k]
    return model, opt, nothing_moved


@pytest.mark.parametrize("name", ["muon", "adamw", "sgd"])
def test_nonfinite_gradient_raises_and_changes_nothing(name):
    model, opt, nothing_moved = _one_step_then_gradients(name)
    model.blocks[1].fc.weight.grad[3, 2] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"blocks\.1\.fc\.weight"):
        opt.step()
    model.blocks[1].fc.weight.grad.zero_()
    model.ln_f.bias.grad[0] = float("-inf")
    with pytest.raises(FloatingPointError, match=r"ln_f\.bias"):
        opt.step()
    nothing_moved()


def test_a_parameter_made_unfit_after_construction_is_refused_before_any_kernel_runs():
    """p.data swapped for a column-major view after the optimizer was built: the step refuses it,
    naming it, before the AdamW group or the Muon momentum move (no half-applied step)."""
    model, opt, nothing_moved = _one_step_then_gradients("muon")
    fc = model.blocks[1].fc.weight
    fc.data = fc.data.t().contiguous().t()  # same values, not contiguous
    with pytest.raises(ValueError, match=r"blocks\.1\.fc\.weight.*need contiguous parameters"):
        opt.step()
    nothing_moved()


def test_bad_arguments_are_named():
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"shape \(16,\).*AdamW"):
        Muon([model.ln_f.weight])
    for kwargs, word in ((dict(name="rmsprop", lr=0.1), "name"), (dict(name="adamw", lr=-1.0), "lr"),
                         (dict(name="muon", lr=0.0), "lr"), (dict(name="sgd", lr=0.1, momentum=1.0), "momentum"),
                         (dict(name="muon", lr=0.1, momentum=-0.1), "momentum"),
                         (dict(name="adamw", lr=0.1, weight_decay=-0.1), "weight_decay"),
                         (dict(name="muon", lr=0.1, ef_beta=-0.5), "ef_beta"),
                         (dict(name="muon", lr=0.1, adamw_lr=-3e-4), "adamw_lr"),
                         (dict(name="sgd", lr=0.1, ef_source="nope"), "ef_source")):  # no EF there: a typo still
        with pytest.raises(ValueError, match=word):
            build_optimizer(model, **kwargs)
    with pytest.raises(ValueError, match="beta"):
        ErrorFeedback(torch.optim.SGD(model.parameters(), lr=0.1), -1.0)
    with pytest.raises(ValueError, match="float32"):
        AdamW([nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    for bad in ((float("nan"), 1.0, 1.0), (1e30, 1.0, float("inf")), "abc", None, (1.0, 2.0)):
        with pytest.raises(ValueError, match="ns_coefficients must be three finite floats"):
            Muon([nn.Parameter(torch.zeros(3, 3))], ns_coefficients=bad)
    with pytest.raises(ValueError, match=r"no_decay_names must be a collection of parameter names, got the string "
                                         r"'0.bias'; pass \['0.bias'\]"):  # was read as its characters
        MuonHybrid(nn.Sequential(nn.Linear(3, 3)), no_decay_names="0.bias")
    for make in (AdamW, Muon):  # a group's lr changed after construction (a scheduler's bug): the kernel's check
        weight = nn.Parameter(torch.zeros(3, 3))
        weight.grad = torch.ones(3, 3)
        opt = make([weight])
        opt.param_groups[0]["lr"] = -1.0
        with pytest.raises(ValueError, match=r"^lr must be >= 0, got -1$"):  # without the C++ source location
            opt.step()
    for bad in (0.9, None, (0.9,)):  # not a pair: the group's line, not tuple()'s TypeError
        with pytest.raises(ValueError, match=re.escape(f"betas must be two floats in [0, 1), got {bad!r}")):
            AdamW([nn.Parameter(torch.zeros(3))], betas=bad)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got inf"):
        Muon([nn.Parameter(torch.zeros(3, 3))], eps=float("inf"))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got inf"):
        AdamW([nn.Parameter(torch.zeros(3))], eps=float("inf"))
    with pytest.raises(ValueError, match="nesterov must be True or False, got 'no'"):
        Muon([nn.Parameter(torch.zeros(3, 3))], nesterov="no")


def test_a_state_of_another_optimizer_or_with_a_key_missing_is_named_when_loaded():
    model = nn.Linear(4, 3, bias=False)
    model.weight.grad = torch.ones_like(model.weight)
    theirs = torch.optim.AdamW(model.parameters())
    theirs.step()
    with pytest.raises(ValueError, match="param group 0 of the state has no 'algorithm' .* this AdamW runs 'adamw'"):
        AdamW(model.parameters()).load_state_dict(theirs.state_dict())
    with pytest.raises(ValueError, match="param group 0 of the state has the algorithm 'adamw' where this Muon runs 'muon'"):
        Muon(model.parameters()).load_state_dict(AdamW(model.parameters()).state_dict())
    state = AdamW(model.parameters()).state_dict()
    del state["param_groups"][0]["betas"]
    with pytest.raises(ValueError, match="param group 0 of the state has no 'betas'; load a state saved by AdamW"):
        AdamW(model.parameters()).load_state_dict(state)
    state = AdamW(model.parameters(), lr=0.5).state_dict()
    state["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be a finite float > 0, got -1.0"):
        AdamW(model.parameters()).load_state_dict(state)


def test_kernel_bindings_name_the_bad_argument():
    p, g, m, v = (torch.zeros(4, 4) for _ in range(4))
    k = C.optim
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        k.adamw_step([to_dlpack(p)], [to_dlpack(torch.zeros(5))], [to_dlpack(m)], [to_dlpack(v)], [], [1], [],
                     0.1, 0.9, 0.999, 1e-8, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\].*contiguous"):
        k.adamw_step([to_dlpack(p)], [to_dlpack(g)], [to_dlpack(torch.zeros(4, 4).T)], [to_dlpack(v)], [], [1],
                     [], 0.1, 0.9, 0.999, 1e-8, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"momentum_bufs\[0\].*float32"):
        k.muon_momentum([to_dlpack(g)], [to_dlpack(torch.zeros(4, 4, dtype=torch.float64))], [to_dlpack(m)],
                        0.9, True)
    with pytest.raises(ValueError, match="ef_bufs"):
        k.apply_update([to_dlpack(p)], [to_dlpack(g)], [], [-0.1], [], 0.1, 0.0, 0.5)
    with pytest.raises(ValueError, match="steps"):
        k.adamw_step([to_dlpack(p)], [to_dlpack(g)], [to_dlpack(m)], [to_dlpack(v)], [], [0], [],
                     0.1, 0.9, 0.999, 1e-8, 0.0, 0.0)
    # Views hold their shape inline (no allocation per message): more than 8 dimensions is refused.
    with pytest.raises(ValueError, match=r"tensors\[0\]: tensors of 9 dimensions are not supported \(at most 8\)"):
        k.first_nonfinite([to_dlpack(torch.zeros([1] * 9))], 0)
    assert k.first_nonfinite([to_dlpack(torch.zeros([1] * 8))], 0) == -1


def _nonfinite_cases():
    """Lists of tensors with a NaN or Inf at various places (and none), with the index expected."""
    for where, value in ((None, 0.0), (0, float("nan")), (2, float("inf")), (4, float("-inf"))):
        ts = [torch.randn(n) for n in (3, 70_000, 5, 1, 130_001)]  # chunks of one tensor and of several
        if where is not None:
            ts[where][-1] = value
        yield ts, -1 if where is None else where
    yield [], -1
    for bad, first in (((559, 300, 45), 45), ((257, 1), 1), ((599,), 599)):  # more tensors than the
        ts = [torch.zeros(1) for _ in range(600)]                             # flag kernel's threads,
        for i in bad:                                                          # several bad: the least
            ts[i][0] = float("nan")
        yield ts, first


def _flag_of(tensors, device="cpu"):
    from asyncpp_ext.optim import _kernels as K
    flag = torch.full((1,), 99, dtype=torch.int32, device=device)
    K.nonfinite_flag([t.to(device) for t in tensors], flag)
    return int(flag[0])


def test_nonfinite_flag_writes_the_first_bad_index_or_minus_one():
    from asyncpp_ext.optim import _kernels as K
    for ts, want in _nonfinite_cases():
        assert _flag_of(ts) == want == K.first_nonfinite(ts)
    k = C.optim
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="flag: expected dtype int32, got float32"):
        k.nonfinite_flag([to_dlpack(x)], to_dlpack(torch.zeros(1)))
    with pytest.raises(ValueError, match="flag: expected one int32 element, got 2"):
        k.nonfinite_flag([to_dlpack(x)], to_dlpack(torch.zeros(2, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"tensors\[0\]: expected dtype float32"):
        k.nonfinite_flag([to_dlpack(x.double())], to_dlpack(torch.zeros(1, dtype=torch.int32)))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="flag: on CUDA device 0 but tensors.0. is on the CPU"):
            k.nonfinite_flag([to_dlpack(x)], to_dlpack(torch.zeros(1, dtype=torch.int32, device="cuda")))
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    with pytest.raises(ValueError, match="skip: expected one int32 element"):
        k.adamw_step([to_dlpack(p)], [to_dlpack(g)], [to_dlpack(m)], [to_dlpack(v)], [], [1], [],
                     0.1, 0.9, 0.999, 1e-8, 0.0, 0.0, 0, [], [], to_dlpack(torch.zeros(2, dtype=torch.int32)))
    with pytest.raises(ValueError, match="skip: expected dtype int32, got int64"):
        k.apply_update([to_dlpack(p)], [to_dlpack(g)], [], [-0.1], [], 0.1, 0.0, 0.0, 0, [], [],
                       to_dlpack(torch.zeros(1, dtype=torch.int64)))


def _skip_flagged_steps(name, device):
    """One model stepped four times with skip= flags (-1, 3, -1, -1 as the scan would have said) and
    a copy stepped three times without: the flagged step changes nothing on the device."""
    torch.manual_seed(0)
    a = TinyGPT().to(device)
    b = copy.deepcopy(a)
    oa, ob = (build_optimizer(m, name, ef_beta=0.5) for m in (a, b))
    for step, flagged in enumerate((-1, 3, -1, -1)):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.manual_seed(step * 1000 + pa.numel())
            pa.grad = torch.randn_like(pa)
            pb.grad = pa.grad.clone()
        undo = oa.step_from(None, None, skip=torch.full((1,), flagged, dtype=torch.int32, device=device))
        if flagged >= 0:
            undo()
        else:
            ob.step()
    return a, b, oa, ob


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_flagged_step_changes_nothing_and_the_others_are_plain_steps(name):
    a, b, oa, ob = _skip_flagged_steps(name, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for x, y in zip(a.parameters(), b.parameters()):
        assert oa.state[x].keys() == ob.state[y].keys()
        for key, val in oa.state[x].items():
            assert torch.equal(val, ob.state[y][key]) if torch.is_tensor(val) else val == ob.state[y][key], key


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_cuda_nonfinite_flag_and_a_flagged_step_on_the_device(name):
    """The device's scan (the flag kernel's least index across threads) and the kernels' skip,
    read on the GPU as they run."""
    for ts, want in _nonfinite_cases():
        assert _flag_of(ts, "cuda") == want
    a, b, oa, ob = _skip_flagged_steps(name, "cuda")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for x, y in zip(a.parameters(), b.parameters()):
        for key, val in oa.state[x].items():
            assert torch.equal(val, ob.state[y][key]) if torch.is_tensor(val) else val == ob.state[y][key], key


def _step_both_on_cpu_gradients(name, steps=4, **kw):
    """A CPU model and a CUDA copy stepped by the same optimizer config on the SAME gradients: each
    step's gradients are computed once on CPU and copied to the GPU, so any difference comes from the
    optimizer alone (a GPU forward/backward would differ from the CPU's by cuBLAS rounding, which
    AdamW's first steps, update ~ g / (|g| + eps), amplify)."""
    torch.manual_seed(0)
    cpu_model = TinyGPT()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    start = [p.detach().clone() for p in cpu_model.parameters()]
    opts = [build_optimizer(m, name, lr=0.01, weight_decay=0.01, ef_beta=0.5, **kw) for m in (cpu_model, gpu_model)]
    for s in range(steps):
        opts[0].zero_grad()
        loss_of(cpu_model, s).backward()
        for a, b in zip(cpu_model.parameters(), gpu_model.parameters()):
            b.grad = a.grad.cuda()
        for o in opts:
            o.step()
    return cpu_model, gpu_model, opts, start


def _state_pairs(opts, cpu_model, gpu_model):
    for a, b in zip(cpu_model.parameters(), gpu_model.parameters()):
        yield a, opts[0].state[a], opts[1].state[b]


@pytest.mark.cuda
def test_cuda_adamw_with_ef_is_bitwise_the_cpu_kernel():
    """Elementwise kernels share optim_math.h with the CPU loops and are built with --fmad=false
    (CPU: -ffp-contract=off): on the same inputs every parameter and state bit must agree."""
    cpu_model, gpu_model, opts, _ = _step_both_on_cpu_gradients("adamw")
    for (na, a), b in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        assert torch.equal(a.detach(), b.detach().cpu()), na
    for a, st_cpu, st_gpu in _state_pairs(opts, cpu_model, gpu_model):
        assert set(st_cpu) == set(st_gpu) and {"exp_avg", "exp_avg_sq", "ef_buffer"} <= set(st_cpu)
        for k, v in st_cpu.items():
            assert torch.equal(v, st_gpu[k].cpu()) if torch.is_tensor(v) else v == st_gpu[k], k
    gpu_model.lm_head.weight.grad.fill_(float("nan"))
    with pytest.raises(NonFiniteGradientError):
        opts[1].step()


@pytest.mark.cuda
def test_cuda_muon_with_ef_matches_cpu():
    """Bitwise: the AdamW-routed parameters and their state, and Muon's momentum buffers (the
    momentum kernel is elementwise, and depends only on the gradients). Not bitwise: Newton-Schulz
    (cuBLAS vs CPU BLAS sum in different orders; fp32 here, TF32 off) and the Frobenius norm that
    scales its input (per-chunk partials on the GPU vs 8 lanes on CPU), hence the Muon-routed
    weights and EF buffers. Bound: after 4 steps, max |W_gpu - W_cpu| <= 1e-5 of max |W_cpu - W_0|
    (how far the weights moved): float32 rounding (6e-8) amplified by the NS polynomial (up to
    ~a^5 = 480x along small singular values) is ~3e-5 at worst per element, far less in the norm."""
    assert not torch.backends.cuda.matmul.allow_tf32
    cpu_model, gpu_model, opts, start = _step_both_on_cpu_gradients("muon", ns_dtype=torch.float32)
    muon_names = hidden_matrix_names()
    moved = max((a.detach() - s).abs().max().item()
                for (n, a), s in zip(cpu_model.named_parameters(), start) if n in muon_names)
    for (n, a), b in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        if n in muon_names:
            diff = (a.detach() - b.detach().cpu()).abs().max().item()
            assert diff <= 1e-5 * moved, (n, diff, moved)
        else:
            assert torch.equal(a.detach(), b.detach().cpu()), n
    for a, st_cpu, st_gpu in _state_pairs(opts, cpu_model, gpu_model):
        for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if k in st_cpu:
                assert torch.equal(st_cpu[k], st_gpu[k].cpu()), k


@pytest.mark.cuda
def test_cuda_momentum_norms_are_deterministic_and_match_cpu():
    """Per-chunk partials summed in chunk order: the same bits on every call (replicas that
    orthogonalise their own copies stay identical), and the CPU's value to float rounding."""
    from asyncpp_ext.optim import _kernels as K

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=gen) for s in [(1024, 1024), (4096, 300), (7,)]]

    def norms(device):
        g = [t.to(device) for t in grads]
        bufs = [torch.zeros_like(t) for t in g]
        outs = [torch.empty(t.shape, dtype=torch.bfloat16, device=device) for t in g]
        sumsq = torch.empty(len(g), device=device)
        K.muon_momentum(g, bufs, outs, momentum=0.9, nesterov=True, sumsq=sumsq)
        return sumsq.cpu()

    first, second, cpu = norms("cuda"), norms("cuda"), norms("cpu")
    assert torch.equal(first, second)
    assert torch.allclose(first, cpu, rtol=1e-5, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_kernels_run_on_the_tensors_device_not_the_current_one():
    from asyncpp_ext.optim import AdamW

    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(300, 200, generator=gen)
    results = []
    for device in ("cpu", "cuda:1"):
        p = w.clone().to(device).requires_grad_()
        p.grad = torch.ones_like(p)
        AdamW([p], lr=0.1).step()
        results.append(p.detach().cpu())
    assert torch.allclose(results[0], results[1], rtol=1e-6, atol=1e-7)


def asyncpp_ext_cuda_devices() -> int:
    from asyncpp_ext._ext import C

    return C.cuda_device_count()


@pytest.mark.skipif(torch.cuda.is_available() and asyncpp_ext_cuda_devices() > 0,
                    reason="the CUDA kernels can run here")
def test_cuda_kernels_that_cannot_run_say_why_and_how_to_fix(monkeypatch):
    """torch sees a GPU but our kernels do not (e.g. built with a CUDA newer than the driver):
    the first CUDA call names the cause and the fix instead of failing inside a launch."""
    from asyncpp_ext.optim import _kernels

    monkeypatch.setattr(_kernels, "_cuda_usable", None)
    with pytest.raises(RuntimeError) as info:
        _kernels._check_cuda_kernels()
    message = str(info.value)
    assert message.startswith("asyncpp_ext's CUDA kernels cannot run here: ")
    assert "rebuild asyncpp_ext with a CUDA toolkit the installed driver supports" in message
    assert f"while torch uses CUDA {torch.version.cuda}" in message


def test_check_finite_off_leaves_the_scan_to_the_caller():
    p = torch.zeros(4, 4, requires_grad=True)
    p.grad = torch.full((4, 4), float("nan"))
    opt = Muon([p], lr=0.02)
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(4, 4))
    opt.check_finite = False  # e.g. the pipeline's guard already verified these gradients
    opt.step()
    assert torch.isnan(p.detach()).all()


# Awkward sizes: 1 element, odd lengths around the kernels' vector width and block size, a 2-D
# matrix with odd sides, and one over a million elements (several blocks per tensor).
AWKWARD_SHAPES = [(1,), (7,), (1023,), (4097,), (257, 129), ((1 << 20) + 3,)]


def _random_kernel_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    new = lambda: [torch.randn(s, generator=gen) for s in AWKWARD_SHAPES]  # noqa: E731
    return dict(p=new(), g=new(), m=new(), v=[t.abs() for t in new()], e=new())


def _run_kernels(device, seed=5):
    """Every CUDA-capable kernel once on `device`; returns the outputs (on CPU) by name."""
    from asyncpp_ext.optim import _kernels as K

    t = {k: [x.to(device) for x in v] for k, v in _random_kernel_inputs(seed).items()}
    n = len(AWKWARD_SHAPES)
    first = [i % 2 == 0 for i in range(n)]  # EF buffers: half take the first-step path
    K.adamw_step(t["p"], t["g"], t["m"], t["v"], t["e"], [1 + i for i in range(n)], first, lr=1e-3, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.01, ef_beta=0.5)
    out16 = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in AWKWARD_SHAPES]
    out32 = [torch.empty(s, device=device) for s in AWKWARD_SHAPES]
    sumsq16, sumsq32 = torch.empty(n, device=device), torch.empty(n, device=device)
    K.muon_momentum(t["g"], t["m"], out16, momentum=0.95, nesterov=True, sumsq=sumsq16)
    K.muon_momentum(t["g"], t["m"], out32, momentum=0.9, nesterov=False, sumsq=sumsq32)
    scales = [-0.02 * (i + 1) for i in range(n)]
    K.apply_update(t["p"], out16, t["e"], scales, [not f for f in first], lr=0.02, weight_decay=0.1, ef_beta=0.5)
    p_no_ef = [x.clone() for x in t["p"]]
    K.apply_update(p_no_ef, out32, [], scales, [], lr=0.02, weight_decay=0.1, ef_beta=0.0)
    scans = []
    for where in (None, (0, 0), (3, 4096), (5, (1 << 20) + 2)):
        probe = [x.clone() for x in t["g"]]
        if where:
            probe[where[0]].view(-1)[where[1]] = float("nan") if where[0] != 3 else float("-inf")
        scans.append(K.first_nonfinite(probe))
    cpu = lambda xs: [x.cpu() for x in xs]  # noqa: E731
    return dict(params=cpu(t["p"]), exp_avg=cpu(t["m"]), exp_avg_sq=cpu(t["v"]), ef=cpu(t["e"]),
                out_bf16=cpu(out16), out_fp32=cpu(out32), params_no_ef=cpu(p_no_ef),
                sumsq=[sumsq16.cpu(), sumsq32.cpu()], scans=scans)


@pytest.mark.cuda
def test_cuda_kernels_are_bitwise_the_cpu_kernels_on_awkward_sizes():
    """Direct kernel calls, CPU vs CUDA on identical random inputs. Everything elementwise must be
    bit-identical (shared optim_math.h, no FMA contraction on either side). The momentum kernel's
    sums of squares are reductions whose order differs (8 fixed lanes on CPU, per-chunk partials
    on the GPU): each is asserted to float32 summation rounding (rel 1e-5), and deterministic."""
    cpu, gpu, again = _run_kernels("cpu"), _run_kernels("cuda"), _run_kernels("cuda")
    for name in ("params", "exp_avg", "exp_avg_sq", "ef", "out_bf16", "out_fp32", "params_no_ef"):
        for shape, a, b in zip(AWKWARD_SHAPES, cpu[name], gpu[name]):
            assert torch.equal(a, b), f"{name} {shape}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert cpu["scans"] == gpu["scans"] == [-1, 0, 3, 5]
    for a, b, c in zip(cpu["sumsq"], gpu["sumsq"], again["sumsq"]):
        assert torch.equal(b, c)
        assert torch.allclose(a, b, rtol=1e-5, atol=0), (a, b)


def test_orthogonalize_names_a_bad_argument():
    from asyncpp_ext.optim import orthogonalize

    v = torch.randn(2, 4, 3)
    norms = v.flatten(1).norm(dim=1)
    for args, kwargs, match in [
            ((torch.randn(4, 3), norms), {}, r"v must be a \(batch, rows, cols\) floating-point tensor .* got 2-D"),
            ((torch.ones(1, 4, 3, dtype=torch.int64), torch.ones(1)), {}, "got 3-D torch.int64"),
            ((v, torch.ones(3)), {}, r"norms must hold one Frobenius norm per matrix, shape \(2,\), got \(3,\)"),
            ((v, None), {}, "got NoneType"),
            ((v, norms), {"steps": -1}, "steps must be an integer >= 0, got -1"),
            ((v, norms), {"ns_dtype": torch.float16}, "ns_dtype must be torch.float32 or torch.bfloat16"),
            ((v, norms), {"eps": -1.0}, "eps must be a finite number >= 0, got -1.0")]:
        with pytest.raises(ValueError, match=match):
            orthogonalize(*args, **kwargs)
    assert orthogonalize(v, norms).shape == v.shape
