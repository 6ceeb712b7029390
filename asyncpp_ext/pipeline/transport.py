"""The CPU transport: torch.distributed point-to-point (gloo), driven by the C++ executor.

Requests are small integers handed to the executor; each keeps its tensor alive until the
transfer completes. Failures are re-raised naming the peer stage and its rank, so a dead or
stalled neighbour is reported as such rather than as a bare socket error.
"""
from __future__ import annotations

import datetime
import itertools
import re

import torch.distributed as dist

from .stage import ACTIVATION, StageHost

KIND_NAMES = {0: "activation", 1: "gradient"}


class TransportError(RuntimeError):
    pass


def peer_failure_reason(error: BaseException) -> str:
    """The useful part of a gloo error, on one line (gloo prefixes a source location and appends
    advice meant for gloo's own users)."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


class GlooTransport:
    def __init__(self, host: StageHost, stage_ranks: list, group=None):
        self.host, self.stage_ranks, self.group = host, list(stage_ranks), group
        self._ids = itertools.count()
        self._pending: dict[int, tuple] = {}  # id -> (work, tensor, description)

    def _describe(self, is_send: bool, kind: int, step: int, mb: int, peer: int, tensor) -> str:
        direction = "send to" if is_send else "recv from"
        return (f"stage {self.host.stage}: {KIND_NAMES[kind]} {direction} stage {peer} "
                f"(rank {self.stage_ranks[peer]}, tag {kind}), step {step}, microbatch {mb}, "
                f"shape {tuple(tensor.shape)}")

    def post_send(self, kind: int, step: int, mb: int, peer: int) -> int:
        return self._post(True, kind, step, mb, peer)

    def post_recv(self, kind: int, step: int, mb: int, peer: int) -> int:
        return self._post(False, kind, step, mb, peer)

    def _post(self, is_send: bool, kind: int, step: int, mb: int, peer: int) -> int:
        if is_send:
            tensor = self.host.take_send_buffer(kind, step, mb)
            op, where = dist.isend, {"dst": self.stage_ranks[peer]}
        else:
            tensor = self.host.recv_buffer(kind, step, mb)
            op, where = dist.irecv, {"src": self.stage_ranks[peer]}
        desc = self._describe(is_send, kind, step, mb, peer, tensor)
        try:
            work = op(tensor, group=self.group, tag=kind, **where)
        except RuntimeError as e:
            raise TransportError(f"{desc}: {e}") from None
        return self._add(work, tensor, desc)

    def _add(self, work, tensor, desc: str) -> int:
        request = next(self._ids)
        self._pending[request] = (work, tensor, desc)
        return request

    def test(self, request: int) -> bool:
        work = self._pending[request][0]
        if work.is_completed():
            self.wait(request, 1.0)
            return True
        return False

    def wait(self, request: int, timeout_s: float) -> None:
        work, _, desc = self._pending[request]
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            reason = peer_failure_reason(e)
            if "imeout" in reason or "timed out" in reason:
                raise TransportError(f"{desc}: no progress for {timeout_s:g} s (the peer is stalled "
                                     f"or has failed): {reason}") from None
            raise TransportError(f"{desc} failed -- the peer has probably exited: {reason}") from None
        del self._pending[request]

    def pending(self, confirm_sends: bool = False) -> list:
        """Descriptions of the sends/receives posted and not known to be complete.

        gloo marks a send complete only once it is waited on, so with ``confirm_sends`` each send
        is waited on for 1 ms and left out if that succeeds. That may consume the completion the
        executor's own wait expects, so only the stall report (just before the rank exits) uses it."""
        out = []
        for work, _, desc in list(self._pending.values()):
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


__all__ = ["GlooTransport", "TransportError", "ACTIVATION"]
