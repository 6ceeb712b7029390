"""An allocation failure among exceptions (host or device), for the commands' one-line errors:
sizes that do not fit are the user's to lower, not a traceback."""
from __future__ import annotations


def out_of_memory(exc: BaseException) -> str | None:
    """``exc``'s message on one line (at most 300 characters) when it is an allocation failure:
    a MemoryError, torch's host allocator refusing a size ("can't allocate memory"), or a device
    out of memory (torch.OutOfMemoryError, a RuntimeError). None for anything else."""
    if not isinstance(exc, (MemoryError, RuntimeError)):
        return None
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, MemoryError) or "allocate" in text or "out of memory" in text:
        return text[:300]
    return None


__all__ = ["out_of_memory"]
