"""Errors raised by asyncpp_ext.optim."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf; raised before any weight or optimizer state was modified."""
