"""Token windows that pack several documents, for the document-mask tests (test_document_mask.py,
test_flex_attention.py)."""
import torch

SEP = 1
"""The boundary token of these windows (ids 3..199 elsewhere, so no other position is one)."""


def packed_tokens(batch, time, seed, boundaries=()):
    """(batch, time) random ids from ``seed``, with SEP at each (row, column) of ``boundaries``."""
    x = torch.randint(3, 200, (batch, time), generator=torch.Generator().manual_seed(seed))
    for row, col in boundaries:
        x[row, col] = SEP
    return x
