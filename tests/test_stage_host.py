"""The stage host in one process (no transport): the last stage's gradient equals the simulator's
``(loss / m).backward()`` bit for bit on every forward path (plain, autocast, recompute), the step
loss is the microbatches' mean, and a loss_fn that does not reduce is refused by name."""
import copy

import pytest
import torch
import torch.nn as nn

from torch.overrides import TorchFunctionMode

from asyncpp_ext.pipeline.nonfinite import NonFiniteError
from asyncpp_ext.pipeline.stage import StageError, StageHost

M = 4


def _module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _batch():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 8, generator=g) for _ in range(M)], [torch.randn(3, 8, generator=g) for _ in range(M)]


def _last_stage(module, loss_fn=nn.functional.mse_loss, **kw):
    batch = _batch()
    host = StageHost(module, stage=1, stages=2, schedule="gpipe", microbatches=M,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=loss_fn,
                     batch_source=lambda step: batch, **kw)
    return host, batch


@pytest.mark.parametrize("kw", [{}, {"recompute": True}, {"autocast_dtype": torch.bfloat16}],
                         ids=["plain", "recompute", "autocast-bf16"])
def test_last_stage_gradient_and_loss_equal_the_divided_loss_reference(kw):
    reference = _module()
    host, (inputs, targets) = _last_stage(copy.deepcopy(reference), **kw)
    losses = []
    for mb in range(M):
        x = inputs[mb].detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast_dtype" in kw):
            loss = nn.functional.mse_loss(reference(x), targets[mb])
        (loss / M).backward()
        losses.append(loss.item())
        assert host.forward(0, mb, 0, inputs[mb]) is None
        host.backward(0, mb, 0, None)
    for got, want in zip(host.replicas[0].parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad)
    seen = []
    host.on_step = lambda step, loss, skipped: seen.append(loss)
    host.optimizer_step(0, 1)
    assert seen == [sum(losses) / M]


def test_a_loss_that_is_not_a_scalar_is_refused_by_name():
    host, (inputs, _) = _last_stage(_module(), loss_fn=lambda out, y: (out - y) ** 2)
    with pytest.raises(StageError, match=r"loss_fn returned a tensor of shape \(3, 8\) for microbatch 0 of step 0; "
                                         r"it must return a scalar"):
        host.forward(0, 0, 0, inputs[0])


class _HostReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to the host (a device sync on a GPU)."""
    READS = {"item", "tolist", "__bool__", "__float__", "__int__"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def test_the_last_stage_reads_its_losses_once_per_step_not_per_microbatch():
    host, (inputs, targets) = _last_stage(_module())
    reads = []
    for mb in range(M):
        with _HostReads() as seen:
            host.forward(0, mb, 0, inputs[mb])
            host.backward(0, mb, 0, None)
        reads.append(seen.count)
    assert reads == [0] * (M - 1) + [1]  # the step's losses, read together at its last backward
    seen_losses = []
    host.on_step = lambda step, loss, skipped: seen_losses.append(loss)
    host.optimizer_step(0, 1)
    with torch.no_grad():
        want = [nn.functional.mse_loss(_module()(x), y).item() for x, y in zip(inputs, targets)]
    assert seen_losses == [sum(want) / M]


def _middle_stage(policy):
    batch = _batch()
    return StageHost(_module(), stage=1, stages=3, schedule="gpipe", microbatches=M,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=None,
                     batch_source=lambda step: batch, on_nonfinite=policy), batch


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_non_finite_received_gradient_is_judged_at_the_steps_last_backward(policy):
    host, (inputs, _) = _middle_stage(policy)
    for mb in range(M):
        host.forward(0, mb, 0, inputs[mb])
    for mb in range(M - 1):  # the NaN arrives with microbatch 1; nothing is decided before the last
        grad = torch.full((3, 8), float("nan")) if mb == 1 else torch.ones(3, 8)
        host.backward(0, mb, 0, grad)
    if policy == "stop":
        with pytest.raises(NonFiniteError, match=r"stage 1: non-finite gradient received from stage 2 in "
                                                 r"microbatch 1 at step 1; stopping"):
            host.backward(0, M - 1, 0, torch.ones(3, 8))
        return
    sent = host.backward(0, M - 1, 0, torch.ones(3, 8))
    assert torch.isnan(sent).all()  # the earlier stages are told the step is bad
    before = [p.detach().clone() for p in host.replicas[0].parameters()]
    host.optimizer_step(0, 1)
    assert host.nonfinite.skipped == [0]
    assert all(torch.equal(a, b) for a, b in zip(before, host.replicas[0].parameters()))


@pytest.mark.cuda
def test_on_a_gpu_a_stage_waits_for_its_device_only_at_the_steps_last_backward():
    """torch's sync debug mode raises on any call that waits for the device: none may happen
    before the step's last backward, on the last stage or a middle one."""
    dev = torch.device("cuda")
    batch = tuple([t.to(dev) for t in ts] for ts in _batch())
    kw = dict(optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batch_source=lambda step: batch)
    last = StageHost(_module().to(dev), stage=1, stages=2, schedule="gpipe", microbatches=M,
                     loss_fn=nn.functional.mse_loss, **kw)
    middle = StageHost(_module().to(dev), stage=1, stages=3, schedule="gpipe", microbatches=M, loss_fn=None, **kw)
    grad = torch.ones(3, 8, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mb in range(M - 1):
            last.forward(0, mb, 0, batch[0][mb])
            last.backward(0, mb, 0, None)
            middle.forward(0, mb, 0, batch[0][mb])
            middle.backward(0, mb, 0, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    last.forward(0, M - 1, 0, batch[0][M - 1])
    last.backward(0, M - 1, 0, None)
    middle.forward(0, M - 1, 0, batch[0][M - 1])
    middle.backward(0, M - 1, 0, grad)


def test_a_stage_without_parameters_computes_on_the_device_it_is_given():
    # Its flat buffers (which autocast and the receive buffers take their device from) cannot
    # follow a first parameter; the pipeline passes its device ("meta" stands in for a GPU here).
    host = StageHost(nn.Sequential(nn.Tanh()), stage=1, stages=3, schedule="gpipe", microbatches=M,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=None,
                     batch_source=lambda step: _batch(), device="meta")
    assert host.flat[0].device.type == "meta" and host.flat[0].numel() == 0


def test_a_batch_reaches_its_device_unchanged():
    from asyncpp_ext.pipeline.devices import to_device

    x = torch.arange(12).view(3, 4)
    assert to_device(x, "cpu") is x  # already there: no copy
    assert to_device(x, torch.device("cpu")).equal(x)


@pytest.mark.cuda
def test_on_a_gpu_a_batch_is_copied_in_without_a_device_wait():
    """A pageable host-to-device copy waits for the device's queue (the previous step's optimizer):
    the batch goes through pinned memory, asynchronously, so sync debug mode stays silent."""
    from asyncpp_ext.pipeline.devices import to_device

    x = torch.randint(0, 1000, (8, 1024))
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # work queued ahead of the copy
            busy = busy @ busy / 64
        y = to_device(x, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.device.type == "cuda" and torch.equal(y.cpu(), x)
