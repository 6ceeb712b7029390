"""Figures written to a file (matplotlib, Agg backend): the path checked before the work that
draws it, and the file written so a stop or a failure part-way leaves nothing. Used by
``asyncpp-schedule --plot`` and the benches' ``--plot``."""
from __future__ import annotations

import contextlib
import os

from .directories import make_directories, missing_directories, remove_directories, unwritable_ancestor


def check_figure_path(path: str, example: str = "figure.png") -> None:
    """ValueError (one line, starting with the path) unless ``path`` names a file whose suffix
    matplotlib writes, in a directory that exists or can be made; ``example`` is the name the
    message suggests. Without a suffix matplotlib would write ``path.png`` instead: a name like
    ``-``, ``/dev/full`` or ``out/curves`` is more likely a mistake than a wish for that file."""
    from matplotlib.backend_bases import FigureCanvasBase

    if not path:
        raise ValueError(f"'' names no file; name one such as {example}")
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{path} is a directory; name a file such as {os.path.join(path, example)}")
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if not suffix:
        raise ValueError(f"{path} has no suffix to choose the format by; name the file with one, "
                         f"such as {path}.png")
    if suffix not in formats:
        raise ValueError(f"{path}: matplotlib cannot write .{suffix} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    blocked = unwritable_ancestor(os.path.dirname(os.path.abspath(path)))
    if blocked is not None:
        raise ValueError(f"{path}: {blocked} is not a writable directory; choose another place")


def save_figure(fig, path: str, dpi: int = 110) -> str:
    """``fig`` to ``path`` -- with matplotlib's ``.png`` added when it has no suffix -- creating
    missing directories; returns the file's name. It is written beside the final name and renamed
    at the end, so a stop or a failure part-way leaves neither a partial file nor new directories."""
    import matplotlib

    path = os.fspath(path)
    fmt = os.path.splitext(path)[1][1:].lower()
    if not fmt:
        fmt = matplotlib.rcParams["savefig.format"]
        path = f"{path}.{fmt}"
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.partial")
    made = []
    try:
        made = make_directories(missing_directories(os.path.dirname(os.path.abspath(path))))
        fig.savefig(partial, dpi=dpi, format=fmt)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):  # not made yet
            os.remove(partial)
        remove_directories(made)
        raise
    return path


__all__ = ["check_figure_path", "save_figure"]
