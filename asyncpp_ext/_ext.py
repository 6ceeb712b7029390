"""Loads the compiled module with an error that says what to do when it is missing."""
try:
    from . import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "asyncpp_ext._C (the compiled extension) could not be imported: "
        f"{e}. Build it with 'pip install .' (or 'make demo') from the source checkout."
    ) from e

C = _C
