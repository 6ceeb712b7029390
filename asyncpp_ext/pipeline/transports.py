"""Transports by name: ``--transport`` / ``Pipeline(transport=)`` -> the factory of one stage's transport.

Every transport a factory returns offers the same three calls, so the Pipeline never asks which
one it holds: ``run_stage(schedule, stages, microbatches, steps, stage, first_step, host, board,
*, recv_ahead, max_inflight_sends, timeout_s, progress)`` runs the C++ executor over it,
``pending_transfers()`` describes what is in flight for the watchdog's stall report, and
``close(timeout_s)`` (optional) releases it. Which name a device gets by default, and which
names a device accepts, is devices.py's ``choose_transport``.

Adding a transport = a factory here and its name in devices.TRANSPORTS (docs/design.md, "Where a
new transport goes").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .rendezvous import next_run_id


@dataclass
class TransportContext:
    """What a factory may need to build one stage's transport."""

    host: object
    """The stage's StageHost (the Python transports call it for receive buffers)."""
    board: object
    """The stage's C.MessageBoard (the C++ transports' payloads)."""
    stage: int
    stages: int
    stage_ranks: Sequence[int]
    """Global rank of every stage of this rank's pipeline."""
    replica: int
    dp: int
    layout: object
    """data_parallel.Layout of the whole world (torch's per-link groups span every replica)."""
    device: torch.device
    run_id: str | None
    """Names the rendezvous keys; equal on every rank; None = the process's next default."""
    timeout_s: float
    watchdog: object
    """Set-up that blocks on peers runs under ``watchdog.armed(...)``, so a dead peer ends it."""


def _gloo(ctx: TransportContext):
    from .transport import GlooTransport

    return GlooTransport(ctx.host, ctx.stage_ranks, watchdog=ctx.watchdog)


def _torch(ctx: TransportContext):
    from .transport import TorchTransport, create_link_groups

    pipelines = [ctx.layout.pipeline_ranks(r) for r in range(ctx.dp)]
    with ctx.watchdog.armed("torch transport setup"):
        groups = create_link_groups(pipelines, ctx.stage, ctx.replica, ctx.device, 2 * ctx.timeout_s)
    return TorchTransport(ctx.host, ctx.stage_ranks, groups, nccl=ctx.device.type == "cuda", watchdog=ctx.watchdog)


def _ipc(ctx: TransportContext):
    from .ipc import IpcTransport

    return IpcTransport(ctx.host, ctx.stage_ranks, run_id=_replica_run_id(ctx), watchdog=ctx.watchdog,
                        timeout_s=ctx.timeout_s)


def _replica_run_id(ctx: TransportContext) -> str:
    """Each replica's pipeline rendezvouses under keys of its own."""
    return f"{ctx.run_id or next_run_id()}-replica{ctx.replica}"


def _socket(ctx: TransportContext):
    from .sockets import create_socket_transport

    run_id = _replica_run_id(ctx)
    with ctx.watchdog.armed("socket transport setup"):
        return create_socket_transport(ctx.board, ctx.stage, ctx.stages, ctx.stage_ranks, run_id=run_id,
                                       timeout_s=ctx.timeout_s)


def _nccl(ctx: TransportContext):
    from .nccl import create_nccl_transport

    run_id = _replica_run_id(ctx) if ctx.dp > 1 else ctx.run_id
    # Communicator setup blocks in NCCL until every peer has joined: a peer that died before
    # joining must end this rank too, with a report, not leave it waiting.
    with ctx.watchdog.armed("NCCL communicator setup"):
        return create_nccl_transport(ctx.board, ctx.stage, ctx.stages, ctx.stage_ranks, ctx.device,
                                     run_id=run_id, timeout_s=ctx.timeout_s)


TRANSPORT_FACTORIES: dict[str, Callable[[TransportContext], object]] = {
    "gloo": _gloo, "torch": _torch, "socket": _socket, "nccl": _nccl, "ipc": _ipc,
}
"""Every concrete transport by name ("auto" is resolved by devices.choose_transport first)."""


def create_transport(name: str, ctx: TransportContext):
    """The transport ``name`` for the stage described by ``ctx``."""
    factory = TRANSPORT_FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORT_FACTORIES)}")
    return factory(ctx)


__all__ = ["TRANSPORT_FACTORIES", "TransportContext", "create_transport"]
