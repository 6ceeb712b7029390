"""Gradient clipping by the previous step's global norm (docs/design.md §1.14).

A global norm needs every stage's gradient of the same step, and the first stage finishes a step
last: clipping step t by its own norm would make every other stage wait for it. Instead step t is
clipped by the norm of step t-1's gradient, which every stage has long finished::

    c(t) = min(1, X / (‖g(t-1)‖ + 1e-6)),   c(0) = 1,   g(t) <- c(t)·g(t)

‖g‖ is taken over every optimizer parameter of every stage (a tied tensor once, after its uses'
gradients are summed) before clipping. Skipped steps (non-finite values) leave the remembered norm
as it was. The norm is assembled the same way everywhere: one squared float32 norm per parameter,
added in global parameter order in float64, so the pipeline and the simulator agree bit for bit.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""
KEPT_NORMS = 65536
"""The newest steps' norms kept for the metrics (``take_grad_norms``) until they are taken."""


def norm_terms(grads: Iterable[torch.Tensor]) -> list[float]:
    """Squared L2 norm of each gradient (reduced in the gradient's dtype, squared as a Python
    float). The norms are computed on the gradients' device and read in one copy: a read per
    gradient would make the host wait for the device once per parameter (hundreds per step)."""
    norms = [torch.linalg.vector_norm(g) for g in grads]
    if not norms:
        return []
    # float64 holds every float32 and bfloat16 value exactly: the same numbers as reading each
    return [value ** 2 for value in torch.stack([n.double() for n in norms]).tolist()]


def block_of(name: str, prefixes: Sequence[str]) -> str:
    """The block a global parameter name belongs to: the longest of ``prefixes`` (the blocks' names
    in the model, ``ties.block_prefixes``) that it starts with."""
    owners = [p for p in prefixes if name == p or name.startswith(p + ".")]
    return max(owners, key=len) if owners else name


def block_norms(terms: Iterable[float], labels: Iterable[str]) -> dict[str, float]:
    """Each block's gradient norm from the squared norms ``terms`` of its parameters (``labels``:
    each term's block), the terms added in the given order -- the global norm's own order, so a
    pipeline and its simulation give the same bits (--log-block-grad-norms)."""
    sums: dict[str, float] = {}
    for value, label in zip(terms, labels):
        sums[label] = sums.get(label, 0.0) + value
    return {label: math.sqrt(total) for label, total in sums.items()}


def keep_norm(norms: dict, step: int, norm: float) -> None:
    """Record step ``step``'s ``norm`` for ``take_grad_norms``, dropping the oldest past
    ``KEPT_NORMS`` (a Pipeline or simulator used without a Trainer: nobody takes them)."""
    norms[step] = norm
    if len(norms) > KEPT_NORMS:
        del norms[next(iter(norms))]


def total_norm(terms: Iterable[float]) -> float:
    """sqrt of the terms added one by one in the given order."""
    total = 0.0
    for t in terms:
        total += t
    return math.sqrt(total)


def clip_coefficient(max_norm: float, previous_norm: Optional[float]) -> float:
    """c(t) from the previous step's norm (1 at the first step or without a previous norm)."""
    if previous_norm is None:
        return 1.0
    return min(1.0, max_norm / (previous_norm + EPS))


def check_max_norm(max_norm) -> float:
    """``max_norm`` as a float; ValueError unless it is a number > 0. ``math.inf`` measures each
    step's norm (for the metrics) and never clips: c(t) = 1, the gradients untouched."""
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
            and not math.isnan(max_norm) and max_norm > 0):
        raise ValueError(f"clip_grad_norm must be a number > 0 (inf: measure the norm, never clip; None: "
                         f"neither), got {max_norm!r}")
    return float(max_norm)


class PreviousNormClipper:
    """The rule for one process that sees every gradient (the simulator)."""

    def __init__(self, max_norm: float):
        self.max_norm = check_max_norm(max_norm)
        self.previous_norm: Optional[float] = None
        self.last_terms: list = []

    @torch.no_grad()
    def clip(self, grads: Sequence[torch.Tensor], skipped: bool) -> float:
        """Scale ``grads`` by c(t); remember this step's norm unless it is skipped. Returns c(t)."""
        coefficient = clip_coefficient(self.max_norm, self.previous_norm)
        if not skipped:
            self.last_terms = norm_terms(grads)  # each gradient's squared norm (block norms read them)
            self.previous_norm = total_norm(self.last_terms)
            if coefficient < 1.0:
                for g in grads:
                    g.mul_(coefficient)
        return coefficient

    def state_dict(self) -> dict:
        return {"previous_norm": self.previous_norm}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.previous_norm = None if not state else state.get("previous_norm")


__all__ = ["EPS", "KEPT_NORMS", "block_of", "block_norms", "keep_norm", "norm_terms", "total_norm", "clip_coefficient", "PreviousNormClipper"]
