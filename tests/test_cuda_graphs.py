"""--cuda-graphs (models/graphs.py): the slot bookkeeping, clones, gradients and fallback, checked on
CPU with an eager stand-in for torch.cuda.make_graphed_callables that keeps its contract (static
inputs copied in, an output a later replay of the same slot overwrites); the stage host and the
simulator wired through it; the refusals; and on a GPU the real capture against eager."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn

from asyncpp_ext.models.graphs import GraphedCompute
from asyncpp_ext.pipeline.stage import StageHost

M = 4


class FakeGraphs:
    """make_graphed_callables' contract, eagerly, static buffers included: the slot's forward
    copies its arguments into the sample (static) tensors and returns its output in a buffer the
    next call of the same slot overwrites; its backward returns the gradients of the arguments and
    Parameters in buffers the next backward of the slot overwrites (torch returns ``.detach()``
    views of the graph's static tensors), computed from the static inputs."""

    def __init__(self):
        self.captures = []

    def __call__(self, slot, sample, num_warmup_iters=3, allow_unused_input=False):
        assert all(isinstance(a, torch.Tensor) for a in sample)
        run, params, n = slot.forward, tuple(slot.parameters()), len(sample)
        # torch's warm-up: forward and gradients of every grad-requiring input, where a Parameter
        # the call does not use fails the capture unless allow_unused_input
        out = run(*sample)
        torch.autograd.grad(out, [x for x in (*sample, *params) if x.requires_grad], torch.ones_like(out),
                            allow_unused=allow_unused_input)
        self.captures.append(sample)
        static = {"out": None, "grads": None}

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for s, a in zip(sample, inputs[:n]):
                    s.copy_(a)
                with torch.enable_grad():
                    ctx.xs = tuple(s.detach().requires_grad_(s.requires_grad) for s in sample)
                    ctx.out = run(*ctx.xs)
                if static["out"] is None:
                    static["out"] = torch.empty_like(ctx.out)
                static["out"].copy_(ctx.out.detach())
                return static["out"].detach()

            @staticmethod
            def backward(ctx, grad):
                wanted = [x for x in ctx.xs if x.requires_grad] + list(params)
                got = torch.autograd.grad(ctx.out, wanted, grad, allow_unused=allow_unused_input)
                if static["grads"] is None:
                    static["grads"] = [None if g is None else torch.empty_like(g) for g in got]
                for buf, g in zip(static["grads"], got):
                    if g is not None:
                        buf.copy_(g)
                views = iter(None if buf is None else buf.detach() for buf in static["grads"])
                return tuple([next(views) if x.requires_grad else None for x in ctx.xs] + [next(views) for _ in params])

        slot.forward = lambda *args: Replay.apply(*args, *params)
        return slot


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _loss(module, x, y):
    return nn.functional.mse_loss(module(x), y)


def _data(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)) for _ in range(n)]


def test_one_slot_per_microbatch_in_flight_and_outputs_survive_later_replays():
    module, fake = _mlp(), FakeGraphs()
    graphed = GraphedCompute(module, _loss, make=fake)
    (x0, y0), (x1, y1), (x2, y2) = _data()
    a = graphed(x0.requires_grad_(), y0)
    b = graphed(x1.requires_grad_(), y1)         # a is still in flight: a second slot
    assert len(fake.captures) == 2 and all(s.busy for s in graphed.slots)
    assert fake.captures[0][0] is not x0 and torch.equal(fake.captures[0][0], x0)  # its own static copy
    a.backward()
    c = graphed(x2.requires_grad_(), y2)         # a's slot is free again: reused
    assert len(fake.captures) == 2
    assert math.isfinite(a.item()) and a.item() == _loss(module, x0, y0).item()  # a clone: not overwritten
    b.backward()
    c.backward()
    reference = copy.deepcopy(module)
    for p in reference.parameters():
        p.grad = None
    inputs = [x.detach().clone().requires_grad_() for x, _ in _data()]
    for xr, (_, y) in zip(inputs, _data()):
        _loss(reference, xr, y).backward()
    for got, want in zip(module.parameters(), reference.parameters()):
        assert torch.allclose(got.grad, want.grad, atol=1e-7)
    for x, xr in zip((x0, x1, x2), inputs):  # the input gradients reach the caller's tensors
        assert torch.allclose(x.grad, xr.grad, atol=1e-7)


def test_a_parameter_the_stage_does_not_use_is_captured_and_gets_no_gradient():
    # torch's capture refuses a Parameter without a gradient unless allow_unused_input; a stage
    # may hold one (a spare bias, a table only evaluation reads), and eager simply leaves it be:
    # no .grad, so an optimizer with weight decay skips it. So must the replays.
    module = _mlp()
    module.spare = nn.Parameter(torch.ones(3))
    reference = copy.deepcopy(module)
    fake = FakeGraphs()
    graphed = GraphedCompute(module, _loss_ignoring, make=fake)
    unused_arg = torch.zeros(1, requires_grad=True)  # an argument the computation ignores
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (module, reference)]
    for x, y in _data(2):
        x_grads = []
        for m, run, opt in ((module, graphed, optimizers[0]), (reference, None, optimizers[1])):
            xs = [x.clone().requires_grad_() for _ in range(2)]  # two microbatches, leaf inputs
            for xb in xs:
                (run(xb, y, unused_arg) if run else _loss_ignoring(m, xb, y, unused_arg)).backward()
            if m is module:
                assert module.spare.grad is None and unused_arg.grad is None  # as eager leaves them
            x_grads.append([xb.grad for xb in xs])
            opt.step()
            opt.zero_grad(set_to_none=True)
        for got, want in zip(*x_grads):  # the leaf inputs' gradients, as eager's
            assert torch.allclose(got, want, atol=1e-7)
    assert graphed.failure is None and len(fake.captures) == 1
    assert torch.equal(module.spare, reference.spare) and torch.equal(module.spare, torch.ones(3))  # never stepped
    for got, want in zip(module.parameters(), reference.parameters()):
        assert torch.allclose(got, want, atol=1e-6)


def test_what_one_slot_leaves_without_a_gradient_another_may_use():
    # Each slot is a capture of its own: the structure may differ between them (a flag, a routing
    # decision). The second slot's computation uses the spare parameter the first's does not; its
    # gradient must accumulate into .grad like any other, not be adopted from the slot's buffer
    # (which the slot's next replay would overwrite: the sum would come out doubled).
    def loss(module, x, y):
        out = _loss(module, x, y)
        return out + module.spare.sum() * x.sum() if module.use_spare else out

    module = _mlp()
    module.spare = nn.Parameter(torch.ones(3))
    reference = copy.deepcopy(module)
    graphed = GraphedCompute(module, loss, make=FakeGraphs())
    (x0, y0), (x1, y1), (x2, y2) = _data()
    # (the stand-in replays by running the code again: the flag is set as each slot was captured)
    module.use_spare = False
    first = graphed(x0, y0)                 # slot 1: no spare
    module.use_spare = True
    second = graphed(x1, y1)                # slot 1 in flight: slot 2, with the spare
    first.backward()
    second.backward()
    module.use_spare = False
    third = graphed(x2, y2)                 # slot 1 again (free first): no spare
    module.use_spare = True
    fourth = graphed(x0, y0)                # slot 2 again (slot 1 in flight)
    third.backward()
    fourth.backward()
    assert [s.no_grad_params for s in graphed.slots] == [frozenset({id(module.spare)}), frozenset()]
    assert len(graphed.slots) == 2
    for use, (x, y) in ((False, (x0, y0)), (True, (x1, y1)), (False, (x2, y2)), (True, (x0, y0))):
        reference.use_spare = use
        loss(reference, x, y).backward()
    assert torch.allclose(module.spare.grad, reference.spare.grad, atol=1e-6)
    for got, want in zip(module.parameters(), reference.parameters()):
        assert torch.allclose(got.grad, want.grad, atol=1e-6)


def _loss_ignoring(module, x, y, ignored):
    return _loss(module, x, y)


def test_no_grad_calls_run_eagerly_and_a_failed_capture_warns_once():
    module, fake = _mlp(), FakeGraphs()
    graphed = GraphedCompute(module, _loss, make=fake)
    (x, y), = _data(1)
    with torch.no_grad():
        assert graphed(x, y).item() == _loss(module, x, y).item()
    assert fake.captures == []

    def refuse(slot, sample, num_warmup_iters=3, allow_unused_input=False):
        raise RuntimeError("make_graphed_callables does not support the autocast caching.\nmore")
    broken = GraphedCompute(module, _loss, make=refuse)
    with pytest.warns(UserWarning, match=r"CUDA-graph capture failed \(RuntimeError: make_graphed_callables "
                                         r"does not support the autocast caching\.\); this stage runs without"):
        loss = broken(x, y)
    assert loss.item() == _loss(module, x, y).item() and broken.failure.startswith("RuntimeError")
    broken(x, y)  # no second attempt, no second warning (pytest's warning filter would raise)


def test_a_failed_capture_puts_the_thread_back_on_the_callers_stream(monkeypatch):
    # torch.cuda.graph leaves a failed capture on its side stream; the capture's guard restores the
    # caller's and waits for the side stream's work, only on CUDA. torch.cuda's stream calls recorded.
    from asyncpp_ext.models import graphs

    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "caller")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: calls.append(("set_stream", s)))
    with pytest.raises(RuntimeError, match="capture invalidated"):
        with graphs._callers_stream_kept(True):
            raise RuntimeError("capture invalidated")
    assert calls == [("set_stream", "caller"), "synchronize"]
    calls.clear()
    with graphs._callers_stream_kept(True):  # a capture that succeeds: torch restored the stream
        pass
    with pytest.raises(RuntimeError):
        with graphs._callers_stream_kept(False):  # CPU: no stream to restore
            raise RuntimeError("refused")
    assert calls == []


def test_the_fused_head_under_graphs_runs_the_kernel_that_captures():
    # Liger's forward reads a count to the host (.item()), which capture refuses: under --cuda-graphs
    # "auto" means the package's chunked kernel and a library kernel by name is refused.
    from asyncpp_ext.models.head_loss import kernel_for_graphs

    assert [kernel_for_graphs(k, True) for k in ("auto", "chunked")] == ["chunked", "chunked"]
    assert [kernel_for_graphs(k, False) for k in ("auto", "liger", "cce")] == ["auto", "liger", "cce"]
    for kernel in ("liger", "cce"):
        with pytest.raises(ValueError, match=f"head-loss kernel '{kernel}' cannot be captured in a CUDA graph"):
            kernel_for_graphs(kernel, True)
    host, _ = _host(True, FakeGraphs(), head_loss="fused")
    assert host.head_loss_kernel == "chunked"
    assert _host(False, None, head_loss="fused")[0].head_loss_kernel == "auto"
    from asyncpp_ext.training.stage_compute import stage_compute  # the simulator's and the CLI's choice
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig.from_dict({"model": {"vocab_size": 49152}, "train": {"cuda_graphs": True, "compile": False}})
    assert (stage_compute(cfg, "cpu").head_loss, stage_compute(cfg, "cpu").kernel) == ("fused", "chunked")
    # --head-loss chunked: the chunked kernel with graphs and without, at any vocabulary size
    for graphs in (True, False):
        cfg = RunConfig.from_dict({"train": {"cuda_graphs": graphs, "compile": False, "head_loss": "chunked"}})
        assert (stage_compute(cfg, "cpu").head_loss, stage_compute(cfg, "cpu").kernel) == ("fused", "chunked")


@pytest.mark.parametrize("device, schedule, flag, extra, want", [
    ("cuda", "sync", None, {}, True),                    # auto: the one-process reference run on a GPU
    ("cpu", "sync", None, {}, False),                    # no graphs off CUDA
    ("cuda", "2bw", None, {}, False),                    # pipelines and their simulations: only when asked
    ("cuda", "1f1b", None, {}, False),
    ("cuda", "sync", None, {"recompute": True}, False),  # a graph replays a forward with its backward
    ("cuda", "sync", None, {"head_loss": "liger"}, False),  # cannot be captured
    ("cuda", "sync", None, {"head_loss": "cce"}, False),
    ("cuda", "sync", None, {"head_loss": "chunked"}, True),  # the kernel graphs capture
    ("cuda", "sync", False, {}, False),                  # an explicit choice stands
    ("cuda", "2bw", True, {}, True),
])
def test_cuda_graphs_auto_is_on_for_the_sync_run_on_cuda_only(device, schedule, flag, extra, want):
    from asyncpp_ext.training.stage_compute import resolve_cuda_graphs, stage_compute
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig.from_dict({"model": {"vocab_size": 49152}, "train": {"cuda_graphs": flag, "compile": False},
                               "pipeline": {"schedule": schedule}})
    cfg.pipeline.recompute = extra.get("recompute", False)
    cfg.train.head_loss = extra.get("head_loss", "auto")
    assert resolve_cuda_graphs(cfg, device) is want
    if not extra:  # what the run builds from it: graphs, and the head kernel they capture
        compute = stage_compute(cfg, device)
        assert (compute.cuda_graphs, compute.kernel) == (want, "chunked" if want else "auto")


def _host(cuda_graphs, make, **kw):
    torch.manual_seed(0)
    data = _data(M)
    batch = ([x for x, _ in data], [y for _, y in data])
    host = StageHost(_mlp(), stage=1, stages=2, schedule="2bw", microbatches=M,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     loss_fn=nn.functional.mse_loss, batch_source=lambda step: batch, cuda_graphs=cuda_graphs, **kw)
    if host.graphs is not None:
        for g in host.graphs.values():
            g.make = make
    return host, batch


@pytest.mark.parametrize("kw", [{}, {"autocast_dtype": torch.bfloat16}], ids=["fp32", "bf16-compute-copies"])
def test_stage_host_replays_per_replica_and_matches_eager(kw):
    """Graphed (on the replicas, or in bf16 on their compute copies) against eager (autocast's casts)."""
    fake = FakeGraphs()
    runs = []
    for graphs in (False, True):
        copies = graphs and bool(kw)
        host, (inputs, _) = _host(graphs, fake, compute_copies=copies, **kw)
        assert (host.copies is not None) == copies
        seen = []
        host.on_step = lambda step, loss, skipped: seen.append(loss)
        for step in range(3):  # versions alternate between the two replicas (2bw keeps two)
            version = max(step - 1, 0)
            for mb in range(0, M, 2):  # two microbatches in flight at a time
                host.forward(step, mb, version, inputs[mb])
                host.forward(step, mb + 1, version, inputs[mb + 1])
                host.backward(step, mb, version, None)
                host.backward(step, mb + 1, version, None)
            host.optimizer_step(step, step + 1)
        runs.append((seen, [f.clone() for f in host.flat]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    # two replicas (W(0) in buffer 0 for steps 0 and 1, W(1) in buffer 1 for step 2) x two in flight
    assert len(fake.captures) == 4


def test_stage_host_refuses_graphs_with_recompute():
    with pytest.raises(ValueError, match="cannot run with recompute"):
        _host(True, FakeGraphs(), recompute=True)


def _simulated_losses(cuda_graphs, monkeypatch, fake, dtype="fp32", compute_copies=True):
    from asyncpp_ext.models.registry import model_config
    from asyncpp_ext.training.build import build_data, build_simulator
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig()
    cfg.model = model_config("llama-tiny")
    cfg.pipeline.schedule, cfg.pipeline.stages, cfg.pipeline.microbatches = "sync", 1, 3
    cfg.train.cuda_graphs = cuda_graphs  # on CPU only through the stand-in below (validate() refuses it)
    cfg.train.dtype, cfg.train.compute_copies = dtype, compute_copies
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    stream, eval_set = build_data(cfg)
    engine = build_simulator(cfg)
    losses = list(engine.train_steps(stream, 3))
    return losses, engine.eval_loss(eval_set)


def test_the_simulator_trains_through_the_graphs_as_eagerly(monkeypatch):
    fake = FakeGraphs()
    eager = _simulated_losses(False, monkeypatch, fake)
    assert fake.captures == []
    graphed = _simulated_losses(True, monkeypatch, fake)
    assert graphed == eager and len(fake.captures) == 1  # one microbatch in flight at a time


def test_the_simulator_graphs_its_bf16_compute_copies_as_autocast_computes(monkeypatch):
    """With compute copies the graphed module is the copies' one: their gradients adopt the graph's
    buffers (taken after every backward), the model's float32 gradients accumulate as eagerly."""
    fake = FakeGraphs()
    eager = _simulated_losses(False, monkeypatch, fake, "bf16", compute_copies=False)
    graphed = _simulated_losses(True, monkeypatch, fake, "bf16", compute_copies=True)
    assert graphed == eager and len(fake.captures) == 1


def test_refusals_name_the_flag(monkeypatch, tmp_path, capsys):
    from asyncpp_ext.training.cli import main
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.run import RunSetupError, preflight

    for extra, words in ((["--cuda-graphs"], "--cuda-graphs: train.cuda_graphs replays CUDA graphs: it needs "
                                             "--device cuda, got cpu"),
                         (["--cuda-graphs", "--device", "cuda", "--recompute"], "cannot run with --recompute")):
        assert main(["--model", "llama-tiny", "--steps", "2", "--out", str(tmp_path / "r"), *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend a GPU: the next check is reached
    cfg = RunConfig()
    cfg.model.name = "llama-tiny"
    cfg.train.device, cfg.train.cuda_graphs, cfg.pipeline.schedule = "cuda", True, "2bw"
    with pytest.raises(RunSetupError, match=r"--cuda-graphs cannot run the one-process simulation of 2bw"):
        preflight(cfg)


def _run_losses(tmp_path, runs: dict) -> dict:
    """{name: losses} of CLI runs {name: flags}, run side by side (small models: the GPU and the
    host's cores have room for all of them, and the step takes a quarter of the time). A run with
    --cuda-graphs must not have fallen back to eager (GraphedCompute warns once when a capture
    fails): else the comparison would be eager against eager."""
    import json
    import os
    import subprocess
    import sys

    procs = {name: subprocess.Popen([sys.executable, "-m", "asyncpp_ext.train", "--device", "cuda", "--model",
                                     "llama-tiny", "--steps", "4", "--microbatches", "4", "--eval-every", "0",
                                     "--ckpt-every", "0", "--no-progress", "--seed", "0", "--out",
                                     str(tmp_path / name), *flags],
                                    # the capture-failure warning shown whatever the environment's filters
                                    env={**os.environ, "PYTHONWARNINGS": "default::UserWarning"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, flags in runs.items()}
    losses = {}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{name} {' '.join(runs[name])}: exit {proc.returncode}\n{err[-3000:]}"
            assert "--cuda-graphs" not in runs[name] or "CUDA-graph capture failed" not in err, (name, err[-3000:])
            losses[name] = [json.loads(ln)["loss"]
                            for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    finally:  # a failed run: the others are not left running into the next test
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return losses


@pytest.mark.cuda
@pytest.mark.parametrize("flags, tol", [(("--dtype", "fp32", "--no-compile"), 1e-6),
                                        (("--dtype", "bf16", "--compile", "--head-loss", "chunked"), 1e-3),
                                        (("--dtype", "bf16", "--compile", "--compile-scope", "stage",
                                          "--head-loss", "chunked"), 1e-3)],
                         ids=["fp32-eager", "bf16-compiled-fused-head", "bf16-stage-region"])
def test_cuda_graphs_train_as_without_them(tmp_path, flags, tol):
    """The same kernels replayed: one stage (the simulator) and a 2-stage 2bw pipeline sharing the
    GPU against its --simulate run. The fused head is named `chunked`: `fused` would be Liger's
    kernel without graphs where liger-kernel is installed, and the chunked one with them."""
    sync = ("--stages", "1", "--schedule", "sync", *flags)
    pipe = ("--stages", "2", "--schedule", "2bw", "--transport", "gloo", *flags)
    losses = _run_losses(tmp_path, {"eager": (*sync, "--no-cuda-graphs"), "graphs": (*sync, "--cuda-graphs"),
                                    "sim": (*pipe, "--simulate"), "pipe": (*pipe, "--cuda-graphs")})
    want, got = losses["eager"], losses["graphs"]
    assert all(abs(g - w) <= tol * abs(w) for g, w in zip(got, want)), (got, want)
    want, got = losses["sim"], losses["pipe"]
    assert all(abs(g - w) <= max(tol, 1e-5) * abs(w) for g, w in zip(got, want)), (got, want)


@pytest.mark.cuda
def test_a_sync_run_on_cuda_replays_graphs_unless_told_not_to(tmp_path, monkeypatch):
    """The auto rule end to end: `asyncpp-train --device cuda --schedule sync` captures graphs
    without being asked; `--no-cuda-graphs` captures none."""
    from asyncpp_ext.training.cli import main

    captures = []
    real = torch.cuda.make_graphed_callables

    def counting(*args, **kw):
        captures.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", counting)  # GraphedCompute looks it up when built
    run = ["--device", "cuda", "--model", "llama-tiny", "--schedule", "sync", "--stages", "1", "--steps", "2",
           "--microbatches", "2", "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--no-compile"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main([*run, "--out", str(tmp_path / "auto")]) == 0 and captures
    assert not [w for w in seen if "CUDA-graph capture failed" in str(w.message)]  # replayed, not fallen back
    captures.clear()
    assert main([*run, "--no-cuda-graphs", "--out", str(tmp_path / "off")]) == 0 and not captures


@pytest.mark.cuda
def test_on_a_gpu_a_parameter_the_computation_does_not_use_keeps_no_gradient():
    """torch's own capture (make_graphed_callables with allow_unused_input) with the replays:
    the spare parameter keeps no .grad over two microbatches, the used ones get eager's."""
    module = _mlp().cuda()
    module.spare = nn.Parameter(torch.ones(3, device="cuda"))
    reference = copy.deepcopy(module)
    graphed = GraphedCompute(module, _loss)
    for x, y in _data(2):
        x, y = x.cuda(), y.cuda()
        graphed(x, y).backward()
        _loss(reference, x, y).backward()
    torch.cuda.synchronize()
    assert graphed.failure is None and len(graphed.slots) == 1
    assert module.spare.grad is None
    for (name, got), want in zip(module.named_parameters(), reference.parameters()):
        if want.grad is not None:
            assert torch.allclose(got.grad, want.grad, atol=1e-6), name
