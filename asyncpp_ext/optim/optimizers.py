"""Public fused optimizers: Muon (2-D matrices), AdamW, and MuonHybrid (Muon + auxiliary AdamW)."""
from __future__ import annotations

import torch

from .decay import split_by_decay
from .fused import ADAMW, MUON, FusedOptimizer
from .newton_schulz import NS_COEFFICIENTS
from .normuon import NORMUON_BETA2
from .registry import OPTIMIZERS
from .routing import split_named_parameters


def _named(params):
    """Keep (name, tensor) pairs as given; plain tensors stay plain (torch names nothing then)."""
    return list(params) if not isinstance(params, torch.Tensor) else [params]



def _as_tuple(values):
    """A list or tuple of hyperparameters as a tuple; anything else as given, for the group's
    check to refuse with its one line (tuple() of a float would fail first, naming no argument)."""
    return tuple(values) if isinstance(values, (list, tuple)) else values

class Muon(FusedOptimizer):
    """Muon for 2-D hidden weight matrices, with fused float32 kernels.

    Per matrix: B <- mu*B + (1-mu)*G; V = (1-mu)*G + mu*B (nesterov) or B; O = NS5(V / (||V||_F + eps))
    on the wide side; W <- W*(1 - lr*wd) - lr*s*O with s from `adjust_lr_fn` ("original":
    max(1, rows/cols)^0.5, "match_rms_adamw": 0.2*sqrt(max(rows, cols))). Arguments mirror
    torch.optim.Muon; note torch divides by max(||V||, eps) where this divides by ||V|| + eps, which
    differs only for near-zero V.

    Extra arguments: `ns_dtype` (torch.float32 | torch.bfloat16 | None = float32 on CPU, bfloat16 on
    CUDA), `ef_beta` (error-feedback strength; 0 = off and no buffer) and `ef_source` (where EF takes
    the previous update from: "buffer" = a buffer of its own, "weights" = W(t) - W(t-1) from the
    versions `step_from(sources, previous)` is given; see versioned.py).
    `normuon=True` turns it into NorMuon (see normuon.py): O is divided row by row by the root of a
    running mean of its squared rows (decay `normuon_beta2`, state "normuon_v", one float per row)
    and rescaled to its former Frobenius norm before the lr scale above applies.
    Parameters must be float32 and 2-D (other tensors belong to AdamW: use MuonHybrid).
    `shard_group`: a data-parallel process group whose ranks hold identical gradients; each rank
    then orthogonalises a share of the matrices and gathers the rest (same result as unsharded).
    Between steps it keeps its Newton-Schulz buffers (`self.workspace`: about two ns_dtype copies
    of the matrices, reused to save the cost of fresh memory every step; `workspace.clear()` frees
    them, the next step allocates them again).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, ns_dtype: torch.dtype | None = None,
                 ef_beta: float = 0.0, shard_group=None, normuon: bool = False,
                 normuon_beta2: float = NORMUON_BETA2, ef_source: str = "buffer"):
        defaults = dict(algorithm=MUON, lr=lr, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_coefficients=_as_tuple(ns_coefficients), eps=eps,
                        ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, ef_beta=ef_beta,
                        normuon=normuon, normuon_beta2=normuon_beta2)
        super().__init__(_named(params), defaults, shard_group=shard_group, ef_source=ef_source)


class AdamW(FusedOptimizer):
    """AdamW with one fused multi-tensor kernel per param group (torch.optim.AdamW arithmetic,
    float32), plus `ef_beta` error feedback (0 = off) with E from `ef_source` (as in Muon).
    amsgrad/maximize are not supported."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, ef_beta: float = 0.0, ef_source: str = "buffer"):
        defaults = dict(algorithm=ADAMW, lr=lr, betas=_as_tuple(betas), eps=eps, weight_decay=weight_decay,
                        ef_beta=ef_beta)
        super().__init__(_named(params), defaults, ef_source=ef_source)


class MuonHybrid(FusedOptimizer):
    """One optimizer object: Muon for hidden 2-D matrices, AdamW for everything else.

    `model_or_named_params` is an nn.Module (or a part of one, e.g. a pipeline stage) or an iterable
    of (name, parameter). Routing (see `split_named_parameters`): ndim != 2, nn.Embedding weights and
    the output head go to AdamW; `is_muon(name, param) -> bool`, `adamw_names` and `muon_names` override.
    Param group 0 is Muon (lr, weight_decay, ...), group 1 AdamW (adamw_lr, adamw_betas, adamw_eps,
    adamw_weight_decay which defaults to weight_decay). `shard_group` splits the Muon
    orthogonalisations among data-parallel replicas (see Muon). `no_decay_names`: parameters updated
    without weight decay, each part's in a group of its own after its decayed group (decay.py).
    `normuon`/`normuon_beta2` make the
    Muon part NorMuon (see Muon). Groups without parameters are omitted; each
    group's "algorithm" says which it is. `ef_beta` and `ef_source` (see Muon) apply to both parts.
    Defaults: lr, adamw_lr and momentum are the registry's for "muon" (registry.py: 0.02, 3e-3,
    0.95), as build_optimizer and asyncpp-train use them; ef_beta here is 0 (build_optimizer's
    default is the registry's 0.5).
    """

    def __init__(self, model_or_named_params, lr: float = OPTIMIZERS["muon"].lr,
                 adamw_lr: float = OPTIMIZERS["muon"].adamw_lr, weight_decay: float = 0.0,
                 momentum: float = OPTIMIZERS["muon"].momentum, nesterov: bool = True,
                 ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None, ns_dtype: torch.dtype | None = None,
                 adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, adamw_weight_decay: float | None = None,
                 ef_beta: float = 0.0, is_muon=None, adamw_names=(), muon_names=(), shard_group=None,
                 normuon: bool = False, normuon_beta2: float = NORMUON_BETA2, ef_source: str = "buffer",
                 no_decay_names=()):
        muon_params, adamw_params = split_named_parameters(
            model_or_named_params, is_muon=is_muon, adamw_names=adamw_names, muon_names=muon_names)
        groups = []
        if muon_params:
            groups.append(dict(params=muon_params, algorithm=MUON, lr=lr, weight_decay=weight_decay,
                               momentum=momentum, nesterov=nesterov, ns_coefficients=_as_tuple(ns_coefficients),
                               eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
                               ef_beta=ef_beta, normuon=normuon, normuon_beta2=normuon_beta2))
        if adamw_params:
            groups.append(dict(params=adamw_params, algorithm=ADAMW, lr=adamw_lr, betas=_as_tuple(adamw_betas),
                               eps=adamw_eps,
                               weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
                               ef_beta=ef_beta))
        if not groups:
            raise ValueError("MuonHybrid got no trainable parameters (all have requires_grad=False?)")
        if isinstance(no_decay_names, str):  # set() of it would be its characters
            raise ValueError(f"no_decay_names must be a collection of parameter names, got the string "
                             f"{no_decay_names!r}; pass [{no_decay_names!r}]")
        unknown = set(no_decay_names) - {n for n, _ in muon_params + adamw_params}
        if unknown:
            raise ValueError(f"no_decay_names mentions {sorted(unknown)}, which are not trainable parameters here")
        groups = [part for group in groups for part in split_by_decay(group, set(no_decay_names))]
        super().__init__(groups, dict(ef_beta=ef_beta), shard_group=shard_group, ef_source=ef_source)


__all__ = ["Muon", "AdamW", "MuonHybrid"]
