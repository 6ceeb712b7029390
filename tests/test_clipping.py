"""Clipping by the previous step's global norm (docs/design.md §1.14), checked against a few-line
reference written from the formula: c(0) = 1, c(t) = min(1, X / (‖g(t-1)‖ + 1e-6)), g(t) <- c(t)·g(t)."""
import math

import pytest
import torch

from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.pipeline.clipping import PreviousNormClipper
from asyncpp_ext.training.simulate import DelaySimulator

CFG = preset_config("tiny", n_layer=1, n_embd=16, seq_len=8)
LR, MAX_NORM = 0.5, 0.3


def _batches(steps):
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g) for _ in range(steps)]
    return [[(r[:, :-1], r[:, 1:])] for r in rows]


def _reference(steps):
    """Plain SGD on the sync rule, clipping by the previous step's float64 global norm."""
    model = GPT(CFG, seed=0)
    previous = None
    for (x, y), in _batches(steps):
        model.zero_grad()
        model(x, y)[1].backward()
        grads = [p.grad for p in model.parameters()]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        c = 1.0 if previous is None else min(1.0, MAX_NORM / (previous + 1e-6))
        previous = norm
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= LR * (c * g)
    return model, previous


@pytest.mark.usefixtures("one_intra_op_thread")
def test_the_simulator_clips_by_the_previous_steps_norm():
    steps = 4
    model = GPT(CFG, seed=0)
    sim = DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=LR), "sync", clip_grad_norm=MAX_NORM)
    for batch in _batches(steps):
        sim.step(batch)
    ref, ref_norm = _reference(steps)
    assert sim.clipper.previous_norm == pytest.approx(ref_norm, rel=1e-6)
    assert ref_norm > MAX_NORM  # so clipping acted on steps 2..4
    for p, q in zip(model.parameters(), ref.parameters()):
        # float32 per-parameter norms vs the reference's float64 ones: c(t) agrees to ~1e-7
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    unclipped = GPT(CFG, seed=0)
    plain = DelaySimulator(unclipped, torch.optim.SGD(unclipped.parameters(), lr=LR), "sync")
    for batch in _batches(steps):
        plain.step(batch)
    assert any(not torch.allclose(p, q, rtol=1e-3) for p, q in zip(model.parameters(), unclipped.parameters()))


def test_the_first_step_and_skipped_steps_leave_the_gradient_alone():
    clipper = PreviousNormClipper(1.0)
    g = [torch.full((4,), 3.0)]
    assert clipper.clip(g, skipped=False) == 1.0 and torch.equal(g[0], torch.full((4,), 3.0))
    assert clipper.previous_norm == pytest.approx(6.0)
    h = [torch.full((4,), float("nan"))]
    clipper.clip(h, skipped=True)
    assert clipper.previous_norm == pytest.approx(6.0)  # a skipped step's norm is not remembered
    k = [torch.ones(4)]
    assert clipper.clip(k, skipped=False) == pytest.approx(1.0 / (6.0 + 1e-6))
    assert torch.allclose(k[0], torch.full((4,), 1.0 / 6.0))
    with pytest.raises(ValueError, match="clip_grad_norm"):
        PreviousNormClipper(-1.0)


def test_norm_terms_are_each_gradients_squared_norm_read_at_once(monkeypatch):
    """The terms are the per-gradient norms (float32 and bfloat16 reductions, squared in float64),
    exactly as reading each norm would give them, read from the device in one copy."""
    from asyncpp_ext.pipeline import clipping

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 32, generator=g) * 1e-3, torch.randn(7, generator=g) * 100,
             torch.randn(33, 5, generator=g).bfloat16()]
    each = [float(torch.linalg.vector_norm(t)) ** 2 for t in grads]
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or tolist(self))
    assert clipping.norm_terms(grads) == each and reads == [3]
    assert clipping.norm_terms([]) == []


@pytest.mark.cuda
def test_norm_terms_on_the_gpu_are_its_per_gradient_norms():
    from asyncpp_ext.pipeline.clipping import norm_terms

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(256, 128, generator=g).cuda(), torch.randn(300, generator=g).cuda().bfloat16()]
    assert norm_terms(grads) == [float(torch.linalg.vector_norm(t)) ** 2 for t in grads]
