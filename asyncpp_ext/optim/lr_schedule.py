"""Learning-rate schedules: one multiplier per optimizer step, applied to every param group.

``LRSchedule.multiplier(t)`` is a closed form of the 0-based optimizer step ``t`` (pure Python
floats, so every pipeline stage and data-parallel replica computes the same bits without talking to
the others); ``apply_lr(optimizer, m)`` sets each group's ``lr`` to its base learning rate times
``m``. The base is kept in the group as ``"initial_lr"`` (the key torch's own schedulers use), so it
travels in ``optimizer.state_dict()`` and survives a checkpoint round trip, and a Muon hybrid's two
groups (Muon at ``lr``, AdamW at ``adamw_lr``) are scaled alike. The module needs only the
standard library, so pipeline stages and the trainer alike can import it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Optional

LR_SCHEDULES = ("constant", "cosine", "wsd", "linear")
"""Schedule kinds: constant (after warmup), cosine decay, warmup-stable-decay, linear decay (wsd
whose decay is everything after the warmup)."""

DECAY_SHAPES = ("linear", "1-sqrt", "cosine")
"""The shape of wsd's and linear's decay (--decay-shape): with p in (0, 1] the decay's progress,
the multiplier is r + (1 - r) * f(p), f = 1 - p (linear), 1 - sqrt(p) (1-sqrt: the cooldown that
Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations",
found to end lower than linear's) or (1 + cos(pi p)) / 2 (cosine); each reaches r at the last step."""

WSD_DEFAULT_DECAY_FRACTION_DIVISOR = 5
"""wsd without ``decay_steps`` decays over the last ``steps // 5`` steps (20 % of the run)."""


class LRScheduleError(ValueError):
    """A schedule setting that cannot run; the one-line message names the command-line flag."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class LRSchedule:
    """The learning-rate multiplier of every optimizer step of a run of ``steps`` steps.

    With T = ``steps``, W = ``warmup_steps``, D = ``effective_decay_steps`` and
    r = ``min_lr_ratio``, the multiplier of the 0-based step t (0 <= t < T; step t is the update
    that creates weight version t + 1) is:

    * warmup, any kind, t < W:  (t + 1) / W
      (starts at 1/W, not 0, so no step is wasted; reaches 1 at t = W - 1);
    * constant, t >= W:         1;
    * cosine, t >= W:           r + (1 - r) * 0.5 * (1 + cos(pi * (t - W) / (T - W)))
      (1 at t = W; the curve reaches r at t = T, one past the last step, so the last update runs
      at r + (1 - r) * 0.5 * (1 - cos(pi / (T - W))), slightly above r);
    * wsd, W <= t < T - D:      1  (the stable phase; empty when D = T - W);
    * wsd, t >= T - D:          r + (1 - r) * (T - 1 - t) / D
      (linear from 1 at t = T - D - 1, the last stable step, down to exactly r at the last step
      t = T - 1: each of the last D steps is below 1 when r < 1);
    * linear:                   wsd with D = T - W (no stable phase);
    * ``decay_shape`` "1-sqrt" or "cosine" (wsd, linear): r + (1 - r) * (1 - sqrt(p)) or
      r + (1 - r) * (1 + cos(pi * p)) / 2 in place of the linear decay, p = (t - (T - D) + 1) / D
      the decay's progress (1 - p = (T - 1 - t) / D: the linear decay's own factor).

    Call ``validate()`` before use; ``multiplier`` validates too and raises ``LRScheduleError``.
    """

    kind: str
    """One of ``LR_SCHEDULES`` (--lr-schedule)."""
    steps: int
    """T: the run's total number of optimizer steps (--steps)."""
    warmup_steps: int = 0
    """W: steps of linear warmup from 1/W to 1, for every kind; 0 = none (--warmup-steps)."""
    decay_steps: Optional[int] = None
    """D: length of wsd's final linear decay (--decay-steps); wsd only. None = 20 % of ``steps``
    (``steps // 5``), at least 1 and at most ``steps - warmup_steps``."""
    min_lr_ratio: float = 0.1
    """r in [0, 1]: the multiplier cosine, wsd and linear decay to (--min-lr-ratio). 0.1 follows the
    common practice of ending cosine runs at a tenth of the peak, and keeps every step a real
    update: with r = 0 wsd's last step would change nothing (a multiplier of exactly 0)."""
    decay_shape: str = "linear"
    """wsd's and linear's decay: one of ``DECAY_SHAPES`` (--decay-shape)."""

    @property
    def effective_decay_steps(self) -> int:
        """D as wsd uses it: ``decay_steps``, or the default when it is None (0 when the warmup
        covers the whole run)."""
        room = self.steps - self.warmup_steps
        if self.kind == "linear":
            return room
        if self.decay_steps is not None:
            return self.decay_steps
        return min(max(1, self.steps // WSD_DEFAULT_DECAY_FRACTION_DIVISOR), room)

    def validate(self, names: Optional[Mapping[str, str]] = None) -> None:
        """Raise ``LRScheduleError`` (a ``ValueError``) naming the first field that cannot run.
        ``names`` maps a field to what the message calls it (a command line passes its flags,
        e.g. ``{"warmup_steps": "--warmup-steps"}``); by default, the field's own name."""
        kind, steps, warmup, decay, ratio, shape = (
            (names or {}).get(f, f) for f in ("kind", "steps", "warmup_steps", "decay_steps", "min_lr_ratio",
                                              "decay_shape"))
        if self.kind not in LR_SCHEDULES:
            raise LRScheduleError(f"{kind} {self.kind!r} is not one of {', '.join(LR_SCHEDULES)}")
        if not _is_int(self.steps) or self.steps < 1:
            raise LRScheduleError(f"{steps} must be a positive integer, got {self.steps!r}")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise LRScheduleError(f"{warmup} must be a non-negative integer, got {self.warmup_steps!r}")
        if self.warmup_steps > self.steps:
            raise LRScheduleError(f"{warmup} {self.warmup_steps} exceeds {steps} {self.steps}; "
                                  f"use at most {self.steps} warmup steps")
        if self.decay_steps is not None:
            if self.kind != "wsd":
                raise LRScheduleError(f"{decay} only applies to {kind} wsd, not {self.kind!r}; "
                                      f"drop {decay} or use {kind} wsd")
            room = self.steps - self.warmup_steps
            if not _is_int(self.decay_steps) or not 0 < self.decay_steps <= room:
                raise LRScheduleError(f"{decay} must be an integer in 1..{room} ({steps} {self.steps} "
                                      f"minus {warmup} {self.warmup_steps}), got {self.decay_steps!r}")
        r = self.min_lr_ratio
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0.0 <= r <= 1.0:  # NaN fails too
            raise LRScheduleError(f"{ratio} must be a number in [0, 1], got {r!r}")
        if self.decay_shape not in DECAY_SHAPES:
            raise LRScheduleError(f"{shape} {self.decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
        if self.decay_shape != "linear" and self.kind not in ("wsd", "linear"):
            raise LRScheduleError(f"{shape} {self.decay_shape} shapes the decay of {kind} wsd or linear, not "
                                  f"{self.kind!r}; drop {shape} or use {kind} wsd")

    def multiplier(self, t: int) -> float:
        """The learning-rate multiplier of 0-based optimizer step ``t`` (see the class docstring)."""
        self.validate()
        if not _is_int(t) or not 0 <= t < self.steps:
            raise LRScheduleError(f"optimizer step {t!r} is outside the schedule's steps 0..{self.steps - 1} "
                                  f"(steps {self.steps})")
        T, W, r = self.steps, self.warmup_steps, float(self.min_lr_ratio)
        if t < W:
            return (t + 1) / W
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * (t - W) / (T - W)))
        D = self.effective_decay_steps  # wsd or linear; D >= 1 here because t >= W and t < T
        if t < T - D:
            return 1.0
        if self.decay_shape == "linear":
            return r + (1.0 - r) * (T - 1 - t) / D  # this order gives exactly r at t = T - 1
        p = (t - (T - D) + 1) / D  # the decay's progress, 1 at the last step
        if self.decay_shape == "1-sqrt":
            return r + (1.0 - r) * (1.0 - math.sqrt(p))
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))

    def multipliers(self) -> list[float]:
        """``multiplier(t)`` for every step of the run, t = 0..steps-1 (validated first: a schedule
        of no steps or fewer than none would otherwise give an empty list, silently)."""
        self.validate()
        return [self.multiplier(t) for t in range(self.steps)]


def check_lr_schedule(schedule) -> None:
    """What a Pipeline or a simulator is given as its schedule: None, or an object with
    ``multiplier(step)`` (TypeError otherwise), validated where it can say (``LRScheduleError``:
    a schedule of no steps would give no multipliers)."""
    if schedule is not None and not callable(getattr(schedule, "multiplier", None)):
        raise TypeError(f"lr_schedule must be an LRSchedule (asyncpp_ext.optim.lr_schedule) or None, "
                        f"got {type(schedule).__name__}")
    if callable(getattr(schedule, "validate", None)):
        schedule.validate()


def apply_lr(optimizer, multiplier: float) -> list[float]:
    """Set every param group's ``lr`` to its base learning rate times ``multiplier``.

    The base is the group's ``lr`` the first time a group is seen, kept as ``group["initial_lr"]``
    (``setdefault``: later calls, and a group restored from a checkpoint that carries the key, keep
    it). Works for any ``torch.optim.Optimizer`` whose step reads ``group["lr"]``: asyncpp's fused
    AdamW, Muon, MuonHybrid (each group scaled from its own base), ``torch.optim.SGD`` and
    ``ErrorFeedback`` (whose groups are its base optimizer's). Returns the groups' new lrs.
    """
    if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real) \
            or not math.isfinite(multiplier) or multiplier < 0:
        raise LRScheduleError(f"a learning-rate multiplier must be a finite number >= 0, got {multiplier!r}")
    multiplier = float(multiplier)
    lrs = []
    for group in optimizer.param_groups:
        base = group.setdefault("initial_lr", group["lr"])
        group["lr"] = base * multiplier
        lrs.append(group["lr"])
    return lrs


__all__ = ["LR_SCHEDULES", "DECAY_SHAPES", "LRSchedule", "LRScheduleError", "apply_lr", "check_lr_schedule"]
