"""A pipeline stage's checkpoint state, keyed by global parameter names (the layout the
DelaySimulator writes too, so a checkpoint loads at any pipeline depth): the newest weights W(k),
the older versions the stage keeps, its optimizer state and its step count. ``StageHost.state_dict``
and ``StageHost.load_state_dict`` call these."""
from __future__ import annotations

from typing import Sequence

import torch

from ..optim.state import load_optimizer_state_by_name, optimizer_state_by_name, regroup_optimizer_state


def _named_opt_params(host, names: Sequence[str]):
    """The optimizer's parameter handles under their global names (what the optimizer-state
    helpers key on)."""
    pairs = list(zip(names, host.opt_params))

    class _Named:
        @staticmethod
        def named_parameters():
            return iter(pairs)
    return _Named()


def _unflatten(host, flat: torch.Tensor, names: Sequence[str]) -> dict:
    out, offset = {}, 0
    for name, p in zip(names, host.opt_params):
        out[name] = flat[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()
    return out


def newest_params(host, names: Sequence[str]) -> dict:
    """The newest weights W(k) by name (copies, on the stage's device)."""
    return _unflatten(host, host.buffer_for(host.newest_version()), names)


def stage_state_dict(host, names: Sequence[str]) -> dict:
    """Newest weights W(k) (``params``), W(k-1) (``stash``) and W(k-2)..W(k-n+1) (``older``, as
    lists by name) for the versions ``host`` keeps (versions before 0 are W(0)), optimizer state,
    step count."""
    k = host.newest_version()
    params = newest_params(host, names)
    lags = [_unflatten(host, host._held_buffer(k - lag), names) for lag in range(1, host.num_versions)]
    stash = lags[0] if lags else {}
    older = {n: [lag[n] for lag in lags[1:]] for n in names} if len(lags) > 1 else {}
    optimizer = (optimizer_state_by_name(host.optimizer, _named_opt_params(host, names))
                 if host.optimizer is not None else {"state": {}, "param_groups": []})
    state = {"schedule": host.schedule,
             "steps_done": k, "params": params, "stash": stash, "optimizer": optimizer}
    if older:
        state["older"] = older
    return state


def engine_state(state) -> dict:
    """``state`` as ``load_stage_state`` takes it: a ``Pipeline.state_dict()`` (or the simulator's,
    or several merged), or a checkpoint's shard as ``load_checkpoint`` reads it (its ``engine``
    part); TypeError (one line) for anything else."""
    if isinstance(state, dict) and isinstance(state.get("engine"), dict):
        state = state["engine"]
    if not isinstance(state, dict) or not isinstance(state.get("params"), dict) or "steps_done" not in state:
        raise TypeError("state must be a dict from Pipeline.state_dict() (or a checkpoint's shard), got "
                        f"{type(state).__name__}" + (f" with keys {sorted(state)[:6]}" if isinstance(state, dict) else ""))
    return state


def load_stage_state(host, state: dict, names: Sequence[str]) -> None:
    """Load a state written at any pipeline depth into ``host`` (only its names are taken)."""
    state = engine_state(state)
    missing = [n for n in names if n not in state["params"]]
    if missing:
        raise ValueError(f"the state has no weights for {missing[0]!r}: it holds another model's, or another "
                         "stage's share (merge a checkpoint's shards first: "
                         "asyncpp_ext.training.merge_engine_states(shards))")
    for name, p in zip(names, host.opt_params):  # before anything is written
        for section in ("params", "stash"):
            saved = state.get(section, {}).get(name)
            if saved is not None and tuple(saved.shape) != tuple(p.shape):
                raise ValueError(f"the checkpoint's {name!r} has shape {tuple(saved.shape)}, this model's "
                                 f"{tuple(p.shape)}; it was written for another model shape")
    k = int(state["steps_done"])
    newest = k % len(host.flat)

    def fill(flat: torch.Tensor, tensors: dict) -> None:
        offset = 0
        for name, p in zip(names, host.opt_params):
            flat[offset:offset + p.numel()].copy_(tensors[name].reshape(-1))
            offset += p.numel()

    if host.copies is not None:  # the buffers change under the compute copies
        host.copies.invalidate()
    fill(host.flat[newest], state["params"])
    host.version_in[newest] = k
    for lag in range(1, host.num_versions):
        buffer = (k - lag) % host.num_versions
        if k - lag < 0:  # not created yet; W(0) (buffer 0) stands for it
            host.version_in[buffer] = -1
            continue
        if lag == 1:
            if any(n not in state.get("stash", {}) for n in names):
                raise ValueError("the checkpoint holds no older weight version W(k-1); it was "
                                 f"not written by a {host.schedule} run")
            fill(host.flat[buffer], state["stash"])
        else:
            older = state.get("older", {})
            if any(len(older.get(n, [])) < lag - 1 for n in names):
                raise ValueError(f"the checkpoint holds no weight version W(k-{lag}); it was not "
                                 f"written by a {host.schedule} run of this depth")
            fill(host.flat[buffer], {n: older[n][lag - 2] for n in names})
        host.version_in[buffer] = k - lag
    if host.optimizer is not None:
        named = _named_opt_params(host, names)
        if host.ring:
            host._point_handles(newest)
        load_optimizer_state_by_name(host.optimizer, named,
                                     regroup_optimizer_state(state["optimizer"], host.optimizer, named))


__all__ = ["stage_state_dict", "load_stage_state"]
