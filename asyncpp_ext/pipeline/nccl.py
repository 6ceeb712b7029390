"""The CUDA transport: the C++ NCCL transport, its rendezvous, and the checks that say what to fix.

Each stage owns up to four 2-rank NCCL communicators, one per neighbour and direction:
activations s -> s+1 and gradients s+1 -> s each travel on their own communicator (the "link" of
a pair s, s+1 is s). The sender of each creates the NCCL unique id and publishes its 128 bytes in
torch.distributed's key-value store under ``asyncpp/nccl/<run_id>/<act|grad>/<link>``; the
receiver waits for it there. So whatever launched torch.distributed (torchrun on one or many
machines, or :func:`asyncpp_ext.pipeline.spawn`) is all the rendezvous NCCL needs.
"""
from __future__ import annotations

import datetime
import glob
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .._ext import C
from .rendezvous import check_run_id, default_store, next_run_id
from .stage import ACTIVATION, GRADIENT

_KIND_KEYS = {ACTIVATION: "act", GRADIENT: "grad"}


def nccl_candidates() -> list[str]:
    """Where the NCCL transport looks for libnccl, in order."""
    found = []
    if os.environ.get("NCCL_LIBRARY"):
        found.append(os.environ["NCCL_LIBRARY"])
    for entry in sys.path:  # the nvidia-nccl-cu12 / -cu13 wheels install nvidia/nccl/lib
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*")))
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "cu1*", "lib", "libnccl.so*")))
    found.append("libnccl.so.2")  # the system loader path
    return list(dict.fromkeys(found))


class NcclUnavailableError(RuntimeError):
    """The NCCL transport cannot run here; the message says what to install or rebuild."""


class RendezvousError(RuntimeError):
    """A peer did not publish its NCCL id in time."""


@dataclass(frozen=True)
class Channel:
    """One communicator of a stage: its message kind, this stage's role, the peer and the link."""
    kind: int        # ACTIVATION or GRADIENT
    is_send: bool
    peer: int        # the other stage
    link: int        # the lower stage of the pair


def rendezvous_key(run_id: str, kind: int, link: int) -> str:
    """Store key under which the sender of (kind, link) publishes its NCCL unique id."""
    if kind not in _KIND_KEYS:
        raise ValueError(f"kind must be {ACTIVATION} (activation) or {GRADIENT} (gradient), got {kind!r}")
    return f"asyncpp/nccl/{run_id}/{_KIND_KEYS[kind]}/{link}"


def channel_plan(stage: int, stages: int) -> list[Channel]:
    """The communicators stage ``stage`` of ``stages`` takes part in, in creation order."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1 (got {stages})")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) (got {stage})")
    plan = []
    if stage > 0:  # link stage-1: activations arrive, gradients leave
        plan += [Channel(ACTIVATION, False, stage - 1, stage - 1), Channel(GRADIENT, True, stage - 1, stage - 1)]
    if stage < stages - 1:  # link stage: activations leave, gradients arrive
        plan += [Channel(ACTIVATION, True, stage + 1, stage), Channel(GRADIENT, False, stage + 1, stage)]
    return plan


def exchange_unique_ids(store, run_id: str, stage: int, stages: int, stage_ranks: Sequence[int], *,
                        make_id: Callable[[], bytes], timeout_s: float = 300.0) -> list[tuple]:
    """Publish this stage's sender ids, then collect the ids of the channels it receives on.

    Returns the channel tuples ``C.NcclTransport`` takes: (kind, is_send, peer, peer_rank, id).
    Publishing everything before waiting for anything means no two stages wait for each other.
    """
    check_run_id(run_id)
    if len(stage_ranks) != stages:
        raise ValueError(f"stage_ranks must list one rank per stage ({stages}), got {len(stage_ranks)}")
    plan = channel_plan(stage, stages)
    ids = {}
    for ch in plan:
        if ch.is_send:
            ids[ch] = bytes(make_id())
            if len(ids[ch]) != 128:
                raise ValueError(f"make_id returned {len(ids[ch])} bytes; an NCCL unique id has 128")
            store.set(rendezvous_key(run_id, ch.kind, ch.link), ids[ch])
    for ch in plan:
        if not ch.is_send:
            key = rendezvous_key(run_id, ch.kind, ch.link)
            try:
                store.wait([key], datetime.timedelta(seconds=timeout_s))
            except RuntimeError as e:
                raise RendezvousError(
                    f"stage {stage}: stage {ch.peer} (rank {stage_ranks[ch.peer]}) did not publish its NCCL id "
                    f"under {key!r} within {timeout_s:g} s -- is it running, with the same run_id? "
                    f"({' '.join(str(e).split())})") from None
            ids[ch] = bytes(store.get(key))
    return [(ch.kind, ch.is_send, ch.peer, int(stage_ranks[ch.peer]), ids[ch]) for ch in plan]


def require_nccl(need_gpu: bool = False) -> dict:
    """Check this build (and, with ``need_gpu``, this machine) can run NCCL; returns the
    ``C.nccl_load`` result."""
    if not C.build_config()["cuda_compiled"]:
        raise NcclUnavailableError(
            "asyncpp_ext was built without CUDA (no nvcc was found at build time), so the NCCL transport "
            "is not available: install the CUDA toolkit, put nvcc on PATH and rebuild (pip install . or "
            "make build); on CPU use the gloo transport")
    loaded = C.nccl_load(nccl_candidates())
    if not loaded["ok"]:
        tried = loaded["error"].strip().rstrip(";")
        raise NcclUnavailableError(
            f"NCCL could not be loaded (tried: {tried}): pip install nvidia-nccl-cu12 (or nvidia-nccl-cu13 "
            "for CUDA 13), or set NCCL_LIBRARY to the path of libnccl.so.2")
    if need_gpu and not torch.cuda.is_available():
        raise NcclUnavailableError("the NCCL transport needs a GPU, but torch sees no CUDA device "
                                   "(is this a CPU build of torch, or is CUDA_VISIBLE_DEVICES empty?)")
    return loaded


class NcclTransport:
    """One stage's NCCL transport, bound to its CUDA device and compute stream.

    ``impl`` is the C++ transport (post_send/post_recv/test/wait/close); :meth:`run_stage` runs the
    executor with it on the compute stream, so forward/backward and the transfers are ordered by
    events on the device rather than by host synchronisation.
    """

    cancels_waits = True
    """``cancel`` ends a wait in progress (stream_worker.py)."""

    def __init__(self, impl, device: torch.device, stream):
        self.impl, self.device, self.stream = impl, device, stream

    def run_stage(self, schedule: str, stages: int, microbatches: int, steps: int, stage: int, first_step: int,
                  host, board=None, *, recv_ahead: int = 2, max_inflight_sends: int = 8, timeout_s: float = 300.0,
                  progress=None) -> list:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return C.run_stage_nccl(schedule, stages, microbatches, steps, stage, first_step, host, self.impl,
                                    recv_ahead, max_inflight_sends, timeout_s, progress)

    def pending(self) -> list:
        """Descriptions of the posted, unfinished transfers (for the watchdog's stall report)."""
        return list(self.impl.pending_descriptions())

    pending_transfers = pending

    def cancel(self, reason: str) -> None:
        """From another thread: the executor's wait in progress and every later transfer fail
        with ``reason`` (on the executor's thread, which aborts the communicators)."""
        self.impl.cancel(reason)

    def close(self, timeout_s: float = 30.0) -> None:
        self.impl.close(timeout_s)


def create_nccl_transport(board, stage: int, stages: int, stage_ranks: Sequence[int], device, *,
                          store=None, run_id: str | None = None, timeout_s: float = 300.0) -> NcclTransport:
    """Rendezvous with the neighbouring stages and create this stage's NCCL communicators.

    ``board`` is the stage host's ``C.MessageBoard``: the payloads, contiguous tensors on
    ``device``. Every stage must call this with the
    same ``run_id`` (default: a per-process counter, equal on all ranks that create their
    transports in the same order). Blocks until the neighbours have joined.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the NCCL transport runs on a CUDA device, got device={str(device)!r}; "
                         "use the gloo transport on CPU")
    require_nccl(need_gpu=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    run_id = check_run_id(next_run_id() if run_id is None else run_id)
    store = default_store() if store is None else store
    channels = exchange_unique_ids(store, run_id, stage, stages, stage_ranks, make_id=C.nccl_unique_id,
                                   timeout_s=timeout_s)
    stream = torch.cuda.current_stream(index)
    impl = C.NcclTransport(stage, index, stream.cuda_stream, channels, board)
    return NcclTransport(impl, torch.device("cuda", index), stream)


# The dtypes a boundary tensor may have and their element sizes. The transport moves bytes
# (ncclUint8), so each dtype is a size class: what changes is the byte count and the alignment.
SELF_TEST_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "uint8": 1}
SELF_TEST_SIZES = {  # size class -> target bytes (counts are rounded so every class is odd-sized)
    "1 element": 0, "odd": 1000, "~4 KiB": 4 << 10, "~1 MiB": 1 << 20, "~64 MiB": 64 << 20}


def self_test_cases(quick: bool = False) -> list[tuple[str, int, int]]:
    """(dtype, element_size, count) per dtype and size class: 1 element, then an odd element count
    near each target size (never a power of two). ``quick`` keeps one 64 MiB case (uint8)."""
    cases = []
    for dtype, size in SELF_TEST_DTYPES.items():
        for label, target in SELF_TEST_SIZES.items():
            if quick and target >= 64 << 20 and dtype != "uint8":
                continue
            count = 1 if target == 0 else (target // size) | 1
            cases.append((dtype, size, count))
    return cases


def self_test(device="cuda:0", *, quick: bool = False, spin_ms: float = 20.0) -> dict:
    """The NCCL transport on one GPU: a 1-rank communicator sends to itself through the transport's
    own ordering sequence (see csrc/nccl/nccl_selftest.h). Returns {"ok", "device", "gpu",
    "nccl_version", "cases": [{dtype, count, bytes, mismatches, seconds}], "ordering": {...},
    "loopback_gbps"}: ok when every byte arrived as sent, in every case and the ordering case."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the NCCL self-test runs on a CUDA device, got device={str(device)!r}")
    loaded = require_nccl(need_gpu=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    result = dict(C.nccl_self_test(index, self_test_cases(quick), float(spin_ms)))
    checked = result["cases"] + [result["ordering"]]
    largest = max(result["cases"], key=lambda c: c["bytes"])
    result.update(ok=all(c["mismatches"] == 0 for c in checked), gpu=torch.cuda.get_device_name(index),
                  nccl_version=loaded["version"], nccl_library=loaded["path"],
                  loopback_gbps=largest["bytes"] / max(largest["seconds"], 1e-9) / 1e9)
    return result


__all__ = ["NcclTransport", "NcclUnavailableError", "RendezvousError", "Channel", "channel_plan",
           "rendezvous_key", "exchange_unique_ids", "require_nccl", "create_nccl_transport", "default_store",
           "self_test", "self_test_cases"]
