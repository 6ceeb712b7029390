"""The one exception type of the data package (its own module, so every data module can raise it
without importing another)."""


class DataError(ValueError):
    """A data source that cannot feed training; the message names the file and the fix."""


__all__ = ["DataError"]
