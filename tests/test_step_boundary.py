"""What a one-process step does between its last microbatch and the next step's first kernel:
the host work a GPU waits for there (docs/gpu.md: ~7.6 ms of idle per smollm-360m step). One scan
of the gradients and the losses per step (the optimizer's own scan off), the next minibatch fetched
while the step's kernels run, no per-step walk of the modules to set training mode, and the
gradients a CUDA-graph replay needs zeroed in one buffer -- every one the same numbers as before."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.models.graphs import GraphedCompute
from asyncpp_ext.optim import ErrorFeedback, _kernels as K, build_optimizer
from asyncpp_ext.training.simulate import DelaySimulator

CFG = preset_config("tiny", n_layer=1, n_embd=16, seq_len=8)
M = 3

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _loss(net, x, y):
    logits = net(x)[0]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _minibatch(gen):
    out = []
    for _ in range(M):
        block = torch.randint(0, 256, (2, CFG.seq_len + 1), generator=gen)
        out.append((block[:, :-1], block[:, 1:]))
    return out


class CountingStream:
    """A batch stream that notes each ``next()`` (the trainer's BatchStream interface)."""

    def __init__(self, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0

    def next(self):
        self.calls += 1
        return _minibatch(self.gen)


@pytest.mark.parametrize("ef_beta", [0.0, 0.5])
def test_one_scan_per_step_holds_the_gradients_and_the_losses(monkeypatch, ef_beta):
    model = GPT(CFG, seed=0)
    opt = build_optimizer(model, "adamw", ef_beta=ef_beta)
    sim = DelaySimulator(model, opt, "2bw", loss_fn=_loss)
    assert opt.check_finite is False  # the simulator scans; the optimizer's scan would repeat it
    if isinstance(opt, ErrorFeedback) and hasattr(opt.base, "check_finite"):
        assert opt.base.check_finite is False
    scans = []
    real = K.first_nonfinite
    monkeypatch.setattr(K, "first_nonfinite", lambda ts: scans.append([t.shape for t in ts]) or real(ts))
    stream = CountingStream()
    list(sim.train_steps(stream, 3))
    assert len(scans) == 3, scans  # one per step (two before: the optimizer's, per parameter under EF)
    assert all(shapes[-1] == torch.Size([M]) for shapes in scans)  # the losses ride along


def test_a_bad_loss_or_gradient_is_still_caught_and_named():
    from asyncpp_ext.pipeline.nonfinite import NonFiniteError

    def nan_loss(net, x, y):
        return _loss(net, x, y) * float("nan")
    model = GPT(CFG, seed=0)
    sim = DelaySimulator(model, build_optimizer(model, "adamw"), "sync", loss_fn=nan_loss)
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        sim.step(_minibatch(torch.Generator().manual_seed(0)))
    for policy in ("stop", "skip"):  # a finite loss, a non-finite gradient
        model = GPT(CFG, seed=0)
        sim = DelaySimulator(model, build_optimizer(model, "adamw"), "sync", loss_fn=_loss, on_nonfinite=policy)
        before = [p.detach().clone() for p in model.parameters()]
        name, first = next(iter(model.named_parameters()))
        first.register_hook(lambda g: g * float("inf"))
        if policy == "stop":
            with pytest.raises(NonFiniteError, match=f"non-finite gradient in {name} at step 1"):
                sim.step(_minibatch(torch.Generator().manual_seed(0)))
        else:
            sim.step(_minibatch(torch.Generator().manual_seed(0)))
            assert sim.last_skipped
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # both bad: the loss is named, as it comes first
    model = GPT(CFG, seed=0)
    sim = DelaySimulator(model, build_optimizer(model, "adamw"), "sync", loss_fn=nan_loss)
    next(model.parameters()).register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        sim.step(_minibatch(torch.Generator().manual_seed(0)))


def test_the_next_minibatch_is_fetched_during_the_step_and_never_past_the_segment():
    def run(prefetching):
        model = GPT(CFG, seed=0)
        sim = DelaySimulator(model, build_optimizer(model, "adamw"), "2bw", loss_fn=_loss)
        stream, seen = CountingStream(), []
        if prefetching:
            for loss in sim.train_steps(stream, 3):
                seen.append((loss, stream.calls))
        else:
            for _ in range(3):
                seen.append((sim.step(stream.next()), stream.calls))
        return seen, stream.calls, [p.detach().clone() for p in model.parameters()]
    ahead, calls, weights = run(True)
    plain, plain_calls, plain_weights = run(False)
    assert [loss for loss, _ in ahead] == [loss for loss, _ in plain]  # the same steps, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert [c for _, c in ahead] == [2, 3, 3]  # step 2's batch fetched during step 1; none after step 3
    assert calls == plain_calls == 3


def test_the_model_is_put_in_training_mode_only_when_it_is_not(monkeypatch):
    model = GPT(CFG, seed=0)
    sim = DelaySimulator(model, build_optimizer(model, "adamw"), "sync", loss_fn=_loss)
    walks = []
    real = nn.Module.train
    monkeypatch.setattr(nn.Module, "train", lambda self, mode=True: walks.append(self) or real(self, mode))
    gen = torch.Generator().manual_seed(0)
    sim.step(_minibatch(gen))
    sim.step(_minibatch(gen))
    assert walks == []  # already training: no walk over every submodule per step
    model.eval()
    sim.step(_minibatch(gen))
    assert model.training and all(m.training for m in model.modules())


def test_a_model_loaded_with_submodules_in_eval_mode_trains_in_training_mode():
    # (a loaded Hugging Face model, say: its wrapper in training mode, its layers in eval mode)
    model = GPT(CFG, seed=0)
    model.layers.eval()
    assert model.training and not all(m.training for m in model.modules())
    DelaySimulator(model, build_optimizer(model, "adamw"), "sync", loss_fn=_loss)
    assert all(m.training for m in model.modules())


def test_the_gradients_a_replay_needs_are_zeroed_in_one_buffer_per_dtype():
    from test_cuda_graphs import FakeGraphs

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    graphed = GraphedCompute(module, lambda m, x, y: nn.functional.mse_loss(m(x), y), make=FakeGraphs())
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    out = graphed(x.requires_grad_(), y)
    grads = [p.grad for p in module.parameters()] + [x.grad]
    assert all(g is not None and not g.any() for g in grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1  # one allocation, one fill
    assert all(g.shape == p.shape for g, p in zip(grads, [*module.parameters(), x]))
    out.backward()
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    reference.load_state_dict(module.state_dict())
    nn.functional.mse_loss(reference(x.detach()), y).backward()
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(module.parameters(), reference.parameters()))


def _state_equal(a: dict, b: dict) -> bool:
    """Two optimizer state_dicts alike, bit for bit (tensors) and by value (everything else)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif isinstance(x, dict):
            if not (isinstance(y, dict) and _state_equal(x, y)):
                return False
        elif isinstance(x, list):
            if len(x) != len(y) or not all(_state_equal({0: u}, {0: v}) for u, v in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


def _run_with_a_bad_step(optimizer: str, policy: str, device_skip: bool, bad: str, device: str = "cpu",
                         bad_step: int = 3):
    """Four sync steps of the tiny GPT with a cosine lr schedule; step ``bad_step``'s gradient (or
    loss) is made non-finite. device_skip=False takes the host's path (the optimizer said not to
    support the device's)."""
    from asyncpp_ext.optim.lr_schedule import LRSchedule
    from asyncpp_ext.pipeline.nonfinite import NonFiniteError

    state = {"step": 0}

    def loss_fn(net, x, y):
        loss = _loss(net, x, y)
        if state["step"] == bad_step and bad == "loss":
            return loss * float("nan")  # a NaN loss and NaN gradients
        if state["step"] == bad_step and bad in ("nan-term", "nan-term-bf16"):
            loss = loss + float("nan")  # a NaN loss, finite gradients (a constant's derivative is 0)
        return loss.bfloat16() if bad == "nan-term-bf16" else loss
    model = GPT(CFG, seed=0).to(device)
    opt = build_optimizer(model, optimizer, ef_beta=0.5)
    if not device_skip:
        opt.supports_device_skip = lambda: False
    sim = DelaySimulator(model, opt, "sync", loss_fn=loss_fn, on_nonfinite=policy,
                         lr_schedule=LRSchedule("cosine", steps=4, warmup_steps=1))
    assert (sim._device_skip and opt.supports_device_skip()) is device_skip
    if bad == "grad":
        list(model.parameters())[2].register_hook(lambda g: g * float("inf") if state["step"] == bad_step else g)
    gen, losses, outcome = torch.Generator().manual_seed(0), [], None
    for step in range(1, 5):
        state["step"] = step
        try:
            minibatch = [(x.to(device), y.to(device)) for x, y in _minibatch(gen)]
            losses.append((sim.step(minibatch), sim.last_skipped))
        except NonFiniteError as exc:
            outcome = str(exc)
            break
    return (losses, outcome, [p.detach().clone() for p in model.parameters()], opt.state_dict(),
            [dict(g) for g in opt.param_groups], opt.orthogonalized_last_step)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("policy,bad,bad_step", [
    ("skip", "grad", 3), ("skip", "loss", 3), ("stop", "grad", 3), ("skip", "nan-term", 3),
    ("skip", "nan-term-bf16", 3), ("skip", "grad", 1), ("stop", "grad", 1)])  # a bad first step: the state it creates, the lr base it sets
def test_a_step_skipped_on_the_device_leaves_everything_as_the_hosts_skip(optimizer, policy, bad, bad_step):
    """The optimizer's step is queued before the host reads the scan and skipped by its kernels
    where the scan found a NaN/Inf: the weights, the optimizer's state (step counts, first-step
    state, EF's flags), the learning rates, the losses and the stop message are bit for bit those
    of the host deciding first. A NaN loss with finite gradients is caught by the scan the losses
    ride in; 16-bit losses, which it does not take, keep the host deciding first."""
    device = _run_with_a_bad_step(optimizer, policy, True, bad, bad_step=bad_step)
    host = _run_with_a_bad_step(optimizer, policy, False, bad, bad_step=bad_step)
    assert repr(device[0]) == repr(host[0]) and device[1] == host[1]  # (repr: a nan loss equals itself)
    assert [s for _, s in device[0]] == ([i + 1 == bad_step for i in range(4)] if policy == "skip"
                                         else [False] * (bad_step - 1))
    assert (device[1] is not None) == (policy == "stop")
    assert all(torch.equal(a, b) for a, b in zip(device[2], host[2]))
    assert _state_equal(device[3], host[3])
    assert [{k: v for k, v in g.items() if k != "params"} for g in device[4]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in host[4]]
    assert device[5] == host[5]  # the Newton-Schulz count a skipped Muon step ran, put back


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_on_a_gpu_a_step_skipped_on_the_device_leaves_everything_as_the_hosts_skip(optimizer):
    """As above on CUDA: the flag and the losses read from pinned memory after the step's launch."""
    for policy, bad in (("skip", "grad"), ("stop", "loss")):
        device = _run_with_a_bad_step(optimizer, policy, True, bad, "cuda")
        host = _run_with_a_bad_step(optimizer, policy, False, bad, "cuda")
        assert repr(device[0]) == repr(host[0]) and device[1] == host[1]
        assert all(torch.equal(a, b) for a, b in zip(device[2], host[2]))
        assert _state_equal(device[3], host[3])


def test_a_sync_step_scans_on_the_device_and_never_calls_the_host_scan(monkeypatch):
    model = GPT(CFG, seed=0)
    sim = DelaySimulator(model, build_optimizer(model, "adamw"), "sync", loss_fn=_loss)
    flags, host_scans = [], []
    real = K.nonfinite_flag
    monkeypatch.setattr(K, "nonfinite_flag", lambda ts, flag: flags.append(len(ts)) or real(ts, flag))
    monkeypatch.setattr(K, "first_nonfinite", lambda ts: host_scans.append(ts) or -1)
    list(sim.train_steps(CountingStream(), 3))
    assert len(flags) == 3 and host_scans == []  # one scan per step, its answer read after the step's launch


def test_the_fused_step_refuses_a_skip_it_cannot_honour():
    model = GPT(CFG, seed=0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    flag = torch.full((1,), -1, dtype=torch.int32)
    opt = build_optimizer(model, "normuon")
    assert not opt.supports_device_skip()
    with pytest.raises(ValueError, match="skip= needs an in-place step"):
        opt.step_from(None, None, skip=flag)
    opt = build_optimizer(model, "adamw")
    sources = {p: p.detach().clone() for p in model.parameters()}
    with pytest.raises(ValueError, match="skip= needs an in-place step"):
        opt.step_from(sources, None, skip=flag)


def test_the_cli_takes_the_device_path_unless_told_to_check_on_the_host(tmp_path, monkeypatch, capsys):
    """--nonfinite-check host (for measuring the device-side skip against) reads the scan first;
    the default queues the step first: the same losses either way; a bad value is one line."""
    import json

    from asyncpp_ext.pipeline import nonfinite
    from asyncpp_ext.training.cli import main

    started = []
    real = nonfinite.DeferredScan.start
    monkeypatch.setattr(nonfinite.DeferredScan, "start",
                        lambda self, ts, losses: started.append(1) or real(self, ts, losses))
    runs = {}
    for check in (None, "host"):
        out = tmp_path / f"run-{check}"
        started.clear()
        assert main(["--model", "llama-tiny", "--stages", "1", "--schedule", "sync", "--steps", "3",
                     "--micro-batch-size", "2", "--microbatches", "2", "--data", "builtin", "--out", str(out),
                     "--no-progress", "--eval-every", "0", "--ckpt-every", "0", "--no-checkpoints",
                     *(["--nonfinite-check", check] if check else [])]) == 0
        runs[check] = ([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()],
                       len(started))
    assert runs[None][1] == 3 and runs["host"][1] == 0
    assert runs[None][0] == runs["host"][0] and len(runs[None][0]) == 3
    capsys.readouterr()
    assert main(["--model", "llama-tiny", "--nonfinite-check", "device", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not (tmp_path / "bad").exists()
    assert "--nonfinite-check" in err[-1] and "invalid choice" in err[-1]
