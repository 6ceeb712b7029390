"""Single-process reference of the update semantics (docs/design.md §1, §1.10).

* sync (also "gpipe", "1f1b"):  W(t+1) = W(t) - lr * U(grad f_t(W(t)))
* 2bw:                          W(t+1) = W(t) - lr * U(grad f_t(W(t-1))),   W(-1) := W(0)

One step consumes a minibatch of m microbatches. For each microbatch i = 0..m-1, in that order,
forward on the version the schedule prescribes, then backward of ``loss_i / m`` accumulating into
``.grad``; the step's loss is ``(loss_0 + ... + loss_{m-1}) / m``. The optimizer then steps the
newest weights W(t) with those gradients. A multi-process pipeline run with the same data and the
same accumulation order must reproduce these numbers to floating-point tolerance.

Tied weights (docs/design.md §1.13): every use of a tied tensor accumulates its own gradient
and the owner's becomes ``owner + mirrors`` before the step, as on a pipeline. Learning-rate
schedule and clipping by the previous step's norm (§1.14) are applied at the step as there.

Non-finite values (``on_nonfinite``): "stop" raises NonFiniteError when a microbatch loss or a
gradient holds NaN/Inf, before the optimizer runs; "skip" skips that step's update (for 2bw the
next version is a copy of W(t)) -- the rule a pipeline applies on every stage (see
pipeline/nonfinite.py; the one difference: a pipeline stops where a gradient turns non-finite on
an early stage only, as its later stages have applied the step by then).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .config import SCHEDULES
from ..optim.lr_schedule import apply_lr
from ..optim.state import load_optimizer_state_by_name, optimizer_state_by_name, regroup_optimizer_state
from ..pipeline.clipping import PreviousNormClipper
from ..pipeline.nonfinite import POLICIES, NonFiniteError
from ..pipeline.partition import as_blocks
from ..pipeline.ties import find_ties, sum_tied_gradients, untie
from .trainer import StepOutcome

DELAYED_SCHEDULES = ("2bw",)


def default_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``model.loss(logits, targets)`` of a model whose forward returns logits (or (logits, _))."""
    out = model(inputs)
    logits = out[0] if isinstance(out, tuple) else out
    return model.loss(logits, targets)


class DelaySimulator:
    """Step engine running the sync or 2bw update rule in one process.

    For 2bw it keeps ``stash`` = W(t-1). During a step the stashed tensors are swapped into the
    parameters (``p.data``) for the forward/backward passes and swapped back before the optimizer
    step, so parameter identity (and the optimizer's per-parameter state) never changes.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: str,
                 loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
                 on_nonfinite: str = "stop", lr_schedule=None, clip_grad_norm: float | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if on_nonfinite not in POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not one of {', '.join(POLICIES)}")
        self.on_nonfinite = on_nonfinite
        self.last_skipped = False
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.delayed = schedule in DELAYED_SCHEDULES
        self.lr_schedule = lr_schedule
        self.clipper = PreviousNormClipper(clip_grad_norm) if clip_grad_norm is not None else None
        # Untie (each use its own Parameter on the owner's storage) after the optimizer was built on
        # the tied model: the optimizer holds the owners only.
        self.tied = []
        if hasattr(model, "blocks"):
            blocks = as_blocks(model)
            self.tied = untie(blocks, find_ties(model, blocks))
        mirrors = {id(m) for _, m in self.tied}
        named = [(n, p) for n, p in model.named_parameters() if id(p) not in mirrors]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._check_optimizer_covers_model()
        # W(-1) := W(0): the first delayed step computes its gradient on the initial weights.
        self.stash = [p.detach().clone() for p in self.params] if self.delayed else []
        self.steps_done = 0

    def _check_optimizer_covers_model(self) -> None:
        in_optimizer = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in zip(self.names, self.params) if id(p) not in in_optimizer]
        if missing:
            raise ValueError(f"the optimizer does not hold parameter(s) {missing[:3]}...; build it "
                             "from this model's parameters")

    def _swap_stash(self) -> None:
        for p, other in zip(self.params, self.stash):
            p.data, other.data = other.data, p.data
        self._sync_mirrors()

    def _sync_mirrors(self) -> None:
        for owner, mirror in self.tied:  # a mirror views its owner's current values
            mirror.data = owner.data

    def step(self, minibatch: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step on ``minibatch`` (a list of (inputs, targets)); returns its loss."""
        m = len(minibatch)
        if m == 0:
            raise ValueError("a minibatch needs at least one microbatch")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.delayed:
            self._swap_stash()  # params <- W(t-1), stash <- W(t)
        total, bad = 0.0, None
        try:
            for i, (inputs, targets) in enumerate(minibatch):
                loss = self.loss_fn(self.model, inputs, targets)
                if bad is None and not torch.isfinite(loss).all():
                    bad = f"non-finite loss ({loss.item():g}) in microbatch {i}"
                    if self.on_nonfinite == "stop":
                        break
                (loss / m).backward()
                total += loss.item()
        finally:
            if self.delayed:
                self._swap_stash()  # params <- W(t), stash <- W(t-1)
        sum_tied_gradients(self.tied)
        if bad is None:
            bad = next((f"non-finite gradient in {n}" for n, p in zip(self.names, self.params)
                        if p.grad is not None and not torch.isfinite(p.grad).all()), None)
        if bad is not None and self.on_nonfinite == "stop":
            raise NonFiniteError(f"{bad} at step {self.steps_done + 1}; stopping (use --on-nonfinite "
                                 "skip to skip such steps)")
        if self.delayed:
            with torch.no_grad():  # W(t) becomes the version the next step computes on
                for p, old in zip(self.params, self.stash):
                    old.copy_(p)
        self.last_skipped = bad is not None
        if self.clipper is not None:
            self.clipper.clip([p.grad for p in self.params if p.grad is not None], self.last_skipped)
        if self.lr_schedule is not None:
            apply_lr(self.optimizer, self.lr_schedule.multiplier(self.steps_done))
        if not self.last_skipped:  # a skipped step leaves weights and optimizer state as they are
            self.optimizer.step()
        self.steps_done += 1
        return total / m

    def train_steps(self, stream, steps: int):
        """``steps`` steps on the stream's next minibatches, yielding each loss (StepEngine)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        for _ in range(steps):
            loss = self.step([(x.to(device), y.to(device)) for x, y in stream.next()])
            yield StepOutcome(loss, True) if self.last_skipped else loss

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the newest weights over ``batches`` (in eval mode, no gradients)."""
        if not batches:
            raise ValueError("eval_loss needs at least one batch")
        was_training = self.model.training
        self.model.eval()
        try:
            total = sum(self.loss_fn(self.model, x, y).item() for x, y in batches)
        finally:
            self.model.train(was_training)
        return total / len(batches)

    # -- state: keyed by global parameter names so a checkpoint can be re-split later ------------
    def state_dict(self) -> dict:
        """Weights (newest, and W(t-1) for 2bw), optimizer state by parameter name, step count."""
        return {
            "schedule": self.schedule,
            "steps_done": self.steps_done,
            "params": {n: p.detach().clone() for n, p in zip(self.names, self.params)},
            "stash": {n: s.clone() for n, s in zip(self.names, self.stash)},
            "optimizer": optimizer_state_by_name(self.optimizer, self.model),
            "clip": self.clipper.state_dict() if self.clipper is not None else {"previous_norm": None},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("schedule") != self.schedule:
            raise ValueError(f"state was saved with schedule {state.get('schedule')!r}, this "
                             f"simulator runs {self.schedule!r}; use the same schedule")
        _check_names("params", state["params"], self.names)
        if self.delayed:
            _check_names("stash", state["stash"], self.names)
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(state["params"][n])
            for n, s in zip(self.names, self.stash):
                s.copy_(state["stash"][n])
        load_optimizer_state_by_name(self.optimizer, self.model,
                                     regroup_optimizer_state(state["optimizer"], self.optimizer, self.model))
        if self.clipper is not None:
            self.clipper.load_state_dict(state.get("clip"))
        self.steps_done = int(state["steps_done"])


def _check_names(what: str, saved: dict, expected: list[str]) -> None:
    if set(saved) != set(expected):
        missing = sorted(set(expected) - set(saved))[:3]
        extra = sorted(set(saved) - set(expected))[:3]
        raise ValueError(f"saved {what} do not match the model (missing {missing}, unexpected "
                         f"{extra}); load a state saved from the same model shape")


def merge_engine_states(states: Sequence[dict]) -> dict:
    """One engine state from per-stage shards (any pipeline depth): weights and optimizer state are
    keyed by global parameter names, so the union is the whole model's state."""
    if len(states) == 1:
        return states[0]
    merged = {"schedule": states[0]["schedule"], "steps_done": states[0]["steps_done"],
              "params": {}, "stash": {}, "optimizer": {"state": {}, "param_groups": []},
              "clip": states[0].get("clip")}  # every stage knows the same previous norm
    for s in states:
        if s["steps_done"] != merged["steps_done"]:
            raise ValueError(f"shards disagree on the step ({s['steps_done']} vs {merged['steps_done']})")
        merged["params"].update(s["params"])
        merged["stash"].update(s["stash"])
        merged["optimizer"]["state"].update(s["optimizer"]["state"])
        merged["optimizer"]["param_groups"] += s["optimizer"]["param_groups"]
    return merged


__all__ = ["DelaySimulator", "default_loss", "merge_engine_states", "DELAYED_SCHEDULES"]
