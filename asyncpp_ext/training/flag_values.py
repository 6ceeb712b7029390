"""What the values of ``asyncpp-train``'s flags are: each parser argparse calls for a flag's text
(``type=``), and the conversions config_from_args makes of them (arguments.py)."""
from __future__ import annotations

import argparse
import math
from typing import Optional

from ..models.compile_support import parse_inductor_option
from .config import RunConfig


def _inductor_options(given: Optional[list]) -> Optional[dict]:
    """The --inductor-option pairs in order as a dict (a NAME given twice keeps the last; "none"
    drops those before it), or None when the flag was not given (a resumed run keeps its own)."""
    if not given:
        return None
    options: dict = {}
    for name, value in given:
        if name:
            options[name] = value
        else:
            options.clear()
    return options


def inductor_option(text: str) -> tuple:
    """``--inductor-option NAME=VALUE`` -> (NAME, VALUE) (models/compile_support.parse_inductor_option)."""
    try:
        return parse_inductor_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def document_mask_value(text: str):
    """``--document-mask [ID]``: "data" (the data's boundary token) or a token id."""
    if text == "data":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token id (an integer >= 0) or 'data'; give the id of "
                                         "the token that starts or ends each document, or no value for the data's own")
    return value


TOKEN_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def token_count(text: str) -> int:
    """``--tokens N``: a positive count, 2500000000 or 2.5B (K, M, B, T: thousand .. trillion)."""
    scale = TOKEN_SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count >= 1 (e.g. 2500000000 or 2.5B)")
    return math.ceil(value)


def steps_for_tokens(tokens: int, cfg: RunConfig) -> int:
    """The optimizer steps that train at least ``tokens`` tokens at ``cfg``'s tokens per step."""
    return -(-tokens // cfg.tokens_per_step())


def data_mix_entry(text: str) -> list:
    """``--data-mix PATH=WEIGHT`` -> [PATH, WEIGHT] (the last '=' splits: a path may hold one)."""
    path, sep, weight = text.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = None
    if not sep or not path.strip() or value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not PATH=WEIGHT with a weight > 0 "
                                         "(e.g. --data-mix 'web/*.bin=0.7')")
    return [path, value]


__all__ = ["inductor_option", "document_mask_value", "TOKEN_SUFFIXES", "token_count", "steps_for_tokens", "data_mix_entry"]
