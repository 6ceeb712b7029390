"""Staleness mitigations for delayed schedules: one definition each, shared by the single-process
simulator (training/simulate.py) and the pipeline stages (pipeline/stage.py).

A parameter with delay d >= 1 computes step t's gradient g on W(t-d) and the optimizer applies it
to W(t) (versions before 0 are W(0); docs/design.md §1.3, §1.16). The mitigations:

* ``none``: no correction (error feedback off, ef_beta 0).
* ``ef``: error feedback, fused into the optimizers (optim/fused.py, error_feedback.py; ef_beta,
  ef_source "buffer" or "weights"). The step engines only pass W(t-1) as ``previous`` when the
  optimizer asks for it (optim/versioned.py); nothing in this module.
* ``predict`` (weight prediction, SpecTrain / PipeMare style): the forward and backward of step t
  run on ``W^ = W(t-d) + d * (W(t-d) - W(t-d-1))``, the computed-on version extrapolated by its
  last applied update to the step the gradient will be applied at; the optimizer then steps W(t)
  with that gradient. It needs one more kept version than the schedule (W(t-d-1)), so only the
  simulator runs it.
* ``dc`` (delay compensation, DC-ASGD): the optimizer receives
  ``g + lambda * g * g * (W(t) - W(t-d))`` (elementwise: a diagonal approximation of the Hessian
  by the squared gradient), applied after the tied-gradient sum and clipping, right before the
  optimizer. ``lambda`` defaults to 0.04, DC-ASGD's constant setting.
* ``lr-rescale`` (PipeMare-style warmup of the learning rate by delay): the learning rate of a
  parameter with delay d is multiplied by ``(1 + d) ** -p(t)``, ``p(t) = max(0, 1 - t / K)``, on top
  of the learning-rate schedule's multiplier: at step 0 the lr is divided by 1 + d, from step K on
  it is the schedule's. K defaults to ``max(1, total_steps // 10)`` (``default_rescale_steps``).

A parameter with delay 0 is left alone by every mitigation (each formula reduces to the plain
update there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .checks import non_negative, positive, real_number, whole_number

MITIGATIONS = ("none", "ef", "predict", "dc", "lr-rescale")
"""Every mitigation name (``--mitigation``)."""
ENGINE_MITIGATIONS = ("predict", "dc", "lr-rescale")
"""The mitigations a step engine applies itself; ``ef`` lives inside the optimizer."""
SIMULATOR_ONLY_MITIGATIONS = ("predict",)
"""Mitigations a multi-process pipeline refuses (a stage would need one more kept version)."""
DEFAULT_DC_LAMBDA = 0.04
"""DC-ASGD's constant lambda (its "DC-ASGD-c" setting), the strength of the compensation term."""


class MitigationError(ValueError):
    """A mitigation setting that cannot run; the message says what to change."""


def default_rescale_steps(total_steps: int) -> int:
    """K of ``lr-rescale`` when none is given: a tenth of the run, at least 1 step."""
    return max(1, int(total_steps) // 10)


@dataclass(frozen=True)
class MitigationSettings:
    """A validated mitigation as the step engines use it."""

    name: str = "none"
    """One of ``MITIGATIONS``."""
    dc_lambda: float = DEFAULT_DC_LAMBDA
    """Strength of the ``dc`` compensation term."""
    rescale_steps: Optional[int] = None
    """K of ``lr-rescale``: the steps over which the delay's lr reduction fades out."""

    @property
    def predicts(self) -> bool:
        """True for weight prediction (the engine computes on extrapolated weights)."""
        return self.name == "predict"

    @property
    def compensates(self) -> bool:
        """True for delay compensation (the engine corrects the gradient before the step)."""
        return self.name == "dc"

    @property
    def rescales_lr(self) -> bool:
        """True for the delay-dependent learning-rate warmup."""
        return self.name == "lr-rescale"

    def lr_multiplier(self, delay: int, step: int) -> float:
        """The lr factor of a parameter with ``delay`` at 0-based ``step`` (1.0 unless lr-rescale)."""
        if not self.rescales_lr:
            return 1.0
        return lr_rescale_multiplier(delay, step, self.rescale_steps)


def resolve_mitigation(name: Optional[str], dc_lambda: float = DEFAULT_DC_LAMBDA,
                       rescale_steps: Optional[int] = None) -> MitigationSettings:
    """Check a step engine's mitigation arguments; None means ``none``.

    ``rescale_steps`` is required for ``lr-rescale`` (an engine does not know the run's length;
    the run configuration supplies ``default_rescale_steps(steps)``)."""
    name = "none" if name is None else name
    if name not in MITIGATIONS:
        raise MitigationError(f"mitigation {name!r} is not one of {', '.join(MITIGATIONS)}")
    dc_lambda = real_number(dc_lambda, "dc_lambda", "a finite number >= 0", non_negative, error=MitigationError)
    if rescale_steps is not None:
        rescale_steps = whole_number(rescale_steps, "rescale_steps", "an integer >= 1", positive,
                                     error=MitigationError)
    if name == "lr-rescale" and rescale_steps is None:
        raise MitigationError("mitigation 'lr-rescale' needs rescale_steps=K (the steps over which the "
                              "delay's lr reduction fades out), e.g. default_rescale_steps(total_steps)")
    return MitigationSettings(name, float(dc_lambda), rescale_steps)


def lr_rescale_multiplier(delay: int, step: int, rescale_steps: int) -> float:
    """``(1 + delay) ** -p(step)`` with ``p(step) = max(0, 1 - step / rescale_steps)``: the lr
    factor of a parameter that computes ``delay`` steps behind, at 0-based ``step``."""
    if delay <= 0:
        return 1.0
    power = max(0.0, 1.0 - step / rescale_steps)
    return (1.0 + delay) ** -power


@torch.no_grad()
def predicted_weights(w_then: torch.Tensor, w_before: torch.Tensor, delay: int,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``w_then + delay * (w_then - w_before)``: W(t-d) extrapolated by its last update W(t-d) -
    W(t-d-1) to step t. Written into ``out`` when given (it may not alias either input)."""
    out = torch.sub(w_then, w_before, out=out)
    out.mul_(delay)
    return out.add_(w_then)


@torch.no_grad()
def delay_compensate_(grad: torch.Tensor, w_now: torch.Tensor, w_then: torch.Tensor, lam: float,
                      workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
    """In place: ``grad <- grad + lam * grad * grad * (w_now - w_then)``, one pass over whole
    tensors (a stage passes its flat gradient and weight buffers).

    Each factor is its own elementwise operation, rounded once, so an element's result does not
    depend on where it sits in the tensor: per-parameter tensors and one flat buffer give the same
    bits. ``workspace`` (shaped like ``grad``) avoids allocating the temporary each call."""
    term = torch.sub(w_now, w_then, out=workspace)
    term.mul_(grad)
    term.mul_(grad)
    term.mul_(lam)
    return grad.add_(term)


__all__ = ["DEFAULT_DC_LAMBDA", "ENGINE_MITIGATIONS", "MITIGATIONS", "SIMULATOR_ONLY_MITIGATIONS",
           "MitigationError", "MitigationSettings", "default_rescale_steps", "delay_compensate_",
           "lr_rescale_multiplier", "predicted_weights", "resolve_mitigation"]
