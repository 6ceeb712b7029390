"""Attention within documents (``--document-mask``): a training window packs several documents, and
with this mask a position attends only to the earlier positions of its own document.

The data marks documents with a boundary token (``asyncpp-prepare-data --doc-boundary``: the
tokenizer's end-of-text after each document, or its beginning-of-text before each). Either way the
boundary token here *starts* a segment: position i belongs to segment ``#{j <= i : x_j = boundary}``.
So a document's last token, predicting the boundary, reads its own document; the boundary token,
predicting the next document's first token, reads only itself -- as generation starts a document
from that token (asyncpp-sample) -- and never the document before it.

The mask is (B, 1, T, T) booleans, True where attention is allowed: causal, and both positions in
one segment. The diagonal is always allowed, so no row is empty (no NaN from a softmax of nothing).

How blocks see it: each block takes one tensor (models/base.py), so the mask is not an argument.
Whoever runs a microbatch's blocks -- the simulator's loss, a pipeline stage for each forward (and
for its recomputation in backward), an evaluation -- computes it from that microbatch's input ids
and holds it here (``attending_within``) while the blocks run; the attention layers' ``forward``
reads ``active_mask()`` (None: plain causal attention, the usual path bit for bit). Autograd keeps
the mask a layer used for its backward, and a compiled block takes it as an input (a tensor read
from a module-level attribute is a graph input with shape guards, not a constant: no recompile per
microbatch). A CUDA graph would replay the mask it captured, so the two are not combined.
Generation (``forward_cached``) never reads it: it runs one document.

Under ``--attention flex`` (``flex_masks``, held by models/attention.attention_preference) the mask
held is a FlexAttention ``BlockMask`` of the same rule instead, and the attention layers run
``flex_attention`` by it (``attend_within``): a block of keys wholly in earlier documents is skipped,
not computed and zeroed, which is the kernel's point when a window packs many short documents.
flex_attention is fused only where it is compiled (the blocks are, on CUDA) and has no backward on
the CPU, so a run asks for it on CUDA only (models/attention.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F


class _Active:
    """The mask the blocks running now attend by (one compute thread per process runs blocks), and
    which kind ``within_documents`` makes: a boolean tensor for SDPA, or a BlockMask for flex."""
    mask = None
    flex: bool = False


_ACTIVE = _Active()


def document_ids(inputs: torch.Tensor, boundary: int) -> torch.Tensor:
    """(B, T) input ids -> (B, T) segment numbers: how many boundary tokens up to and including
    each position."""
    return (inputs == boundary).cumsum(dim=1)


def document_mask(inputs: torch.Tensor, boundary: int) -> torch.Tensor:
    """(B, T) input ids -> the (B, 1, T, T) boolean attention mask: causal, within a segment."""
    ids = document_ids(inputs, boundary)
    t = inputs.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=inputs.device).tril_()
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def flex_block_mask(inputs: torch.Tensor, boundary: int):
    """(B, T) input ids -> FlexAttention's BlockMask of ``document_mask``'s rule (causal, within a
    segment): the allowed (query, key) pairs are the same, held as which key blocks each query
    block reads, fully or in part."""
    from torch.nn.attention.flex_attention import create_block_mask

    segments = document_ids(inputs, boundary)

    def allowed(b, h, q, k):
        return (q >= k) & (segments[b, q] == segments[b, k])

    b, t = inputs.shape
    return create_block_mask(allowed, b, None, t, t, device=inputs.device)


def attend_within(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, enable_gqa: bool = False) -> torch.Tensor:
    """Attention of q (B, H, T, D) over k, v (B, H_kv, T, D) by a held ``mask``: SDPA with the
    boolean tensor, or flex_attention with the BlockMask; ``enable_gqa``: H a multiple of H_kv."""
    if isinstance(mask, torch.Tensor):
        gqa = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)


@contextlib.contextmanager
def flex_masks() -> Iterator[None]:
    """While held, ``within_documents`` makes BlockMasks (``--attention flex``) instead of tensors."""
    before, _ACTIVE.flex = _ACTIVE.flex, True
    try:
        yield
    finally:
        _ACTIVE.flex = before


def active_mask():
    """The mask of the microbatch whose blocks run now (a boolean tensor, or a BlockMask under
    ``flex_masks``), or None (plain causal attention)."""
    return _ACTIVE.mask


@contextlib.contextmanager
def attending_within(mask) -> Iterator[None]:
    """Hold ``mask`` (``document_mask``'s or ``flex_block_mask``'s, or None) while a microbatch's
    blocks run."""
    before, _ACTIVE.mask = _ACTIVE.mask, mask
    try:
        yield
    finally:
        _ACTIVE.mask = before


def within_documents(inputs: torch.Tensor, boundary: Optional[int]):
    """The context a microbatch of ``inputs`` runs its blocks in: its document mask for a
    ``boundary`` token (a BlockMask under ``flex_masks``), nothing for None (no mask held, not
    even None over an outer one)."""
    if boundary is None:
        return contextlib.nullcontext()
    make = flex_block_mask if _ACTIVE.flex else document_mask
    return attending_within(make(inputs, boundary))


def check_document_mask(boundary, cuda_graphs: bool = False, device="cpu") -> None:
    """TypeError / ValueError (one line) unless ``boundary`` is None or a token id >= 0, and not
    with ``cuda_graphs`` (a graph replays the mask it captured), nor trained by flex_attention
    (``flex_masks`` held, as ``attention_preference("flex")`` does) off CUDA, where flex_attention
    has no backward."""
    if boundary is None:
        return
    if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 0:
        raise ValueError(f"document_mask must be a token id (an integer >= 0) or None, got {boundary!r}")
    if cuda_graphs:
        raise ValueError("document_mask cannot run with cuda_graphs (a graph replays the mask of the microbatch "
                         "it captured); drop one of them")
    if _ACTIVE.flex and torch.device(device).type != "cuda":
        raise ValueError(f"document_mask under attention_preference('flex') trains by flex_attention, which has "
                         f"no backward on {torch.device(device).type}; use a CUDA device or drop the preference")


__all__ = ["check_document_mask", "document_ids", "document_mask", "flex_block_mask", "attend_within", "flex_masks",
           "active_mask", "attending_within", "within_documents"]
