"""build_optimizer: the one constructor the trainer calls; every default comes from the registry."""
from __future__ import annotations

import torch

from .checks import non_negative, positive, real_number, unit_interval
from .decay import split_by_decay, undecayed_names
from .error_feedback import ErrorFeedback
from .fused import check_ef_source
from .library import build_library_optimizer
from .optimizers import AdamW, MuonHybrid
from .param_groups import named_param_groups
from .registry import DEFAULT_EF_SOURCE, DEFAULT_WEIGHT_DECAY, muon_family, optimizer_spec


class OptimizerArgumentError(ValueError):
    """An argument of build_optimizer that does not fit the optimizer asked for."""


def build_optimizer(model: torch.nn.Module, name: str, lr: float | None = None,
                    weight_decay: float = DEFAULT_WEIGHT_DECAY, ef_beta: float | None = None,
                    adamw_lr: float | None = None, shard_group=None, ef_source: str = DEFAULT_EF_SOURCE,
                    decay_norms_and_biases: bool = True, decay_embeddings: bool = True,
                    **kwargs) -> torch.optim.Optimizer:
    """An optimizer for `model` (a whole model or one pipeline stage's part of it).

    Every argument left out (or None) takes the registry's default for `name` (optim/registry.py,
    the same numbers ``asyncpp-train`` uses): lr, ef_beta, adamw_lr and momentum.

    name (one of registry.OPTIMIZERS):
      "muon"  -> MuonHybrid: Muon (at `lr`) for hidden 2-D matrices, AdamW for embeddings, the output
                 head, norms, biases and other tensors at `adamw_lr` (default 3e-3). Routing does not
                 assume the embedding or head are present. kwargs go to MuonHybrid (momentum,
                 default 0.95, nesterov, ns_steps, ns_dtype, adjust_lr_fn, adamw_betas, is_muon, ...).
      "normuon" -> the same with normuon=True: NorMuon's per-row normalisation of the Muon update
                 (normuon.py); kwargs as for "muon", plus normuon_beta2.
      "adamw" -> the fused AdamW at `lr`; kwargs: betas, eps.
      "sgd"   -> torch.optim.SGD(momentum=0.9 unless given in kwargs), wrapped in ErrorFeedback
                 when ef_beta > 0 (its default is 0).
      "lion", "adan", "soap", "mars" -> pytorch_optimizer's class (library.py; needs the extra
                 `study`), all parameters in one group, kwargs to the class; wrapped in
                 ErrorFeedback when ef_beta > 0.
    weight_decay is decoupled (AdamW/Muon, and as each library optimizer applies it) or L2 (SGD);
    decay_norms_and_biases=False leaves tensors of fewer than 2 dimensions undecayed,
    decay_embeddings=False the embedding tables (a tied head with them): decay.py. They then sit
    in param groups of their own with weight decay 0.
    ef_beta > 0 turns on error feedback (fused into the kernels for "muon", "normuon" and "adamw",
    the ErrorFeedback wrapper for the others); pass 0 to turn it off (the default is 0.5 for every
    optimizer but sgd). ef_source ("buffer" = E is the stored previous update) is handed to the
    optimizer or wrapper that does EF, and only when it is not "buffer", the constructors' default.
    shard_group (a data-parallel process group) splits Muon's orthogonalisations among its ranks;
    the other optimizers ignore it.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    spec = optimizer_spec(name)  # a ValueError naming the valid names
    # The numbers as Python floats (a NumPy scalar becomes one), or one ValueError naming the argument.
    lr = real_number(spec.lr if lr is None else lr, "lr", "a finite number > 0", positive)
    if adamw_lr is not None:
        adamw_lr = real_number(adamw_lr, "adamw_lr", "a finite number > 0", positive)
    weight_decay = real_number(weight_decay, "weight_decay", "a finite number >= 0", non_negative)
    ef_beta = real_number(spec.ef_beta if ef_beta is None else ef_beta, "ef_beta",
                          "a finite number >= 0 (0 = off)", non_negative)
    if spec.momentum is not None and kwargs.get("momentum") is None:
        kwargs["momentum"] = spec.momentum
    if kwargs.get("momentum") is not None:
        kwargs["momentum"] = real_number(kwargs["momentum"], "momentum", "in [0, 1)", unit_interval)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters")

    for flag, value in (("decay_norms_and_biases", decay_norms_and_biases), ("decay_embeddings", decay_embeddings)):
        if not isinstance(value, bool):
            raise ValueError(f"{flag} must be True or False, got {value!r}")
    undecayed = undecayed_names(model, decay_norms_and_biases, decay_embeddings) & {n for n, _ in named}
    groups = split_by_decay(dict(params=named, weight_decay=weight_decay), undecayed)

    ef = dict(ef_source=check_ef_source(ef_source))  # checked even where no EF runs: a typo is a typo
    if spec.family == "muon":
        fixed = {k for n in muon_family() for k in optimizer_spec(n).build_kwargs} & set(kwargs)
        if fixed:  # the name chooses them (normuon=)
            setters = [n for n in muon_family() if fixed & set(optimizer_spec(n).build_kwargs)]
            others = [n for n in muon_family() if n not in setters]
            raise OptimizerArgumentError(f"pass name={' or '.join(map(repr, setters))} (or "
                                         f"{' or '.join(map(repr, others))}) instead of "
                                         f"{', '.join(f'{k}=' for k in sorted(fixed))} in kwargs")
        return MuonHybrid(model, lr=lr, adamw_lr=spec.adamw_lr if adamw_lr is None else adamw_lr,
                          weight_decay=weight_decay, ef_beta=ef_beta, shard_group=shard_group,
                          no_decay_names=sorted(undecayed), **spec.build_kwargs, **ef, **kwargs)
    if adamw_lr is not None:
        raise ValueError(f"adamw_lr is only used with the muon family {muon_family()}; for {name!r} pass lr")
    if spec.family == "adamw":
        return AdamW(groups, lr=lr, weight_decay=weight_decay, ef_beta=ef_beta, **ef, **kwargs)
    if spec.family == "library":
        opt = build_library_optimizer(named, name, lr, weight_decay, undecayed=undecayed, **kwargs)
    else:  # sgd
        opt = torch.optim.SGD(named_param_groups(groups), lr=lr, weight_decay=weight_decay, **kwargs)
    return ErrorFeedback(opt, ef_beta, **ef) if ef_beta > 0 else opt
