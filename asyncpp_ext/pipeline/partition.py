"""Splitting a model into pipeline stages: contiguous runs of blocks, one run per stage."""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn


class PartitionError(ValueError):
    """The requested split cannot be made; the message says why and what to change."""


def as_blocks(model_or_blocks) -> list[nn.Module]:
    """Blocks from an nn.Sequential, a list of modules, or a model exposing ``blocks()``."""
    if isinstance(model_or_blocks, nn.Sequential):
        return list(model_or_blocks)
    if hasattr(model_or_blocks, "blocks") and callable(model_or_blocks.blocks):
        return list(model_or_blocks.blocks())
    if isinstance(model_or_blocks, (list, tuple, nn.ModuleList)):
        blocks = list(model_or_blocks)
        bad = [i for i, b in enumerate(blocks) if not isinstance(b, nn.Module)]
        if bad:
            raise PartitionError(f"block {bad[0]} is a {type(blocks[bad[0]]).__name__}, not an nn.Module")
        return blocks
    raise PartitionError(f"cannot split a {type(model_or_blocks).__name__}: pass an nn.Sequential, a "
                         "list of nn.Module blocks, or a model with a blocks() method")


def balanced_split_points(sizes: Sequence[int], stages: int) -> list[int]:
    """Split points (first block index of stages 1..S-1) minimising the largest stage's size.

    Exact: dynamic programming over contiguous partitions (blocks are few, so O(S n^2) is nothing).
    """
    n = len(sizes)
    check_stage_count(n, stages)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: minimal max-stage size covering blocks[:i] with k stages; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    points, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)[1:]


def check_stage_count(n_blocks: int, stages: int) -> None:
    if stages < 1:
        raise PartitionError(f"stages must be >= 1 (got {stages})")
    if n_blocks == 0:
        raise PartitionError("the model has no blocks to split into stages; pass a non-empty nn.Sequential "
                             "or list of blocks")
    if stages > n_blocks:
        raise PartitionError(f"cannot split {n_blocks} blocks into {stages} stages: every stage needs at "
                             f"least one block; use at most {n_blocks} stages (--stages) or a deeper model")


def split(blocks: Sequence[nn.Module], stages: int, split_points: Sequence[int] | None = None
          ) -> list[list[int]]:
    """Block indices per stage. ``split_points`` are the first block of stages 1..S-1; without them
    the split balances parameter counts."""
    n = len(blocks)
    check_stage_count(n, stages)
    if split_points is None:
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        split_points = balanced_split_points(sizes, stages)
    points = list(split_points)
    if len(points) != stages - 1:
        raise PartitionError(f"{stages} stages need {stages - 1} split points, got {len(points)}: {points}")
    bounds = [0, *points, n]
    if any(b >= a_next for b, a_next in zip(bounds, bounds[1:])):
        raise PartitionError(f"split points {points} must be strictly increasing within 1..{n - 1} so "
                             "that every stage gets at least one block")
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


class GlobalView(nn.Module):
    """A stage's blocks registered under their names in the whole model, sharing parameters.

    Optimizers that route parameters by name or by module (the Muon hybrid sends embeddings and
    the output head to AdamW) see a stage exactly as they would see the whole model, and
    checkpoints name parameters the same way at every pipeline depth."""

    def __init__(self, stage_module: nn.Module, prefixes: Sequence[str], hidden=()):
        super().__init__()
        self._hidden = frozenset(hidden)  # names left out of named_parameters (tied mirrors)
        for block, prefix in zip(stage_module, prefixes):
            parent = self
            *path, leaf = prefix.split(".")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, block)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if name not in self._hidden:
                yield name, p
