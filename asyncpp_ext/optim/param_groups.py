"""Named parameters for torch.optim on every supported torch.

The optimizers here are built from (name, tensor) pairs so that each param group carries
"param_names" (error messages and checkpoints name parameters). torch >= 2.6 splits such pairs
itself; torch 2.5 accepts only tensors. Splitting them before torch sees them gives the same
param groups on both.
"""
from __future__ import annotations

import torch


def named_param_groups(params) -> list:
    """``params`` as ``torch.optim.Optimizer`` takes them (tensors, (name, tensor) pairs, or param
    group dicts of either), with every group's pairs split into "params" and "param_names"."""
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    if items and isinstance(items[0], dict):
        return [_split(group) for group in items]
    if items and isinstance(items[0], tuple):
        return [_split({"params": items})]
    return items


def _split(group: dict) -> dict:
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    named = [isinstance(p, tuple) for p in params]
    if not any(named):
        return dict(group, params=params)
    if not all(named) or any(len(p) != 2 for p in params):
        raise ValueError("optimizer params must all be tensors or all be (name, tensor) pairs; "
                         "this group mixes them")
    return dict(group, params=[p for _, p in params], param_names=[n for n, _ in params])


def param_label(group, gi, pi) -> str:
    """How messages name parameter ``pi`` of param group ``gi``: its name when the group has names."""
    names = group.get("param_names")
    if names is not None and pi < len(names):
        return f"parameter '{names[pi]}'"
    return f"parameter {pi} of param group {gi}"


def check_listed_once(groups, group) -> None:
    """ValueError naming a tensor that ``group`` (about to become param group ``len(groups)``)
    lists twice or that one of ``groups`` already holds: torch would step it once per listing.
    A tied weight (one tensor under two names) is listed once, as ``named_parameters()`` gives it."""
    where = {}
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            where.setdefault(id(p), param_label(g, gi, pi))
    for pi, p in enumerate(group["params"]):
        label = param_label(group, len(groups), pi)
        if id(p) in where:
            raise ValueError(f"{label} is the same tensor as {where[id(p)]}, so it would be stepped twice; "
                             "list each parameter once (one name for a tied weight)")
        where[id(p)] = label
