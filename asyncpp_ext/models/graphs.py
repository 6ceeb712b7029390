"""CUDA-graph replay of a stage's microbatch: its forward and its backward as two graphs each
(``--cuda-graphs``).

Why: a small model's step on a GPU is bound by the host. smollm-135m at 8 x 1024 per microbatch
launches about 14,000 kernels per step (about 60 per block per microbatch, forward and backward),
each from Python (inductor's wrapper code, the autograd engine), and an H200 was busy 27 % of the
step (docs/gpu.md). A CUDA graph replays a captured sequence of kernels with one launch.

How: ``torch.cuda.make_graphed_callables`` captures ``fn(module, *args)`` -- the stage's blocks and,
on the last stage, its loss -- as a forward graph and a backward graph, with the module's
Parameters as inputs: every call copies its arguments into the graph's static inputs and replays;
the backward replays the other graph and hands the Parameters' gradients to autograd, which
accumulates them into ``.grad`` as usual. The weights are read where they live: a stage's weight
buffers never move (each 2bw version has its own replica over its own buffer, the optimizer writes
in place, tied values are copied in), so a graph replays the current values. A graph instance holds
one microbatch at a time (its outputs and saved activations live in the graph's memory), so the
module keeps a pool of instances ("slots"), takes a free one per forward and captures another when
every slot is in flight (1F1B's warm-up keeps S - s microbatches in flight on stage s); a slot is
free again once its microbatch's backward has started. Every output is returned as a clone, so
nothing the caller keeps (a loss, an activation on its way to the next stage) is overwritten by a
later replay; and every Parameter and leaf argument the computation gives a gradient has a ``.grad``
before a replay, so autograd adds the graph's gradients into it instead of adopting the graph's own
buffer as ``.grad`` (what it gives none keeps none, as in eager code: one uncaptured forward and
backward before each capture finds them).

Limits: CUDA only; every microbatch has the shapes of the first (the pipeline already requires it);
calls without gradients (evaluation, a recomputing stage's first forward) run eagerly; autocast
must run without its cast cache (``autocast_context(..., cache=False)``; capture refuses the
cache). A capture that fails runs ``fn`` eagerly from then on, with one warning naming the cause.
The fused head loss under graphs is the package's chunked kernel (models/head_loss.kernel_for_graphs).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .compile import _describe

_eager_capture_runs = 0  # > 0 while a capture runs the computation outside a graph


def in_capture_warm_up() -> bool:
    """True while a slot's capture runs its computation eagerly, outside the graph: the search for
    what gets no gradient and ``make_graphed_callables``' warm-up iterations. A computation whose
    backward changes state beyond the gradients it returns (the fused weight gradients' adds into
    the float32 gradients, pipeline/main_grad.py) leaves that state alone then: those runs are no
    microbatch of the step. The capture itself (the stream capturing) records it as usual."""
    if _eager_capture_runs == 0:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def _eager_capture_runs_inside():
    global _eager_capture_runs
    _eager_capture_runs += 1
    try:
        yield
    finally:
        _eager_capture_runs -= 1


GRADS_TAKEN = "_asyncpp_grads_taken"
"""Attribute a module may carry: ids of its parameters whose ``.grad`` the owner takes and clears
after every backward (pipeline/compute_copies.py); those may adopt a graph's gradient buffer."""


class _Slot(nn.Module):
    """One graph instance: ``fn(module, *args)`` with ``module``'s Parameters as its own (the same
    objects, registered through the shared submodule, so their gradients accumulate as usual)."""

    def __init__(self, module: nn.Module, fn: Callable):
        super().__init__()
        self.module = module
        self.fn = fn
        self.busy = False
        # what this slot's computation gives no gradient (found before its capture): those keep no
        # .grad under its replays, as in eager code, instead of a zero one an optimizer would step
        self.no_grad_params: frozenset[int] = frozenset()  # ids
        self.no_grad_args: frozenset[int] = frozenset()  # positions

    def forward(self, *args):
        return self.fn(self.module, *args)


class _ReleaseOnBackward(torch.autograd.Function):
    """Returns a clone of the slot's static output; its backward (which runs right before the
    slot's backward graph replays) marks the slot free for the next forward."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, slot: _Slot):
        ctx.slot = slot
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.slot.busy = False
        return grad, None


@contextlib.contextmanager
def _callers_stream_kept(on_cuda: bool):
    """Leave a failed capture on the caller's CUDA stream. torch.cuda.graph ends a capture before it
    restores the caller's stream, so a capture that fails leaves the thread on the capture's side
    stream, which no other stream waits for (the eager fallback, the transport and the optimizer
    would run there unordered with the rest): back to the caller's, and that work waited for."""
    caller = torch.cuda.current_stream() if on_cuda else None
    try:
        yield
    except BaseException:
        if caller is not None:
            torch.cuda.set_stream(caller)  # first: a synchronize that fails must not leave the side stream
            torch.cuda.synchronize()
        raise


class GraphedCompute:
    """``fn(module, *args)`` replayed from CUDA graphs while gradients are on; see the module
    docstring. ``make`` captures a slot (default ``torch.cuda.make_graphed_callables``; tests pass
    an eager stand-in to check the bookkeeping on CPU)."""

    def __init__(self, module: nn.Module, fn: Callable, *, make: Optional[Callable] = None,
                 warmup_iters: int = 3):
        self.module, self.fn = module, fn
        self.make = make if make is not None else torch.cuda.make_graphed_callables
        self.warmup_iters = warmup_iters
        taken = getattr(module, GRADS_TAKEN, frozenset())
        self.params = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
        self.slots: list[_Slot] = []
        self.failure: Optional[str] = None  # why capture failed (then everything runs eagerly)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.failure is not None or not torch.is_grad_enabled():
            return self.fn(self.module, *args)
        slot = next((s for s in self.slots if not s.busy), None) or self._capture(args)
        if slot is None:
            return self.fn(self.module, *args)
        slot.busy = True
        self._grads_in_place(args, slot)
        return _ReleaseOnBackward.apply(slot(*args), slot)

    def _grads_in_place(self, args, slot: _Slot) -> None:
        """Give every Parameter and leaf argument a ``.grad`` before the replay. The backward graph
        hands out its gradients as views of its own static buffers, which its next replay
        overwrites; autograd adopts such a tensor as ``.grad`` when there is none yet (after
        ``zero_grad(set_to_none=True)``), and later microbatches would then accumulate into the
        graph's buffer. With a ``.grad`` present it adds in place (0 + g: the same bits). (Compute
        copies are left out: their gradient is taken right after the backward, before any replay;
        so is what the computation gives no gradient, which the replay leaves alone.)"""
        zeroed_together: dict[tuple, list] = {}
        params = (p for p in self.params if id(p) not in slot.no_grad_params)
        leaves = (a for i, a in enumerate(args) if a.requires_grad and a.is_leaf and i not in slot.no_grad_args)
        for t in (*params, *leaves):
            if t.grad is not None:
                continue
            if t.is_contiguous():
                zeroed_together.setdefault((t.device, t.dtype), []).append(t)
            else:
                t.grad = torch.zeros_like(t)  # keeps the tensor's strides
        for (device, dtype), ts in zeroed_together.items():
            # one allocation and one fill for all of them: a zeros_like each would be an allocation
            # and a launch each (dozens per step -- the norms' weights, the embedding -- whose host
            # time the GPU waits for at the step's start)
            flat = torch.zeros(sum(t.numel() for t in ts), device=device, dtype=dtype)
            for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                t.grad = part.view_as(t)

    def _capture(self, args) -> Optional[_Slot]:
        """A new slot captured on copies of ``args`` (the graph's static inputs are its own: the
        caller's tensors, a receive buffer say, may be reused while the slot holds them)."""
        slot = _Slot(self.module, self.fn)
        slot.train(self.module.training)
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        try:
            with _callers_stream_kept(any(t.is_cuda for t in (*self.params, *sample))), _eager_capture_runs_inside():
                self._find_what_gets_no_gradient(slot, sample)
                # allow_unused_input: a Parameter the stage does not use (a model's spare bias, say)
                # gets no gradient from the replay instead of failing the capture
                self.make(slot, sample, num_warmup_iters=self.warmup_iters, allow_unused_input=True)
        except Exception as exc:  # capture refused or failed: this module runs eagerly from now on
            self.failure = _describe(exc)
            warnings.warn(f"asyncpp: CUDA-graph capture failed ({self.failure}); this stage runs "
                          "without graphs from now on", stacklevel=3)
            return None
        self.slots.append(slot)
        return slot

    def _find_what_gets_no_gradient(self, slot: _Slot, sample) -> None:
        """One uncaptured forward and backward of the sample ``slot`` is about to capture: the
        Parameters and arguments its computation gives no gradient. Eager code leaves their
        ``.grad`` None; so must the slot's replays, whose ``_grads_in_place`` would otherwise give
        them a zero one that an optimizer then steps (weight decay, moments) where eager skips them.
        Per slot, not per module: what one capture leaves out another may use (structure that
        depends on the data or on chance), and a skipped Parameter that the replay does give a
        gradient would adopt the graph's buffer as its ``.grad``."""
        wanted = [t for t in (*sample, *self.params) if t.requires_grad]
        if not wanted:  # (every weight a compute copy, token ids in: nothing to find)
            return
        out = self.fn(self.module, *sample)
        grads = (torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True)
                 if out.requires_grad else [None] * len(wanted))
        none = {id(t) for t, g in zip(wanted, grads) if g is None}
        slot.no_grad_params = frozenset(id(p) for p in self.params if id(p) in none)
        slot.no_grad_args = frozenset(i for i, a in enumerate(sample) if id(a) in none)


__all__ = ["GraphedCompute", "GRADS_TAKEN", "in_capture_warm_up"]
