"""The optimizer step of a versioned weight store: W(t+1) is written into another buffer than W(t).

A delayed schedule keeps several weight versions (docs/design.md §1.3, §1.16). At optimizer step t
each parameter handle the optimizer holds is pointed at the *destination* buffer -- one whose
version no instruction needs any more (in 2bw: W(t-1)) -- and the step reads W(t) from ``sources``
and writes W(t+1) into the parameter. ``previous`` (W(t-1) per parameter; it may be the very
storage of the destination, as in 2bw) gives error feedback with ``ef_source="weights"`` its
previous update W(t) - W(t-1) without a buffer of its own (docs/design.md §1.5).

Optimizers that implement ``step_from(sources, previous)`` (the fused ones and ErrorFeedback) read
W(t) straight from ``sources``: no copy. Any other optimizer gets W(t) copied into the destination
and then steps in place, which is bitwise the same update.
"""
from __future__ import annotations

from typing import Mapping

import torch

EF_SOURCES = ("buffer", "weights")
"""Where error feedback takes its previous update E from: "buffer" keeps the optimizer's last raw
update D(t-1) in a buffer of its own (one extra model-sized tensor); "weights" reads the applied
update W(t) - W(t-1) from the weight versions a delayed schedule keeps anyway (no extra memory)."""


class VersionedStepError(ValueError):
    """A versioned step that cannot run as asked; the message says what to change."""


def wants_previous_weights(optimizer) -> bool:
    """True when ``optimizer`` runs error feedback with ef_source "weights", so the engine must pass
    W(t-1) as ``previous`` (from the second step on; the first step has no previous update)."""
    if getattr(optimizer, "ef_source", "buffer") != "weights":
        return False
    beta = getattr(optimizer, "beta", None)
    if beta is not None:  # the ErrorFeedback wrapper: its beta, not its base's groups' ef_beta (0 there)
        return beta > 0
    return any(g.get("ef_beta", 0.0) > 0 for g in optimizer.param_groups)


@torch.no_grad()
def step_versioned(optimizer, sources: Mapping[torch.Tensor, torch.Tensor] | None = None,
                   previous: Mapping[torch.Tensor, torch.Tensor] | None = None):
    """One optimizer step that writes W(t+1) into the parameters' storage.

    sources: parameter -> the tensor holding its W(t); None = the parameters hold W(t) (in place).
    previous: parameter -> the tensor holding its W(t-1), for EF with ef_source "weights"; a
        parameter missing from it is updated without the correction (its first step, or a
        parameter that computes on the newest weights). None = no previous versions.
    """
    step_from = getattr(optimizer, "step_from", None)
    if step_from is not None:
        return step_from(sources, previous)
    if previous:
        raise VersionedStepError(f"{type(optimizer).__name__} cannot use previous weight versions; only "
                                 "error feedback with ef_source='weights' reads them")
    copy_sources(sources)
    return optimizer.step()


@torch.no_grad()
def copy_sources(sources: Mapping[torch.Tensor, torch.Tensor] | None) -> None:
    """W(t) into each parameter's storage (the in-place half of a versioned step); a source that is
    the parameter's own storage is left alone."""
    for p, src in (sources or {}).items():
        if src.data_ptr() != p.data_ptr():
            p.copy_(src)


__all__ = ["EF_SOURCES", "VersionedStepError", "copy_sources", "step_versioned", "wants_previous_weights"]
