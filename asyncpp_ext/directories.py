"""Output directories that a command makes and, when it fails, removes again.

The commands make the missing directories of the paths they are told to write (``asyncpp-train
--out runs/a/b``, ``asyncpp-prepare-data --out data/train.bin``, ``asyncpp-schedule --plot
plots/t.png``), as users expect of an output path; a command that then fails or is stopped leaves
nothing behind, those directories included; an output file written under a temporary name gets
the mode a plain open() would have given it (``chmod_as_created``). Standard library only: every
layer may use it.
"""
from __future__ import annotations

import os
from pathlib import Path


def chmod_as_created(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open()`` would have created it with: 0o666 less the
    process's umask (mkstemp and safetensors make files only their owner may read)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def missing_directories(directory: str | os.PathLike) -> list:
    """``directory`` and those of its ancestors that do not exist, outermost first."""
    missing, path = [], Path(directory).absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing[::-1]


def unwritable_ancestor(directory: str | os.PathLike):
    """None where ``directory`` exists as a writable directory or can be made; else the nearest
    existing ancestor that stops it (a file, or a directory this user cannot write), for the
    caller's one-line refusal."""
    missing = missing_directories(directory)
    nearest = missing[0].parent if missing else Path(directory).absolute()
    return None if nearest.is_dir() and os.access(nearest, os.W_OK | os.X_OK) else nearest


def make_directories(directories: list) -> list:
    """Create ``directories`` (outermost first); returns those this call created, which
    ``remove_directories`` takes (one that appeared meanwhile is not ours to remove). If one cannot
    be made, those made before it are removed and the OSError raised."""
    made = []
    try:
        for directory in directories:
            try:
                os.mkdir(directory)
            except FileExistsError:
                continue
            made.append(directory)
    except BaseException:
        remove_directories(made)
        raise
    return made


def remove_directories(made: list) -> None:
    """Remove, innermost first, the directories of ``made`` that are still empty: what holds an
    output that was put in place, or someone else's file, stays."""
    for directory in reversed(made):
        try:
            os.rmdir(directory)
        except OSError:
            pass


__all__ = ["make_directories", "missing_directories", "remove_directories", "unwritable_ancestor"]
