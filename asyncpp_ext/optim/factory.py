"""build_optimizer: the one constructor the trainer calls."""
from __future__ import annotations

import math

import torch

from .error_feedback import ErrorFeedback
from .library import LIBRARY_OPTIMIZERS, build_library_optimizer
from .optimizers import AdamW, MuonHybrid
from .param_groups import named_param_groups

MUON_NAMES = ("muon", "normuon")
"""The names built as MuonHybrid (Muon or NorMuon matrices, an AdamW part for the rest)."""
NAMES = ("adamw", "muon", "normuon", "sgd") + tuple(LIBRARY_OPTIMIZERS)
DEFAULT_ADAMW_LR_FOR_MUON = 3e-4
DEFAULT_EF_SOURCE = "buffer"


class OptimizerArgumentError(ValueError):
    """An argument of build_optimizer that does not fit the optimizer asked for."""


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.0,
                    ef_beta: float = 0.0, adamw_lr: float | None = None, shard_group=None,
                    ef_source: str = DEFAULT_EF_SOURCE, **kwargs) -> torch.optim.Optimizer:
    """An optimizer for `model` (a whole model or one pipeline stage's part of it).

    name:
      "muon"  -> MuonHybrid: Muon (at `lr`) for hidden 2-D matrices, AdamW for embeddings, the output
                 head, norms, biases and other tensors at `adamw_lr` (default 3e-4). Routing does not
                 assume the embedding or head are present. kwargs go to MuonHybrid (momentum,
                 nesterov, ns_steps, ns_dtype, adjust_lr_fn, adamw_betas, is_muon, ...).
      "normuon" -> the same with normuon=True: NorMuon's per-row normalisation of the Muon update
                 (normuon.py); kwargs as for "muon", plus normuon_beta2.
      "adamw" -> the fused AdamW at `lr`; kwargs: betas, eps.
      "sgd"   -> torch.optim.SGD(momentum=0.9 unless given in kwargs), wrapped in ErrorFeedback
                 when ef_beta > 0.
      "lion", "adan", "soap", "mars" -> pytorch_optimizer's class (library.py; needs the extra
                 `study`), all parameters in one group, kwargs to the class; wrapped in
                 ErrorFeedback when ef_beta > 0.
    weight_decay is decoupled (AdamW/Muon, and as each library optimizer applies it) or L2 (SGD).
    ef_beta > 0 turns on error feedback (fused into the kernels for "muon", "normuon" and "adamw",
    the ErrorFeedback wrapper for the others). ef_source ("buffer" = E is the stored previous
    update) is handed to the optimizer or wrapper that does EF, and only when it is not
    "buffer", the constructors' default. shard_group (a data-parallel process group) splits
    Muon's orthogonalisations among its ranks; the other optimizers ignore it.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if name not in NAMES:
        raise ValueError(f"name must be one of {NAMES}, got {name!r}")
    for arg, value in (("lr", lr), ("adamw_lr", adamw_lr)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{arg} must be a finite number > 0, got {value!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if not (math.isfinite(ef_beta) and ef_beta >= 0):
        raise ValueError(f"ef_beta must be >= 0 (0 = off), got {ef_beta!r}")
    momentum = kwargs.get("momentum")
    if momentum is not None and not (0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters")

    ef = dict(ef_source=ef_source)
    if name in MUON_NAMES:
        if "normuon" in kwargs:
            raise OptimizerArgumentError("pass name='normuon' (or 'muon') instead of normuon= in kwargs")
        return MuonHybrid(model, lr=lr, adamw_lr=DEFAULT_ADAMW_LR_FOR_MUON if adamw_lr is None else adamw_lr,
                          weight_decay=weight_decay, ef_beta=ef_beta, shard_group=shard_group,
                          normuon=name == "normuon", **ef, **kwargs)
    if adamw_lr is not None:
        raise ValueError(f"adamw_lr is only used with name='muon' or 'normuon'; for {name!r} pass lr")
    if name == "adamw":
        return AdamW(named, lr=lr, weight_decay=weight_decay, ef_beta=ef_beta, **ef, **kwargs)
    if name in LIBRARY_OPTIMIZERS:
        opt = build_library_optimizer(named, name, lr, weight_decay, **kwargs)
    else:
        sgd_kwargs = dict(momentum=0.9)
        sgd_kwargs.update(kwargs)
        opt = torch.optim.SGD(named_param_groups(named), lr=lr, weight_decay=weight_decay, **sgd_kwargs)
    return ErrorFeedback(opt, ef_beta, **ef) if ef_beta > 0 else opt
