"""Loads the compiled module with an error that says what to do when it is missing."""
# torch first: its libgomp.so.1 is then the one OpenMP runtime in the process (the loader reuses a
# loaded soname, so _C binds to it too). Loading _C first would hand torch the system libgomp instead.
import re

import torch  # noqa: F401

try:
    from . import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "asyncpp_ext._C (the compiled extension) could not be imported: "
        f"{e}. Build it with 'pip install .' (or 'make demo') from the source checkout."
    ) from e

C = _C

MAX_COUNT = 2**31 - 1
"""The largest count (steps, microbatches, stages, sizes) the core takes: its counts are C++ ints
(and torch's tensor sizes per dimension end there on some paths). Both command lines refuse more
with their own one-line message."""


def without_source_location(message) -> str:
    """A core error's message on one line, without the ' [file.cpp:12: cond]' the C++ checks append
    for debugging: what a user reads says what is wrong and what to do, not where."""
    message = re.sub(r"\s*\[[\w.]+:\d+: [^\]]*\]\s*$", "", str(message))
    return " ".join(message.split())
