"""A stage's parameters as views of one flat buffer per weight version (and its gradients as
views of one flat gradient buffer): switching a replica to another version, or the optimizer's
handles to another buffer, is pointing views, never copying tensors (docs/design.md §1.3)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn


def flatten_into(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy ``params`` into ``flat`` and make each parameter a view of its slice."""
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + n].view_as(p)
        offset += n


def views_of(params: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """One view of ``flat`` per parameter, shaped like it, in the flattening order."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def point_at(params: Sequence[torch.Tensor], flat: torch.Tensor, attr: str = "data") -> None:
    """Point each parameter's ``.data`` (or, with ``attr="grad"``, its ``.grad``) at its slice of
    ``flat``."""
    for p, view in zip(params, views_of(params, flat)):
        if attr == "data":
            p.data = view
        else:
            p.grad = view


__all__ = ["flatten_into", "views_of", "point_at"]
