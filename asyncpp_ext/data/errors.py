"""The one exception type of the data package (its own module, so every data module can raise it
without importing another)."""


class DataError(ValueError):
    """A data source that cannot feed training; the message names the file and the fix."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none: the reason
    a one-line error quotes from a library's (often multi-line) exception."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


__all__ = ["DataError", "first_line"]
