"""Optimizer state keyed by global parameter names, so a checkpoint written by one pipeline split
(or by the single-process simulator) loads into another: stages hold different slices of the model,
and torch's ``state_dict`` numbers parameters by their position in one optimizer."""
from __future__ import annotations

import torch
from torch import nn


def _param_order(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Global names of the optimizer's parameters in its state_dict index order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """``optimizer.state_dict()`` with parameter indices replaced by global parameter names."""
    order = _param_order(optimizer, model)
    raw = optimizer.state_dict()
    return {
        "state": {order[i]: dict(s) for i, s in raw["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                         for g in raw["param_groups"]],
    }


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: nn.Module,
                                 state: dict) -> None:
    """Inverse of ``optimizer_state_by_name`` for an optimizer built the same way."""
    order = _param_order(optimizer, model)
    index = {n: i for i, n in enumerate(order)}
    named = set(state["state"]) | {n for g in state["param_groups"] for n in g["params"]}
    unknown = sorted(named - set(index))
    if unknown:
        raise ValueError(f"optimizer state names parameter(s) {unknown[:3]} this optimizer does "
                         "not hold; build the optimizer the same way as the saved run")
    optimizer.load_state_dict({
        "state": {index[n]: s for n, s in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                         for g in state["param_groups"]],
    })


def regroup_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, named) -> dict:
    """Rebuild a by-name optimizer state in ``optimizer``'s own group layout.

    ``saved`` may come from another pipeline depth (its groups split or merged differently);
    each current group takes its hyperparameters from the saved group that held its first
    parameter. ``named`` is a model or anything with ``named_parameters()``.
    """
    order = _param_order(optimizer, named)
    group_of = {n: g for g in saved["param_groups"] for n in g["params"]}
    groups, start = [], 0
    for g in optimizer.param_groups:
        names = order[start:start + len(g["params"])]
        start += len(g["params"])
        missing = [n for n in names if n not in group_of]
        if missing:
            raise ValueError(f"the saved optimizer state has no parameter {missing[0]!r}; resume "
                             "with the model and optimizer the checkpoint was written with")
        groups.append({**group_of[names[0]], "params": names})
    return {"state": {n: saved["state"][n] for n in order if n in saved["state"]},
            "param_groups": groups}


__all__ = ["optimizer_state_by_name", "load_optimizer_state_by_name", "regroup_optimizer_state"]
