"""Which parameters weight decay leaves alone.

Decoupled weight decay pulls every weight it touches towards 0. For a norm's gain (whose neutral
value is 1) and a bias that pull has no regularising meaning, and many pretraining setups leave them,
and sometimes the embeddings, undecayed (``build_optimizer(decay_norms_and_biases=False,
decay_embeddings=False)``, ``--no-decay-norms-and-biases``, ``--no-decay-embeddings``). By default
everything decays, the rule the paper's optimizers are compared under.

* norms and biases: every tensor with fewer than 2 dimensions (norm gains, biases, scalars);
* embeddings: ``nn.Embedding`` weights and tables named like one (optim/routing.py's rule), which
  includes an output head tied to the input embedding (one tensor). An untied head is a matrix.

A parameter group is split into the part that decays and the part that does not (its weight-decay
settings 0): the same optimizer, the same arithmetic, no decay term on the second part.
"""
from __future__ import annotations

from torch import nn

from .routing import embedding_ids


def undecayed_names(model_or_named, decay_norms_and_biases: bool = True,
                    decay_embeddings: bool = True) -> set[str]:
    """Names of the trainable parameters weight decay should skip (the first name of a tied one)."""
    if decay_norms_and_biases and decay_embeddings:
        return set()
    module = isinstance(model_or_named, nn.Module)
    named = list(model_or_named.named_parameters() if module else model_or_named)
    embeddings = embedding_ids(model_or_named if module else named)  # a module: its nn.Embedding types too
    skipped = set()
    for name, p in named:
        if (not decay_norms_and_biases and p.ndim < 2) or (not decay_embeddings and id(p) in embeddings):
            skipped.add(name)
    return skipped


def split_by_decay(group: dict, skipped: set[str]) -> list[dict]:
    """``group`` (its "params" as (name, tensor) pairs) as the group of what decays and a copy with
    every ``weight_decay*`` setting 0 holding what ``skipped`` names; an empty part is left out."""
    pairs = list(group["params"])
    decays = [(n, p) for n, p in pairs if n not in skipped]
    kept = [(n, p) for n, p in pairs if n in skipped]
    parts = [dict(group, params=decays)] if decays else []
    if kept:
        zero = {key: 0.0 for key in group if key.startswith("weight_decay")}
        parts.append(dict(group, params=kept, **zero))
    return parts


__all__ = ["undecayed_names", "split_by_decay"]
