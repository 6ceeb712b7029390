"""Sampling text from a trained model, one token at a time: what ``asyncpp-sample`` runs.

Each new token reruns the model over the newest ``window`` ids (the model's ``seq_len``) and
applies the output head to the last position only (the head is position-wise, so its logits equal
the full forward's there). There is no key/value cache: a step costs one forward of the window,
which is what a model of the demo's size or a small Llama on a GPU can afford; a transformers
export (``asyncpp-export``) generates with a cache for anything larger.

The choice of each token, from the last position's float32 logits:

* ``temperature == 0``: the most likely id (greedy; ties to the lowest id, as ``argmax``);
* otherwise the logits are divided by ``temperature``, cut to the ``top_k`` most likely ids and then
  to the smallest set whose probabilities sum to at least ``top_p`` (nucleus sampling; the most
  likely id always stays), and one id is drawn with ``generator``.

Ids at or above ``allowed`` (a model whose embedding is wider than its tokenizer's vocabulary) are
never chosen.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from .base import forward_through


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


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, window: int,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             allowed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Iterator[torch.Tensor]:
    """Yield ``max_new_tokens`` steps of (B,) new ids after ``prompt`` (B, T >= 1, int64), each
    chosen from the logits of the newest ``window`` ids (the prompt's and those drawn so far)."""
    ids = prompt
    for _ in range(max_new_tokens):
        logits = last_logits(model, ids[:, -window:])
        if allowed is not None and allowed < logits.shape[-1]:
            logits[:, allowed:] = float("-inf")
        new = choose_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        ids = torch.cat([ids, new[:, None]], dim=1)
        yield new


__all__ = ["last_logits", "filter_logits", "choose_next", "generate"]
