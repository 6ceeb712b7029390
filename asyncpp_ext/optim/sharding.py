"""Muon across data-parallel replicas: each rank orthogonalises a share of the matrices.

Every replica holds the same averaged gradients and the same momentum buffers, so every replica
would compute the same Newton-Schulz results. Instead each matrix gets one owner (a greedy,
cost-balanced assignment every rank computes identically), the owner orthogonalises it, and one
all-gather hands every rank every result; the weight update that follows is the unsharded one.
Newton-Schulz is the only non-elementwise (and by far the most expensive) part of the step, so
it is the part worth splitting; momentum and the update stay replicated.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Relative cost of NS on a matrix: the products are (n x n) by (n x m), n = the short side."""
    n, m = sorted(shape[-2:])
    return n * n * m


def assign_owners(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """Owner rank of each matrix: largest cost first, each to the least-loaded rank (ties to the
    lower rank), so every rank derives the same assignment without communicating."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    costs = [newton_schulz_cost(s) for s in shapes]
    owners, load = [0] * len(shapes), [0] * ranks
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += costs[i]
    return owners


def gather_updates(mine: dict[int, torch.Tensor], shapes: Sequence[Sequence[int]], owners: Sequence[int],
                   group, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Every matrix's orthogonalised update on every rank. ``mine`` holds this rank's results by
    matrix index; the rest arrive through one all-gather (buffers padded to the largest share)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = [int(torch.Size(s).numel()) for s in shapes]
    share = [sum(n for n, o in zip(numel, owners) if o == r) for r in range(ranks)]
    send = torch.zeros(max(share), dtype=dtype, device=device)
    offset = 0
    for i in range(len(shapes)):  # ascending index: the order every rank unpacks in
        if owners[i] == rank:
            send[offset:offset + numel[i]].copy_(mine[i].reshape(-1))
            offset += numel[i]
    received = [torch.empty_like(send) for _ in range(ranks)]
    dist.all_gather(received, send, group=group)
    out, offsets = [None] * len(shapes), [0] * ranks
    for i, shape in enumerate(shapes):
        r = owners[i]
        out[i] = received[r][offsets[r]:offsets[r] + numel[i]].view(tuple(shape))
        offsets[r] += numel[i]
    return out


__all__ = ["newton_schulz_cost", "assign_owners", "gather_updates"]
