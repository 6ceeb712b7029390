"""Checks of single configuration fields; each raises ConfigError naming the field and the value."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the field."""


def positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def non_negative_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


def positive_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def non_negative_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a non-negative number, got {value!r}")


def choice(name, value, options):
    if value not in options:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(options)}")
