"""The CPU kernels' worker pool (every chunk runs exactly once, on any thread count, from concurrent
callers and after fork) and the two bf16 Newton-Schulz paths (native and emulated)."""
import multiprocessing as mp
import threading

import pytest
import torch

from asyncpp_ext.optim import Muon, MuonHybrid, orthogonalize
from asyncpp_ext.optim import _kernels as K
from asyncpp_ext.optim import newton_schulz
from optim_reference import run

# 20 chunks of 2^15 elements: above the kernels' parallel threshold (8 chunks).
BIG = [(640, 512), (512, 640)]
LR, WD = 0.02, 0.1


def apply_once(params, updates, scale):
    K.apply_update(params, updates, [], [scale] * len(params), [], lr=LR, weight_decay=WD, ef_beta=0.0)


def expected_apply(w, u, scale):
    # The kernel's arithmetic, op for op in float32: D = W*(-lr*wd) + scale*U; W + D.
    neg_lr_wd = torch.tensor(-LR * WD, dtype=torch.float32)
    return w + (w * neg_lr_wd + torch.tensor(scale, dtype=torch.float32) * u)


def run_apply_rounds(rounds, seed, kernel_threads=None):
    """`rounds` apply_update calls on BIG, and what they must produce; kernel_threads: thread count
    for the kernel calls only (torch's own ops then run single-threaded)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in BIG]
    updates = [torch.randn(s, generator=gen) for s in BIG]
    want = [p.clone() for p in params]
    for r in range(rounds):
        scale = -0.01 * (r + 1)
        if kernel_threads is not None:
            torch.set_num_threads(kernel_threads)
        apply_once(params, updates, scale)
        if kernel_threads is not None:
            torch.set_num_threads(1)
        want = [expected_apply(w, u, scale) for w, u in zip(want, updates)]
    return params, want


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, 2, 4])
def test_every_chunk_runs_exactly_once(threads, n_threads):
    threads(n_threads)
    params, want = run_apply_rounds(30, seed=0)  # a chunk run twice or skipped shifts W by a whole step
    for p, w in zip(params, want):
        assert torch.equal(p, w)


def test_results_do_not_depend_on_thread_count(threads):
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(s, generator=gen) for s in BIG + [(300,)]]
    grads = [torch.randn_like(w) for w in weights]
    out = {}
    for n in (1, 2):
        threads(n)
        ps = [w.clone().requires_grad_() for w in weights]
        opt = MuonHybrid([(f"w{i}", p) for i, p in enumerate(ps)], ns_dtype=torch.float32)
        for _ in range(2):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        out[n] = [p.detach() for p in ps]
    assert all(torch.equal(a, b) for a, b in zip(out[1], out[2]))


def test_concurrent_callers_each_get_their_own_result(threads):
    threads(2)
    results = [None] * 4

    def worker(i):
        results[i] = run_apply_rounds(20, seed=10 + i)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    for params, want in results:
        assert all(torch.equal(p, w) for p, w in zip(params, want))


def _child_after_fork(queue):
    # torch's own parallel ops can hang in a forked child of a process that ran OpenMP teams (GNU
    # libgomp is not fork-safe), so the child runs torch single-threaded and only our pool with 2.
    torch.set_num_threads(1)
    params, want = run_apply_rounds(3, seed=3, kernel_threads=2)
    queue.put(all(torch.equal(p, w) for p, w in zip(params, want)))


def test_pool_works_in_a_forked_child(threads):
    threads(2)
    run_apply_rounds(2, seed=2)  # the parent's pool has helper threads now; the child has none
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child_after_fork, args=(q,))
    proc.start()
    proc.join(timeout=60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive, "the forked child hung in the kernels' worker pool"
    assert q.get(timeout=5) is True


SHAPES = [(24, 8), (8, 24), (16, 16), (64, 256), (256, 64)]


def test_bf16_native_and_emulated_agree():
    gen = torch.Generator().manual_seed(4)
    for s in SHAPES:
        v = torch.randn((2,) + s, generator=gen).bfloat16()
        norms = v.float().flatten(1).norm(dim=1)
        native = orthogonalize(v, norms, ns_dtype=torch.bfloat16, bf16_matmul="native").float()
        emulated = orthogonalize(v, norms, ns_dtype=torch.bfloat16, bf16_matmul="emulated").float()
        assert native.dtype == emulated.dtype
        # Same roundings, different float32 summation order: a few bf16 ulps (2^-8 relative) at most.
        assert ((native - emulated).abs().max() / emulated.abs().max()).item() < 2 ** -5


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("mode", ["native", "emulated"])
def test_muon_bf16_both_paths_match_torch_muon(monkeypatch, mode):
    """Each CPU bf16 path, forced by the environment variable as a user on any CPU can, agrees
    with torch.optim.Muon (which runs bf16 Newton-Schulz)."""
    monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, mode)
    gen = torch.Generator().manual_seed(5)
    shapes = [(24, 8), (8, 24), (16, 16), (24, 8)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours, _ = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw), weights, grads)
    ref, _ = run(lambda ps: torch.optim.Muon(ps, **kw), weights, grads)
    err = max(((o - r).abs().max() / (r - w).abs().max()).item() for o, r, w in zip(ours, ref, weights))
    assert err < 3e-2  # the same bound as test_optim_parity's bf16 test


@pytest.mark.parametrize("has_bf16_dot", [True, False])
def test_auto_follows_the_cpu_unless_the_environment_forces_a_path(monkeypatch, has_bf16_dot):
    monkeypatch.setattr(newton_schulz, "_cpu_has_bf16_dot", has_bf16_dot)
    monkeypatch.delenv(newton_schulz.BF16_MATMUL_ENV, raising=False)
    mode, reason = newton_schulz.bf16_matmul_choice()
    assert mode == ("native" if has_bf16_dot else "emulated") and reason.startswith("auto:")
    for forced in ("native", "emulated"):
        monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, forced.upper())
        assert newton_schulz.bf16_matmul_choice() == (forced, f"forced by ASYNCPP_BF16_MATMUL={forced}")
        assert newton_schulz.bf16_matmul_choice("native")[0] == "native"  # an explicit argument wins


def test_a_bad_bf16_matmul_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, "fast")
    v = torch.randn(1, 4, 8).bfloat16()
    with pytest.raises(ValueError, match=r"ASYNCPP_BF16_MATMUL='fast' is not one of auto, native, emulated"):
        orthogonalize(v, v.float().flatten(1).norm(dim=1), ns_dtype=torch.bfloat16)


def test_build_info_reports_the_bf16_path_and_an_invalid_setting_without_raising(monkeypatch):
    import asyncpp_ext

    monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, "emulated")
    info = asyncpp_ext.build_info()
    assert (info["bf16_matmul"], info["bf16_matmul_reason"]) == ("emulated", "forced by ASYNCPP_BF16_MATMUL=emulated")
    monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, "fast")
    info = asyncpp_ext.build_info()
    assert info["bf16_matmul"] is None and "ASYNCPP_BF16_MATMUL='fast'" in info["bf16_matmul_error"]


def test_bf16_matmul_mode_is_checked():
    v = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="bf16_matmul must be one of"):
        orthogonalize(v, v.flatten(1).norm(dim=1), bf16_matmul="fast")


NS_PATHS = [(torch.float32, "auto"), (torch.bfloat16, "native"), (torch.bfloat16, "emulated")]


@pytest.mark.parametrize("ns_dtype,bf16_matmul", NS_PATHS)
def test_newton_schulz_workspace_reuse_is_bitwise(monkeypatch, ns_dtype, bf16_matmul):
    """Buffers reused across calls (and the input reused as a buffer) change no bit of the result,
    and the input is left alone unless overwrite_input says otherwise."""
    monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, bf16_matmul)
    workspace = newton_schulz.Workspace()
    gen = torch.Generator().manual_seed(7)
    for s in SHAPES:
        for _ in range(2):  # the second call runs in the first call's buffers
            v = torch.randn((3,) + s, generator=gen).to(ns_dtype)
            before = v.clone()
            norms = v.float().flatten(1).norm(dim=1)
            want = orthogonalize(v, norms, ns_dtype=ns_dtype)
            got = orthogonalize(v, norms, ns_dtype=ns_dtype, workspace=workspace)
            assert torch.equal(v, before)
            assert torch.equal(got, want)
            reused = orthogonalize(v.clone(), norms, ns_dtype=ns_dtype, workspace=workspace,
                                   overwrite_input=True)
            assert torch.equal(reused, want)


def test_muon_groups_sharing_shapes_match_separate_optimizers():
    """Two Muon param groups with the same shapes share the workspace buffers within one step."""
    gen = torch.Generator().manual_seed(8)
    shapes = [(24, 8), (8, 24), (16, 16)]
    weights = [torch.randn(s, generator=gen) for s in shapes * 2]
    grads = [[torch.randn(w.shape, generator=gen) for w in weights] for _ in range(4)]

    def two_groups(ps):
        return Muon([dict(params=ps[:3]), dict(params=ps[3:], lr=0.05)], lr=0.02, weight_decay=WD)

    together, _ = run(two_groups, weights, grads)
    first, _ = run(lambda ps: Muon(ps, lr=0.02, weight_decay=WD), weights[:3], [g[:3] for g in grads])
    second, _ = run(lambda ps: Muon(ps, lr=0.05, weight_decay=WD), weights[3:], [g[3:] for g in grads])
    for got, want in zip(together, first + second):
        assert torch.equal(got, want)


@pytest.mark.parametrize("ns_dtype,bf16_matmul", NS_PATHS)
def test_workspace_holds_two_copies_of_the_matrices_plus_the_gram_buffers(monkeypatch, ns_dtype, bf16_matmul):
    """What Muon keeps between steps (reported by the pipeline's memory_report), per same-shape
    batch of B (rows x cols) matrices, r = min(rows, cols): the momentum output in the storage
    dtype (bf16 for bf16 NS, else float32) and one ping-pong buffer (B*rows*cols each), and the
    Gram and polynomial matrices (B*r*r each). Native bf16 and float32 NS keep all four in
    ns_dtype; emulated bf16 keeps the last three in float32 plus one more float32 B*rows*cols
    (the scaled input; the bf16 momentum output serves as its rounding scratch)."""
    monkeypatch.setenv(newton_schulz.BF16_MATMUL_ENV, bf16_matmul)
    shapes = [(24, 8), (8, 24), (16, 16), (24, 8)]
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = Muon(params, lr=0.02, ns_dtype=ns_dtype)
    opt.step()
    batches = {s: shapes.count(s) for s in shapes}
    size = torch.empty(0, dtype=ns_dtype).element_size()
    if bf16_matmul == "emulated":
        expected = sum(2 * b * r * c + 4 * (2 * b * r * c + 2 * b * min(r, c) ** 2)
                       for (r, c), b in batches.items())
    else:
        expected = sum(size * (2 * b * r * c + 2 * b * min(r, c) ** 2) for (r, c), b in batches.items())
    assert opt.workspace.nbytes() == expected
    opt.step()  # a second step reuses them
    assert opt.workspace.nbytes() == expected
