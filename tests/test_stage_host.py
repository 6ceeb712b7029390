"""The stage host in one process (no transport): the last stage's gradient equals the simulator's
``(loss / m).backward()`` bit for bit on every forward path (plain, autocast, recompute), the step
loss is the microbatches' mean, and a loss_fn that does not reduce is refused by name."""
import copy

import pytest
import torch
import torch.nn as nn

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
