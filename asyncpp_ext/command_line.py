"""The commands' argument parser (standard library only).

argparse prints its usage block before a complaint and exits; every command here answers a bad
command line with one line ``PROG: error: ...`` and exit 2, as it answers every other bad input.
``OneLineParser`` raises argparse's complaint as a ``UsageError`` for the command's ``main`` to
print so.
"""
from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A bad command line (argparse's complaints, conflicting flags, an unusable path); the message
    names the argument and the fix."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


__all__ = ["OneLineParser", "UsageError"]
