"""The CPU transport: the C++ socket transport, its rendezvous, and where a stage listens.

Each stage opens one listening TCP socket, publishes ``host:port`` in torch.distributed's
key-value store under ``asyncpp/socket/<run_id>/<stage>``, and reads its neighbours' addresses
there; the sender of each (kind, link) connects to the receiver. From then on the executor, the
transfers and their progress thread are all C++: Python runs only the stage's forward, backward
and optimizer step.

The address a stage advertises: ``ASYNCPP_SOCKET_HOST`` when set; else 127.0.0.1 when the run
is on one machine (MASTER_ADDR unset or a loopback name); else this machine's address on the route
to MASTER_ADDR (what torchrun's other nodes can reach).

A receive the executor waits for polls its socket without sleeping for up to
``ASYNCPP_RECV_SPIN_US`` microseconds before it blocks (see :func:`recv_spin_us`): waking a
sleeping receiver puts a cross-CPU wake-up on the pipeline's critical path, once per transfer.
Receives of at most ``ASYNCPP_INLINE_RECV_BYTES`` (default 65536) are read only by the waiting
executor thread (see :func:`inline_recv_bytes`); larger ones also by the progress thread as their
data arrives, so their copy overlaps the stage's compute.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
from typing import Sequence

from .._ext import C
from .devices import local_ranks_from_env, usable_cores
from .nccl import channel_plan
from .rendezvous import check_run_id, default_store
from .transport import TransportError

HOST_ENV = "ASYNCPP_SOCKET_HOST"
RECV_SPIN_ENV = "ASYNCPP_RECV_SPIN_US"
AUTO_RECV_SPIN_US = 1000  # covers most waits of a fine-grained pipeline (0.1-0.7 ms, docs/results.md)
MAX_RECV_SPIN_US = 1_000_000  # the C++ transport's kMaxRecvSpinUs
INLINE_RECV_ENV = "ASYNCPP_INLINE_RECV_BYTES"
DEFAULT_INLINE_RECV_BYTES = 64 * 1024  # the C++ transport's kDefaultInlineRecvBytes
TRANSPORT_FAILURE = ": socket transport: "  # in every message of the C++ transport's failures


class SocketSetupError(RuntimeError):
    """The socket transport could not connect; the message names the peer and what to check."""


def _is_loopback(name: str) -> bool:
    if name in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except (OSError, ValueError):
        return False


def explicit_host(environ=os.environ) -> str | None:
    """``ASYNCPP_SOCKET_HOST`` resolved to an IPv4 address, or None when unset; SocketSetupError
    naming the variable when it does not resolve."""
    explicit = environ.get(HOST_ENV, "").strip()
    if not explicit:
        return None
    try:
        return str(ipaddress.IPv4Address(socket.gethostbyname(explicit)))
    except (OSError, ValueError):
        raise SocketSetupError(f"{HOST_ENV}={explicit!r} is not an IPv4 address or resolvable host name "
                               "of this machine; unset it or give this machine's address") from None


def advertised_host() -> str:
    """The IPv4 address this rank's neighbours connect to (see the module docstring)."""
    explicit = explicit_host()
    if explicit is not None:
        return explicit
    master = os.environ.get("MASTER_ADDR", "")
    if _is_loopback(master):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((master, 1))
        return probe.getsockname()[0]


def recv_spin_us(environ=None, cpus: int | None = None) -> int:
    """Microseconds a waited-for receive polls before it sleeps: ``ASYNCPP_RECV_SPIN_US``, either
    a whole number from 0 (block at once) to 1000000, or ``auto`` (the default): 1000 when this
    machine's ranks (LOCAL_WORLD_SIZE, else WORLD_SIZE) fit on the CPUs this process may run on,
    else 0, because a spinning rank would then take a core another rank computes on.
    ValueError naming the variable for anything else."""
    environ = os.environ if environ is None else environ
    raw = environ.get(RECV_SPIN_ENV, "").strip().lower()
    if raw in ("", "auto"):
        cpus = usable_cores() if cpus is None else cpus
        return AUTO_RECV_SPIN_US if local_ranks_from_env(environ) <= (cpus or os.cpu_count() or 1) else 0
    if not raw.isdigit() or int(raw) > MAX_RECV_SPIN_US:
        raise ValueError(f"{RECV_SPIN_ENV}={raw!r}: use auto or a whole number of microseconds from 0 to "
                         f"{MAX_RECV_SPIN_US} (how long a receive polls its socket before it sleeps; 0 never spins)")
    return int(raw)


def inline_recv_bytes(environ=None) -> int:
    """The largest receive (payload bytes) that only the waiting executor thread reads:
    ``ASYNCPP_INLINE_RECV_BYTES``, a whole number (0: every receive may be read by the progress
    thread), default 65536. A hand-over to the progress thread costs a wake-up and, on a core the
    stage computes on, a context switch, which is more than copying a small message; a large one
    is worth reading as it arrives, while the stage computes. ValueError naming the variable for
    anything else."""
    environ = os.environ if environ is None else environ
    raw = environ.get(INLINE_RECV_ENV, "").strip()
    if not raw:
        return DEFAULT_INLINE_RECV_BYTES
    if not raw.isdigit():
        raise ValueError(f"{INLINE_RECV_ENV}={raw!r}: use a whole number of bytes (receives up to that size are "
                         "read only by the waiting executor thread; 0 for none)")
    return int(raw)


def recv_spin_of_local_launch(ranks: int) -> tuple[int, str]:
    """(microseconds, setting) of the receive spin that ``ranks`` ranks spawned on this machine
    get from the current environment: for benchmark headers."""
    environ = dict(os.environ, WORLD_SIZE=str(ranks))
    return recv_spin_us(environ), environ.get(RECV_SPIN_ENV, "").strip() or "auto"


def rendezvous_key(run_id: str, stage: int) -> str:
    """Store key under which stage ``stage`` publishes its listener's ``host:port``."""
    return f"asyncpp/socket/{run_id}/{stage}"


def run_token(run_id: str) -> int:
    """A 64-bit number naming the run: connections presenting another are refused."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:8], "little")


class SocketTransport:
    """One stage's socket transport. ``impl`` is the C++ object (post_send/post_recv/test/wait/
    pending/close); :meth:`run_stage` runs the C++ executor with it."""

    cancels_waits = True
    """``cancel`` ends a wait in progress (stream_worker.py)."""

    def __init__(self, impl):
        self.impl = impl

    def run_stage(self, schedule: str, stages: int, microbatches: int, steps: int, stage: int, first_step: int,
                  host, board=None, *, recv_ahead: int = 2, max_inflight_sends: int = 8,
                  timeout_s: float = 300.0, progress=None) -> list:
        try:
            return C.run_stage_socket(schedule, stages, microbatches, steps, stage, first_step, host, self.impl,
                                      recv_ahead, max_inflight_sends, timeout_s, progress)
        except RuntimeError as e:
            if TRANSPORT_FAILURE not in str(e):  # the stage host's own error, unchanged
                raise
            raise TransportError(str(e)) from None  # a lost or stalled peer (see launch.py's exit codes)

    def pending(self) -> list:
        """Descriptions of the posted, unfinished transfers (for the watchdog's stall report)."""
        return list(self.impl.pending_descriptions())

    pending_transfers = pending

    def cancel(self, reason: str) -> None:
        """From another thread: the executor's wait in progress and every later transfer fail
        with ``reason`` (the sockets are shut down, so the neighbours' waits fail too)."""
        self.impl.cancel(reason)

    def close(self, timeout_s: float = 30.0) -> None:
        self.impl.close()


def create_socket_transport(board, stage: int, stages: int, stage_ranks: Sequence[int], *, store=None,
                            run_id: str = "run0", timeout_s: float = 300.0,
                            spin_us: int | None = None, inline_bytes: int | None = None) -> SocketTransport:
    """Listen, publish this stage's address, read the neighbours', and connect every channel.

    ``board`` is the stage host's ``C.MessageBoard``. Every stage of the pipeline calls this with
    the same ``run_id``. Blocks until the neighbours have connected (at most ``timeout_s``).
    ``spin_us``: see :func:`recv_spin_us`, ``inline_bytes``: see :func:`inline_recv_bytes` (None:
    from the environment)."""
    check_run_id(run_id)
    spin_us = recv_spin_us() if spin_us is None else spin_us
    inline_bytes = inline_recv_bytes() if inline_bytes is None else inline_bytes
    if len(stage_ranks) != stages:
        raise ValueError(f"stage_ranks must list one rank per stage ({stages}), got {list(stage_ranks)}")
    plan = channel_plan(stage, stages)
    host = advertised_host()
    listener = C.SocketListener("127.0.0.1" if host == "127.0.0.1" else "0.0.0.0")
    store = default_store() if store is None else store
    store.set(rendezvous_key(run_id, stage), f"{host}:{listener.port}")
    channels = []
    for ch in plan:
        peer_host, peer_port = "", 0
        if ch.is_send:  # the receiver listens; the sender connects
            key = rendezvous_key(run_id, ch.peer)
            try:
                store.wait([key], datetime.timedelta(seconds=timeout_s))
            except RuntimeError:
                raise SocketSetupError(f"stage {stage}: stage {ch.peer} (rank {stage_ranks[ch.peer]}) did not "
                                       f"publish its socket address within {timeout_s:g} s -- it has not "
                                       "started or failed during start-up") from None
            peer_host, port = store.get(key).decode().rsplit(":", 1)
            peer_port = int(port)
        channels.append((ch.kind, ch.is_send, ch.peer, int(stage_ranks[ch.peer]), peer_host, peer_port))
    try:
        impl = C.SocketTransport(stage, listener, channels, run_token(run_id), float(timeout_s), board,
                                 recv_spin_us=int(spin_us), inline_recv_bytes=int(inline_bytes))
    except RuntimeError as e:
        raise SocketSetupError(str(e).split(" [")[0]) from None
    return SocketTransport(impl)


__all__ = ["SocketTransport", "SocketSetupError", "create_socket_transport", "advertised_host", "explicit_host",
           "rendezvous_key", "run_token", "recv_spin_us", "recv_spin_of_local_launch", "inline_recv_bytes", "HOST_ENV",
           "RECV_SPIN_ENV", "INLINE_RECV_ENV"]
