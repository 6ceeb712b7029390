"""How a rank tells a peer's failure from its own: the error a transport raises when its peer is
gone, and the recognisers for what torch's collectives raise then. A rank that stops on either
only reacted (launch.py's exit codes)."""
from __future__ import annotations

import re


class TransportError(RuntimeError):
    """A send, receive or collective failed because a peer exited or stalled."""


# What torch's collectives raise (a plain RuntimeError) when the peer's process is gone: gloo's
# socket closed or reset, NCCL's remote error.
_PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "ncclRemoteError")


def peer_gone(error: BaseException) -> bool:
    """Whether a collective's error says the connection to a peer went away (its process exited)."""
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _PEER_GONE_MARKERS)


def peer_failure(error: BaseException, who: str = "the peer") -> str:
    """Why a blocking call with ``who`` failed, for a message: a timeout is no answer in time (the
    peer may be alive but slow or stalled, or waiting elsewhere), anything else a peer that has
    probably exited; then the error's useful part."""
    reason = peer_failure_reason(error)
    if "imed out" in reason or "imeout" in reason:
        return f"{who} did not answer in time (stalled, slow, waiting elsewhere, or failed): {reason}"
    return f"{who} has probably exited: {reason}"


def peer_failure_reason(error: BaseException) -> str:
    """The useful part of a gloo error, on one line (gloo prefixes a source location and appends
    advice meant for gloo's own users)."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]
