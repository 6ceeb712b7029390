"""The Python transports: torch.distributed point-to-point, driven by the C++ executor.

``GlooTransport`` sends over gloo on the default group. Its tensors are the stage's own on CPU;
on CUDA they are staged through host memory (a send copies the device buffer to the host once
the compute that produced it is done, a receive lands in a host tensor and is copied into the
device buffer when its completion is seen), so several ranks may share one GPU.
``TorchTransport`` is the same on process groups of its own, one per link and message kind:
NCCL groups on CUDA (tensors stay on the GPU), gloo groups on CPU.

Requests are small integers handed to the executor; each keeps its tensor alive until the
transfer completes. Failures are re-raised naming the peer stage and its rank, so a dead or
stalled neighbour is reported as such rather than as a bare socket error.
"""
from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

from .._ext import C
from .stage import ACTIVATION, GRADIENT, StageHost
from .peer_errors import TransportError, peer_failure, peer_failure_reason  # noqa: F401 (re-exported)
from .watchdog import WatchedTransport

KIND_NAMES = {0: "activation", 1: "gradient"}


class GlooTransport:
    host_staging = True
    """Device tensors travel through host copies (gloo moves CPU memory only)."""
    cancels_waits = False
    """``cancel`` fails later posts and waits but not one blocked in gloo (stream_worker.py)."""

    def __init__(self, host: StageHost, stage_ranks: list, group=None, watchdog=None):
        self.host, self.stage_ranks, self.group = host, list(stage_ranks), group
        self.watchdog = watchdog  # told of every completed wait (watchdog.WatchedTransport)
        self._ids = itertools.count()
        # id -> (work, tensor on the wire, description, device tensor a staged receive fills)
        self._pending: dict[int, tuple] = {}
        self._cancelled: str | None = None  # see cancel

    def cancel(self, reason: str) -> None:
        """From another thread: every later post and wait fails with ``reason``. A wait already
        blocked in gloo is not interrupted; it ends when the peer's process does."""
        self._cancelled = f"stage {self.host.stage}: {reason}"

    def _check_cancelled(self) -> None:
        if self._cancelled is not None:
            raise TransportError(self._cancelled)

    def _group(self, kind: int, peer: int):
        return self.group

    def _describe(self, is_send: bool, kind: int, step: int, mb: int, peer: int, tensor) -> str:
        direction = "send to" if is_send else "recv from"
        return (f"stage {self.host.stage}: {KIND_NAMES[kind]} {direction} stage {peer} "
                f"(rank {self.stage_ranks[peer]}, tag {kind}), step {step}, microbatch {mb}, "
                f"shape {tuple(tensor.shape)}")

    def post_send(self, kind: int, step: int, mb: int, peer: int, tensor: torch.Tensor) -> int:
        """Start sending ``tensor`` (the stage host's output) to stage ``peer``."""
        return self._post(True, kind, step, mb, peer, tensor)

    def post_recv(self, kind: int, step: int, mb: int, peer: int, tensor: torch.Tensor) -> int:
        """Start receiving into ``tensor`` (a receive slot of the runtime) from stage ``peer``."""
        return self._post(False, kind, step, mb, peer, tensor)

    def _post(self, is_send: bool, kind: int, step: int, mb: int, peer: int, tensor: torch.Tensor) -> int:
        self._check_cancelled()
        fill = None
        if is_send:
            wire = self._to_host(tensor) if self._staged(tensor) else tensor
            op, where = dist.isend, {"dst": self.stage_ranks[peer]}
        else:
            wire, fill = (self._host_buffer(tensor), tensor) if self._staged(tensor) else (tensor, None)
            op, where = dist.irecv, {"src": self.stage_ranks[peer]}
        desc = self._describe(is_send, kind, step, mb, peer, tensor)
        try:
            work = op(wire, group=self._group(kind, peer), tag=kind, **where)
        except RuntimeError as e:
            raise TransportError(f"{desc}: {e}") from None
        return self._add(work, wire, desc, fill)

    def _staged(self, tensor: torch.Tensor) -> bool:
        return self.host_staging and tensor.device.type != "cpu"

    @staticmethod
    def _to_host(tensor: torch.Tensor) -> torch.Tensor:
        """Host staging for a send, waited for (gloo reads the buffer once the send is posted, and
        the wait covers the compute that produced the tensor, as ``.to("cpu")`` would): into pinned
        memory, which the copy engine fills at full speed, where a pageable copy goes through the
        driver's own staging at a fraction of it. The buffer stays referenced until the send is
        complete, so torch's host allocator cannot hand it out earlier."""
        if not tensor.is_cuda:  # staging forced on another device (tests): a plain copy
            return tensor.to("cpu")
        wire = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        wire.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return wire

    @staticmethod
    def _host_buffer(like: torch.Tensor) -> torch.Tensor:
        """Host staging for a receive: pinned, so the copy to the device can be asynchronous."""
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)

    def _add(self, work, tensor, desc: str, fill=None) -> int:
        request = next(self._ids)
        self._pending[request] = (work, tensor, desc, fill)
        return request

    def test(self, request: int) -> bool:
        work = self._pending[request][0]
        if work.is_completed():
            self.wait(request, 1.0)
            return True
        return False

    def wait(self, request: int, timeout_s: float) -> None:
        self._check_cancelled()
        work, wire, desc, fill = self._pending[request]
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            reason = peer_failure_reason(e)
            if "imeout" in reason or "timed out" in reason:
                raise TransportError(f"{desc}: no progress for {timeout_s:g} s (the peer is stalled "
                                     f"or has failed): {reason}") from None
            raise TransportError(f"{desc} failed -- the peer has probably exited: {reason}") from None
        if fill is not None:
            # Queued on this thread's current stream, ahead of the compute that reads the buffer;
            # the pinned source stays reserved until the copy has run (torch's host allocator).
            fill.copy_(wire, non_blocking=True)
        del self._pending[request]

    def pending(self, confirm_sends: bool = False) -> list:
        """Descriptions of the sends/receives posted and not known to be complete.

        gloo marks a send complete only once it is waited on, so with ``confirm_sends`` each send
        is waited on for 1 ms and left out if that succeeds. That may consume the completion the
        executor's own wait expects, so only the stall report (just before the rank exits) uses it."""
        out = []
        for work, _, desc, _ in list(self._pending.values()):
            if work.is_completed():
                continue
            if confirm_sends and " send to " in desc:
                try:
                    work.wait(timeout=datetime.timedelta(milliseconds=1))
                    continue
                except RuntimeError:
                    pass
            out.append(desc)
        return out

    def describe_request(self, request: int) -> str:
        return self._pending[request][2]

    def run_stage(self, schedule: str, stages: int, microbatches: int, steps: int, stage: int, first_step: int,
                  host, board, *, recv_ahead: int = 2, max_inflight_sends: int = 8, timeout_s: float = 300.0,
                  progress=None) -> list:
        """The C++ executor over this transport (its posts and waits call back into Python)."""
        transport = self if self.watchdog is None else WatchedTransport(self, self.watchdog)
        return C.run_stage(schedule, stages, microbatches, steps, stage, first_step, host, board, transport,
                           recv_ahead, max_inflight_sends, timeout_s, progress)

    def pending_transfers(self) -> list:
        """For the watchdog's stall report, just before the rank exits (see ``pending``)."""
        return self.pending(confirm_sends=True)


class TorchTransport(GlooTransport):
    """torch.distributed ``isend``/``irecv`` on one process group per (link, message kind).

    With NCCL, torch runs all point-to-point operations of one group between the same two ranks
    on one stream, in the order they were posted: a gradient receive posted ahead would hold up an
    activation send behind it, and the two stages would wait for each other. One group per link
    and kind gives each direction its own stream. ``groups`` maps (kind, link) to this rank's
    groups, link being the lower stage of the pair (see create_link_groups)."""

    host_staging = False  # NCCL groups move device memory; on CPU the tensors are host tensors already

    def __init__(self, host: StageHost, stage_ranks: list, groups: dict, nccl: bool = False, watchdog=None):
        super().__init__(host, stage_ranks, watchdog=watchdog)
        self.groups, self.nccl = groups, nccl

    def _group(self, kind: int, peer: int):
        return self.groups[(kind, min(self.host.stage, peer))]

    def pending(self, confirm_sends: bool = False) -> list:
        # NCCL reports a finished send as complete by itself, and a timed-out wait on NCCL work
        # tears the communicator down: no confirming waits there.
        return super().pending(confirm_sends and not self.nccl)


def create_link_groups(pipelines: list, stage: int, replica: int, device: torch.device, timeout_s: float) -> dict:
    """This rank's groups for TorchTransport, as {(kind, link): group}.

    ``pipelines`` lists every replica's stage ranks; the groups are NCCL groups when ``device``
    is a CUDA device (this rank's), else gloo groups. ``new_group`` is collective over the whole
    world: every rank creates every group, in the same order (replica, link, activation then
    gradient). Each group's first message then travels right here, pair by pair in that order,
    because NCCL connects a pair at its first message and blocks until both ranks arrive: left to
    the executor, a receive posted ahead on one link could wait for a peer busy connecting
    another."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    mine, order = {}, []
    for r, ranks in enumerate(pipelines):
        for link in range(len(ranks) - 1):
            for kind in (ACTIVATION, GRADIENT):
                pair = [ranks[link], ranks[link + 1]]
                group = dist.new_group(pair, timeout=timeout, backend=backend)
                if r == replica and stage in (link, link + 1):
                    mine[(kind, link)] = group
                    order.append((kind, link, pair))
    probe = torch.zeros(1, device=device)
    for kind, link, pair in order:  # the lower stage sends, in the same order on both ends
        group = mine[(kind, link)]
        try:
            if stage == link:
                dist.send(probe, dst=pair[1], group=group)
            else:
                dist.recv(probe, src=pair[0], group=group)
        except RuntimeError as e:
            peer = link + 1 if stage == link else link
            raise TransportError(f"stage {stage}: connecting the {KIND_NAMES[kind]} group with stage {peer} "
                                 f"(rank {pipelines[replica][peer]}) failed -- {peer_failure(e)}") from None
    return mine


__all__ = ["GlooTransport", "TorchTransport", "TransportError", "create_link_groups", "ACTIVATION"]
