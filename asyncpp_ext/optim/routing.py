"""Which parameters Muon updates and which go to AdamW."""
from __future__ import annotations

from torch import nn

# Last name component of common output heads; a stage holding only the last blocks still has its
# head recognised by name even though the embedding it may be tied to lives on another stage.
HEAD_NAMES = ("lm_head", "head", "output", "output_head", "classifier", "unembed")
# Name components that mark an embedding table held as a bare nn.Parameter (e.g. learned positions).
EMBEDDING_NAMES = ("pos", "wpe", "wte")


def _looks_like_embedding(name: str) -> bool:
    parts = name.lower().split(".")
    return any("emb" in part or part in EMBEDDING_NAMES for part in parts)


def _looks_like_head(name: str) -> bool:
    """A parameter name from (name, parameter) pairs that the module rule would call a head's: its
    module's own name, or the top-level module holding it, is one of HEAD_NAMES."""
    parts = name.split(".")
    return len(parts) >= 2 and (parts[-2] in HEAD_NAMES or parts[0] in HEAD_NAMES)


def _module_facts(model: nn.Module):
    """ids of embedding weights and of head weights (a Linear named like a head, or tied to an
    embedding)."""
    embedding_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            embedding_ids.add(id(module.weight))
    head_ids = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parts = name.split(".")
            # "lm_head", or a head module at the top of the model ("head.proj"). Matching widths
            # against embedding sizes is not used: a positional table as long as the model is
            # wide would make every hidden projection look like a head.
            if parts[-1] in HEAD_NAMES or parts[0] in HEAD_NAMES or id(module.weight) in embedding_ids:
                head_ids.add(id(module.weight))
    return embedding_ids, head_ids


def embedding_ids(model_or_named) -> set[int]:
    """ids of the embedding tables among a module's parameters (``nn.Embedding`` weights and
    tables named like one) or among (name, parameter) pairs (by name only)."""
    if isinstance(model_or_named, nn.Module):
        named = list(model_or_named.named_parameters())
        found = _module_facts(model_or_named)[0]
    else:
        named, found = list(model_or_named), set()
    return found | {id(p) for n, p in named if _looks_like_embedding(n)}


def split_named_parameters(model_or_named_params, is_muon=None, adamw_names=(), muon_names=()):
    """Split trainable parameters into (muon, adamw) lists of (name, parameter).

    Default rule: a parameter goes to Muon iff it is 2-D, is not an nn.Embedding weight and is not
    the output head (a Linear whose own name, or the top-level module holding it, is one of
    `HEAD_NAMES`, or one tied to an embedding).
    Embeddings held as bare parameters are recognised by name (a component containing "emb" or
    equal to one of `EMBEDDING_NAMES`); given only (name, param) pairs, heads are too (the
    last-but-one or the first component in `HEAD_NAMES`), but an nn.Embedding cannot be told by its
    type there: pass the module, or name it with `adamw_names`. Overrides, strongest first: exact names in
    `muon_names` / `adamw_names`, then `is_muon(name, param)` if given (replaces the default rule).
    Tied weights appear once.
    """
    if isinstance(model_or_named_params, nn.Module):
        named = list(model_or_named_params.named_parameters())
        embeddings, head_ids = embedding_ids(model_or_named_params), _module_facts(model_or_named_params)[1]
    else:
        named = list(model_or_named_params)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError("MuonHybrid needs an nn.Module or (name, parameter) pairs, "
                                 f"e.g. model.named_parameters(); got an element {type(item).__name__}")
        embeddings = embedding_ids(named)
        head_ids = {id(p) for n, p in named if _looks_like_head(n)}
    overlap = set(muon_names) & set(adamw_names)
    if overlap:
        raise ValueError(f"parameters named in both muon_names and adamw_names: {sorted(overlap)}")
    known = {n for n, _ in named}
    unknown = (set(muon_names) | set(adamw_names)) - known
    if unknown:
        raise ValueError(f"muon_names/adamw_names mention unknown parameters {sorted(unknown)}; "
                         f"known names: {sorted(known)}")
    muon, adamw, seen = [], [], set()
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if name in muon_names:
            use_muon = True
            if p.ndim != 2:
                raise ValueError(f"muon_names lists '{name}' of shape {tuple(p.shape)}, but Muon only "
                                 "updates 2-D matrices; leave it to AdamW")
        elif name in adamw_names:
            use_muon = False
        elif is_muon is not None:
            use_muon = bool(is_muon(name, p))
            if use_muon and p.ndim != 2:
                raise ValueError(f"is_muon chose '{name}' of shape {tuple(p.shape)}, but Muon only "
                                 "updates 2-D matrices")
        else:
            use_muon = p.ndim == 2 and id(p) not in embeddings and id(p) not in head_ids
        (muon if use_muon else adamw).append((name, p))
    return muon, adamw
