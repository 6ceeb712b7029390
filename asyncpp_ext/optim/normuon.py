"""NorMuon: Muon's orthogonalised update with a per-row (per-neuron) adaptive scale.

Newton-Schulz makes the update O of a (rows x cols) matrix well conditioned as a whole, but its
rows (the output neurons of an nn.Linear weight) can still have very different norms. NorMuon
(Li, Liu, Liang, Chen, Zhao: "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491)
keeps one running second moment per row and divides each row by its root:

    v <- beta2 * v + (1 - beta2) * mean_cols(O * O)        (v: one float per row, no bias correction)
    N  = O / (sqrt(v) + eps)                                (row-wise)
    O' = N * ||O||_F / (||N||_F + eps)                      (per matrix)

The last line gives O' the Frobenius norm of O, so the learning-rate scale Muon applies to O
(`adjust_lr_fn`: "original" or "match_rms_adamw") sees an update of the size it was designed for
and Muon's learning rates carry over. This is the rule of the authors' reference code; the paper's
Algorithm 1 instead sets the RMS of O' to 0.2, which is what "match_rms_adamw" then yields, since
||O||_F ~ sqrt(min(rows, cols)) for an orthogonalised O.

The fused optimizers call `normuon_updates` between Newton-Schulz and the final update kernel
(after the all-gather when the orthogonalisations are sharded, so every rank holds the same state).
The running moment is the optimizer state "normuon_v" (float32, shape (rows,)). The arithmetic is
float32 torch ops, on whatever device the updates live.
"""
from __future__ import annotations

import torch

from .checks import real_number, unit_interval

NORMUON_BETA2 = 0.95
"""Default decay of the per-row second moment (the paper's and the reference code's value)."""
NORMUON_EPS = 1e-10
"""Added to sqrt(v) and to ||N||_F before dividing; keeps an all-zero row or matrix at zero."""
STATE_KEY = "normuon_v"
"""Optimizer state key of the per-row second moment."""


class NorMuonArgumentError(ValueError):
    """A NorMuon group option (normuon, normuon_beta2) that cannot be used."""


def check_normuon_args(normuon, beta2) -> float:
    """``beta2`` as a float; NorMuonArgumentError unless `normuon` is a bool and `beta2` a float in [0, 1)."""
    if not isinstance(normuon, bool):
        raise NorMuonArgumentError(f"normuon must be True or False, got {normuon!r}")
    return real_number(beta2, "normuon_beta2", "a float in [0, 1)", unit_interval, error=NorMuonArgumentError)


def normalize_rows(o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float = NORMUON_EPS) -> torch.Tensor:
    """The NorMuon update of each matrix in `o` (B, rows, cols), as a new float32 tensor of that shape.

    `v` (B, rows), float32: the running per-row second moments, updated in place. `o` is not
    modified (any float dtype; the arithmetic is float32)."""
    if o.ndim != 3 or v.shape != o.shape[:2]:
        raise NorMuonArgumentError(f"normalize_rows needs o of shape (B, rows, cols) and v of shape (B, rows); "
                                   f"got {tuple(o.shape)} and {tuple(v.shape)}")
    x = o.to(torch.float32)
    norm_before = torch.linalg.vector_norm(x, dim=(1, 2))
    v.lerp_(x.square().mean(dim=2), 1.0 - beta2)
    out = x / (v.sqrt() + eps).unsqueeze(2)
    norm_after = torch.linalg.vector_norm(out, dim=(1, 2))
    return out.mul_((norm_before / (norm_after + eps)).view(-1, 1, 1))


def normuon_updates(updates: list[torch.Tensor], states: list[dict], beta2: float) -> list[torch.Tensor]:
    """NorMuon on a Muon group's orthogonalised updates (one per matrix, any mix of shapes).

    `states[i]` is the optimizer state of matrix i; its "normuon_v" is created (zeros) on first use
    and updated. Same-shape matrices are normalised as one batch. Returns float32 updates in the
    order given (contiguous, as the update kernel needs)."""
    batches: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        batches.setdefault(tuple(u.shape), []).append(i)
    out: list[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    for (rows, _), idx in batches.items():
        for i in idx:
            if STATE_KEY not in states[i]:
                states[i][STATE_KEY] = torch.zeros(rows, dtype=torch.float32, device=updates[i].device)
        o = torch.stack([updates[i] for i in idx])
        v = torch.stack([states[i][STATE_KEY] for i in idx])
        normalized = normalize_rows(o, v, beta2)
        for k, i in enumerate(idx):
            states[i][STATE_KEY].copy_(v[k])
            out[i] = normalized[k]
    return out


__all__ = ["NORMUON_BETA2", "NORMUON_EPS", "NorMuonArgumentError", "check_normuon_args", "normalize_rows",
           "normuon_updates"]
