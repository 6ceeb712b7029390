"""Sampling text from a trained model, one token at a time: what ``asyncpp-sample`` runs.

Each new token's logits are those of the model over the newest ``window`` ids (the model's
``seq_len``) at the last position; the output head runs on that position only (it is
position-wise, so its logits equal the full forward's there). The package's GPT and Llama keep a
key/value cache (``forward_cached`` of their blocks, base.extend_cache): the prompt fills it in one
causal forward and each new token then costs one position's forward, until the ids outgrow the
window -- from then on every token reruns the window from position 0 (its positions change with
each token, so no cache survives), as a model without a cache (a Hugging Face model's) does
throughout. Either way the logits are the window's: ``use_cache=False`` computes them without.

With a document ``boundary`` token (a run trained with --document-mask) each position attends
within its document, as in training (models/document_mask.py): a boundary drawn starts a new
document, which reads nothing before it. The cache's one new position then attends to the cached
keys of its own document only.

The choice of each token, from the last position's float32 logits:

* ``temperature == 0``: the most likely id (greedy; ties to the lowest id, as ``argmax``);
* otherwise the logits are divided by ``temperature``, cut to the ``top_k`` most likely ids and then
  to the smallest set whose probabilities sum to at least ``top_p`` (nucleus sampling; the most
  likely id always stays), and one id is drawn with ``generator``.

Ids at or above ``allowed`` (a model whose embedding is wider than its tokenizer's vocabulary) are
never chosen.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from .base import forward_through
from .document_mask import attending_within, document_ids, within_documents


def last_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, vocab) float32 logits of the position after ``ids`` (B, T). A model with ``blocks()``
    runs its head on the last position only; any other is called as ``model(ids)``, returning the
    logits or ``(logits, loss)``."""
    if hasattr(model, "blocks"):
        *body, head = model.blocks()
        return head(forward_through(body, ids)[:, -1:])[:, -1].float()
    out = model(ids)
    return (out[0] if isinstance(out, tuple) else out)[:, -1].float()


def filter_logits(logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> torch.Tensor:
    """``logits`` (B, V) with every id outside the ``top_k`` most likely (ids tied with the k-th
    stay) and then outside the nucleus of probability ``top_p`` -- of the probabilities renormalised
    over the ids top-k left -- set to -inf (a new tensor; None leaves that cut out)."""
    logits = logits.clone()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # an id stays when the ids more likely than it sum to less than top_p: the first always does
        before = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits[drop] = float("-inf")
    return logits


def choose_next(logits: torch.Tensor, *, temperature: float, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(B,) int64 ids chosen from ``logits`` (B, V), as the module docstring says."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def supports_cache(model: nn.Module) -> bool:
    """Whether every layer of ``model`` has ``forward_cached`` (the package's GPT and Llama)."""
    layers = getattr(model, "layers", None)
    return layers is not None and len(layers) > 0 and all(hasattr(layer, "forward_cached") for layer in layers)


def window_logits(model: nn.Module, ids: torch.Tensor, window: int, boundary: Optional[int] = None) -> torch.Tensor:
    """``last_logits`` of the newest ``window`` ids, within documents for a ``boundary`` token."""
    ids = ids[:, -window:]
    with within_documents(ids, boundary):
        return last_logits(model, ids)


class CachedLogits:
    """The last position's logits of the newest ``window`` ids, with one key/value cache per layer
    kept while each call adds one id to the ones the cache holds (the module docstring); within
    documents for a ``boundary`` token."""

    def __init__(self, model: nn.Module, window: int, boundary: Optional[int] = None):
        self.model, self.window, self.boundary = model, window, boundary
        self.caches: list[dict] = []
        self.held = 0  # ids whose keys and values the caches hold: ids[:, :held], positions 0..held-1

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        if self.held and self.held == n - 1 and n <= self.window:
            x, start = ids[:, -1:], self.held  # one new position
            context = contextlib.nullcontext() if self.boundary is None else attending_within(self._newest_row(ids))
        else:  # the first call, or past the window: fill anew from the newest window at position 0
            self.caches = [{} for _ in self.model.layers]
            x, start = ids[:, -self.window:], 0
            context = within_documents(x, self.boundary)
        with context:
            x = self.model.embed(x, start=start)
            for layer, cache in zip(self.model.layers, self.caches):
                x = layer.forward_cached(x, cache, start)
        self.held = start + x.shape[1] if n <= self.window else 0  # past the window nothing is kept
        return self.model.head(x[:, -1:])[:, -1].float()

    def _newest_row(self, ids: torch.Tensor) -> torch.Tensor:
        """The newest position's row of the document mask over all ``ids`` (the cached ones and
        it): (B, 1, 1, n), True at the keys of its own document."""
        segments = document_ids(ids, self.boundary)
        return (segments == segments[:, -1:])[:, None, None, :]


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, window: int,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             allowed: Optional[int] = None, generator: Optional[torch.Generator] = None,
             use_cache: bool = True, boundary: Optional[int] = None) -> Iterator[torch.Tensor]:
    """Yield ``max_new_tokens`` steps of (B,) new ids after ``prompt`` (B, T >= 1, int64), each
    chosen from the logits of the newest ``window`` ids (the prompt's and those drawn so far),
    through a key/value cache where the model keeps one and ``use_cache``; attending within
    documents for a ``boundary`` token (--document-mask's)."""
    logits_of = CachedLogits(model, window, boundary) if use_cache and supports_cache(model) else \
        (lambda ids: window_logits(model, ids, window, boundary))
    ids = prompt
    for _ in range(max_new_tokens):
        logits = logits_of(ids)
        if allowed is not None and allowed < logits.shape[-1]:
            logits[:, allowed:] = float("-inf")
        new = choose_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        ids = torch.cat([ids, new[:, None]], dim=1)
        yield new


__all__ = ["last_logits", "window_logits", "filter_logits", "choose_next", "supports_cache", "CachedLogits",
           "generate"]
