"""The one rule for the optimizers' numeric arguments (learning rates, decays, betas, step counts).

A number is a Python or NumPy int or float (``numbers.Real``; ``numbers.Integral`` where a count
is expected), never a bool, a string, None or a tensor. It is returned as a plain Python float (or
int), so a param group holds the same value whichever of these it was given. A wrong type and a
value out of range are each one ``error`` (ValueError unless a module passes its own subclass)
naming the argument. Standard library only.
"""
from __future__ import annotations

import math
import numbers


def real_number(value, what: str, rule: str = "a finite number", ok=None, error=ValueError) -> float:
    """``value`` as a float if it is a finite real number for which ``ok(float)`` holds (any finite
    number when ``ok`` is None); otherwise ``error``: "<what> must be a number, got '0.1' (str)"
    for a wrong type, "<what> must be <rule>, got <value>" for a value out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    x = float(value)
    if not (math.isfinite(x) and (ok is None or ok(x))):
        raise error(f"{what} must be {rule}, got {value!r}")
    return x


def whole_number(value, what: str, rule: str = "an integer", ok=None, error=ValueError) -> int:
    """``value`` as an int if it is an integer (not a bool) for which ``ok(int)`` holds; otherwise
    ``error`` naming ``what`` and ``rule``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{what} must be {rule}, got {value!r} ({type(value).__name__})")
    n = int(value)
    if ok is not None and not ok(n):
        raise error(f"{what} must be {rule}, got {value!r}")
    return n


def positive(x) -> bool:
    return x > 0


def non_negative(x) -> bool:
    return x >= 0


def unit_interval(x) -> bool:
    """In [0, 1) (a momentum or a decay rate)."""
    return 0 <= x < 1


__all__ = ["real_number", "whole_number", "positive", "non_negative", "unit_interval"]
