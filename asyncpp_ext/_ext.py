"""Loads the compiled module with an error that says what to do when it is missing."""
# torch first: its libgomp.so.1 is then the one OpenMP runtime in the process (the loader reuses a
# loaded soname, so _C binds to it too). Loading _C first would hand torch the system libgomp instead.
import torch  # noqa: F401

try:
    from . import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "asyncpp_ext._C (the compiled extension) could not be imported: "
        f"{e}. Build it with 'pip install .' (or 'make demo') from the source checkout."
    ) from e

C = _C
