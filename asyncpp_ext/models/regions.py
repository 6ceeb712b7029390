"""Stage-scope compilation (``--compile-scope stage``): a stage's consecutive blocks compiled as one
region, so a microbatch makes one compiled call forward and one backward per stage instead of one
per block (docs/design.md §2.11).

    compile_regions(blocks, regions, *, device=None, backend="inductor", mode=None, options=None,
                    fullgraph=True, dynamic=False) -> CompileReport
        Compile each run of block indices in ``regions`` as one region and every other block on
        its own (``compile_blocks``).
    scope_regions(scope, partition, num_blocks, first=0) -> list[list[int]]
        The regions of ``--compile-scope``: for "stage" each stage's blocks less the model's last
        block (the head); none for "block".

Why: per block, a compiled call costs the host a guard check, AOTAutograd's runtime wrapper and an
autograd node forward and backward, and the graph ends at the block's output, so the residual add
of one block and the norm of the next cannot fuse. A small model on a fast GPU waits on the host
(docs/gpu.md); one region per stage pays those costs once. Measured on CPU, where the same host
work is visible (llama 30 layers x 32 wide, 8 microbatches of 1 x 32, one thread, asyncpp-train
--schedule sync --compile): 1.24-1.46x the steps per second of blocks over three runs. The price
is compile time: one graph of the whole stage instead of one per block type (the first 20 steps
there took 41 s instead of 11 s on a cold inductor cache).

How: the region's first block carries a mark (``models.base.REGION_MARK``) that
``models.base.forward_through`` -- the loop of ``BlockModel.forward``, of a stage's
``BlockSequence`` and of the fused head's callers -- uses to run the region's blocks through one
``torch.compile``d function ``run(blocks, x)``. That function is shared by every region with the
same sequence of block types and settings: dynamo lifts the blocks' parameters to graph inputs and
guards on the modules' structure, not on which modules they are, so a deep-copied replica (one per
2bw weight version, its mark copied as is) and a re-pointed weight buffer run the same code on the
live weights, as with blocks (models/compile.py). A block of a region called on its own runs
eagerly.

The head (the model's last block) stays out of every region: the fused head loss calls its norm and
projection itself. Regions follow the stage split, so the simulator (``scope_regions`` of the same
partition) and a real pipeline compile the same graphs and real == ``--simulate`` stays exact;
regions of different splits fuse differently and are not bitwise equal to each other.

A failure to compile a region runs it eagerly from then on, with one warning line, as for blocks.
"""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from .base import REGION_MARK
from .compile import (_GROUPS, CompileReport, _as_blocks, _Group, _make_settings, _Settings,
                      blocks_device, compile_blocks, uncompile)
from .compile_support import device_inductor_options


def _run_region(blocks, x):
    # The body every region's compiled function runs: its blocks in order.
    for block in blocks:
        x = block(x)
    return x


def _region_name(types: tuple) -> str:
    parts, i = [], 0
    while i < len(types):
        j = i
        while j < len(types) and types[j] is types[i]:
            j += 1
        parts.append(types[i].__qualname__ if j - i == 1 else f"{j - i}x{types[i].__qualname__}")
        i = j
    return "region[" + ", ".join(parts) + "]"


def _region_group(types: tuple, settings: _Settings) -> _Group:
    key = ("region", types, settings)
    group = _GROUPS.get(key)
    if group is None:
        code_name = "compiled_region_" + "_".join(dict.fromkeys(t.__name__ for t in types))
        group = _GROUPS[key] = _Group(types, settings, name=_region_name(types), code_name=code_name,
                                      body=_run_region)
    return group


class _RegionMark:
    """On a region's first block: how many blocks the region has, and their compiled function.
    It holds no module, so a deep copy of the model keeps the same mark (and compiled code)."""

    __slots__ = ("group", "length")

    def __init__(self, group: _Group, length: int):
        self.group, self.length = group, length

    def run(self, blocks, x):
        return self.group.call(_run_region, tuple(blocks), x)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _mark_for, (self.group.cls, self.group.settings, self.length)

    def __repr__(self) -> str:
        state = f"eager after failure: {self.group.failure}" if self.group.failure else "compiled"
        return f"<{self.group.name} ({state})>"


def _mark_for(types: tuple, settings: _Settings, length: int) -> _RegionMark:
    return _RegionMark(_region_group(types, settings), length)


def region_of(block: nn.Module):
    """The region mark ``block`` starts (None where it starts none)."""
    return block.__dict__.get(REGION_MARK)


SCOPES = ("block", "stage")


def scope_regions(scope: str, partition: Sequence[Sequence[int]], num_blocks: int,
                  first: int = 0) -> list[list[int]]:
    """The regions ``compile_regions`` takes for ``--compile-scope``: none for "block"; for "stage"
    one per stage of ``partition`` (the model's block indices per stage, of ``num_blocks``): its
    blocks less the model's last one (the head, which the fused head loss calls itself), counted
    from ``first`` (a pipeline stage passes its own first block). A stage left with fewer than two
    blocks gets none (a one-block region is that block compiled alone)."""
    if scope not in SCOPES:
        raise ValueError(f"compile scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    regions = []
    for indices in partition if scope == "stage" else ():
        body = [i - first for i in indices if i != num_blocks - 1]
        if len(body) >= 2:
            regions.append(body)
    return regions


def compile_regions(blocks, regions: Sequence[Sequence[int]], *, device=None, backend: Any = "inductor",
                    mode: str | None = None, options: dict | None = None, fullgraph: bool = True,
                    dynamic: bool | None = False) -> CompileReport:
    """Compile each run of consecutive block indices in ``regions`` as one region and every other
    block of ``blocks`` on its own (``compile_blocks``, same settings); returns one live report.

    ``blocks``: as for ``compile_blocks`` (a stage's BlockSequence, a model with ``blocks()``, a
    list). A region must list consecutive indices, at least two, in no other region (no regions:
    every block compiled alone, as by ``compile_blocks``). Callers run the blocks through
    ``models.base.forward_through`` (``BlockModel.forward`` and ``BlockSequence`` do). Compiling
    again replaces earlier regions and block compilation; ``compile.uncompile`` undoes it."""
    mods = _as_blocks(blocks)
    regions = [list(r) for r in regions]
    seen: set[int] = set()
    for r in regions:
        if len(r) < 2 or r != list(range(r[0], r[0] + len(r))) or r[0] < 0 or r[-1] >= len(mods):
            raise ValueError(f"region {r} must be at least two consecutive block indices within "
                             f"0..{len(mods) - 1}")
        if seen & set(r):
            raise ValueError(f"region {r} overlaps another region")
        seen |= set(r)
    uncompile(mods)  # earlier regions and blocks; a region's blocks run inside the region's code
    rest = [m for i, m in enumerate(mods) if i not in seen]
    device = device if device is not None else blocks_device(mods)
    if backend == "inductor":  # the device's defaults under the caller's, as compile_blocks has them
        options = device_inductor_options(device, options)
    report = compile_blocks(rest, device=device,
                            backend=backend, mode=mode, options=options, fullgraph=fullgraph,
                            dynamic=dynamic)
    settings = _make_settings(backend, mode, options, fullgraph, dynamic)
    groups = {id(g): g for g in report.groups}
    for r in regions:
        members = [mods[i] for i in r]
        group = _region_group(tuple(type(m) for m in members), settings)
        members[0].__dict__[REGION_MARK] = _RegionMark(group, len(members))
        groups[id(group)] = group
    names = [type(m).__qualname__ for m in mods]
    return CompileReport(report.device, names, list(groups.values()))


__all__ = ["SCOPES", "compile_regions", "scope_regions", "region_of"]
