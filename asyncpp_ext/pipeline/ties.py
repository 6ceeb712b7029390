"""Weights shared between blocks (tied input embedding and output head), found and untied for
autograd, with one summation rule for the pipeline and the simulator (docs/design.md §1.13).

A tie is one ``nn.Parameter`` object used by several blocks. Its *owner* is the first block that
uses it (in block order); every later use is a *mirror*. Each use gets its own Parameter (same
values) so that each accumulates its own gradient over the step's microbatches; before the
optimizer step the owner's gradient becomes ``owner + mirror_1 + mirror_2 + ...`` (mirrors in block
order), only the owner is updated, and every mirror is overwritten with the owner's new values. A
pipeline stage that holds a mirror whose owner lives on another stage sends its gradient there and
receives the updated weights (step_exchange.py); the simulator does the same additions in one
process, so both produce the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class TiedUse:
    block: int
    """Index of the block using the tensor."""
    name: str
    """Global parameter name of this use (e.g. ``head.proj.weight``)."""
    local: str
    """The name inside its block (e.g. ``proj.weight``)."""


@dataclass(frozen=True)
class Tie:
    owner: TiedUse
    """The first use: the one tensor checkpoints store and optimizers update."""
    mirrors: tuple
    """Later uses (TiedUse), in block order."""


def block_prefixes(model, blocks: Sequence[nn.Module], indices: Sequence[int]) -> list[str]:
    """Each block's name inside ``model`` (e.g. ``layers.3``) when the model is an nn.Module
    holding the blocks, else the block's index."""
    prefix = {}
    if isinstance(model, nn.Module):
        prefix = {id(m): n for n, m in model.named_modules() if n}
    return [prefix.get(id(blocks[i]), str(i)) for i in indices]


def find_ties(model, blocks: Sequence[nn.Module]) -> list[Tie]:
    """The Parameters used by more than one block, with their owner and mirrors."""
    prefixes = block_prefixes(model, blocks, range(len(blocks)))
    uses: dict[int, list[TiedUse]] = {}
    for i, block in enumerate(blocks):
        seen_here = set()
        for local, p in block.named_parameters(remove_duplicate=False):
            if id(p) in seen_here:  # a tensor used twice inside one block is autograd's business
                continue
            seen_here.add(id(p))
            uses.setdefault(id(p), []).append(TiedUse(i, f"{prefixes[i]}.{local}", local))
    return [Tie(u[0], tuple(u[1:])) for u in uses.values() if len(u) > 1]


def untie(blocks: Sequence[nn.Module], ties: Sequence[Tie]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Give every mirror use its own Parameter viewing the owner's storage; returns
    (owner, mirror) pairs. Forward results are unchanged; gradients now accumulate per use."""
    pairs = []
    for tie in ties:
        owner = blocks[tie.owner.block].get_parameter(tie.owner.local)
        for use in tie.mirrors:
            block = blocks[use.block]
            module_path, _, attr = use.local.rpartition(".")
            module = block.get_submodule(module_path) if module_path else block
            mirror = nn.Parameter(owner.data, requires_grad=owner.requires_grad)
            # every attribute of this block that held the shared tensor gets the mirror
            for sub in block.modules():
                for key, value in list(sub._parameters.items()):
                    if value is owner:
                        sub._parameters[key] = mirror
            assert module._parameters[attr] is mirror
            pairs.append((owner, mirror))
    return pairs


class TieError(ValueError):
    """Tied weights that the chosen schedule cannot keep consistent."""


def check_ties_on_one_stage(ties: Sequence[Tie], partition: Sequence[Sequence[int]]) -> None:
    """pipedream delays each stage differently (docs/design.md §1.16), so the uses of one tensor
    on two stages would need two different versions of it: refuse such a split."""
    stage_of = {b: s for s, blocks in enumerate(partition) for b in blocks}
    for tie in ties:
        a = tie.owner.block
        for use in tie.mirrors:
            b = use.block
            if stage_of[a] != stage_of[b]:
                raise TieError(
                    f"tied weight {tie.owner.name!r} (stage {stage_of[a]}) is also used as {use.name!r} "
                    f"(stage {stage_of[b]}), and pipedream computes the two stages on different weight "
                    f"versions; pass split points that put blocks {a}..{b} on one stage, untie the "
                    "weights, or use schedule '2bw'")


def mirror_names(ties: Sequence[Tie]) -> dict[str, str]:
    """{mirror's global name: owner's global name}."""
    return {use.name: tie.owner.name for tie in ties for use in tie.mirrors}


@torch.no_grad()
def sum_tied_gradients(pairs: Sequence[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Owner's gradient += each mirror's (mirrors in block order); mirrors' gradients dropped."""
    for owner, mirror in pairs:
        if mirror.grad is None:
            continue
        if owner.grad is None:
            owner.grad = torch.zeros_like(owner)
        owner.grad.add_(mirror.grad)
        mirror.grad = None


__all__ = ["TieError", "check_ties_on_one_stage", "TiedUse", "Tie", "block_prefixes", "find_ties", "untie", "mirror_names", "sum_tied_gradients"]
