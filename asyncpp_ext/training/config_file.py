"""``asyncpp-train --config FILE``: flags from a TOML or JSON file.

A run of many settings reads better, and is kept with an experiment better, as a file than as a
command line. The file's keys are ``asyncpp-train``'s long flags without their dashes (``steps``,
``micro-batch-size`` or ``micro_batch_size``); tables only group keys for the reader (their names
are not read). A value is the flag's value; ``true`` / ``false`` turn an on/off flag on or off
(``--X`` / ``--no-X``); a list repeats a repeatable flag (``inductor-option``), and a table named
after a repeatable KEY=VALUE flag gives one value per entry (``[data-mix]`` with ``"web/*.bin" =
0.7``: ``--data-mix web/*.bin=0.7``). The file's flags come before the command line's, so a flag
given there wins (a repeatable one adds to the file's)::

    # runs/exp1.toml
    model = "smollm-135m"
    steps = 20000
    [optimizer]
    optimizer = "muon"
    lr = 0.02
    clip-grad-norm = 1.0
    [data-mix]
    "data/web/*.bin" = 0.7
    "data/code.bin" = 0.3

    asyncpp-train --config runs/exp1.toml --out runs/exp1 --steps 100   # a short try of it

TOML needs Python 3.11's ``tomllib`` (or the ``tomli`` package); JSON reads everywhere.
"""
from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any, Optional

FLAG = "--config"


class ConfigFileError(ValueError):
    """A config file that cannot be read or names no flag; the message names the file and key."""


def _read(path: Path) -> dict:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigFileError(f"{FLAG} {path}: cannot read it ({exc.strerror or exc})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigFileError(f"{FLAG} {path}: not valid JSON ({exc})") from None
    elif path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            try:
                import tomli as tomllib
            except ImportError:
                raise ConfigFileError(f"{FLAG} {path}: reading TOML needs Python 3.11 or `pip install tomli`; or "
                                      "write the file as JSON") from None
        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:  # tomllib.TOMLDecodeError is a ValueError
            raise ConfigFileError(f"{FLAG} {path}: not valid TOML ({exc})") from None
    else:
        raise ConfigFileError(f"{FLAG} {path}: name a .toml or .json file")
    if not isinstance(data, dict):
        raise ConfigFileError(f"{FLAG} {path}: the file must hold a table of flags, not a {type(data).__name__}")
    return data


def _flat(data: dict, path: Path, keyed: set, where: str = "") -> list[tuple[str, Any]]:
    """(key, value) of every setting, tables opened (their names only group), but a table named
    after a repeatable ``KEY=VALUE`` flag (``keyed``): its entries are that flag's values."""
    found = []
    for key, value in data.items():
        if isinstance(value, dict) and key.replace("_", "-") in keyed:
            found.append((key, [f"{k}={_text(v)}" for k, v in value.items()]))
        elif isinstance(value, dict):
            found += _flat(value, path, keyed, f"{where}{key}.")
        else:
            found.append((key, value))
    return found


def _text(value: Any) -> str:
    """A table entry's value as the command line writes it (true/false as JSON does)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _keyed_flags(parser: argparse.ArgumentParser) -> set:
    """Names (no dashes) of the repeatable flags whose values are KEY=VALUE: a table may give them."""
    return {o[2:] for a in parser._actions if isinstance(a, argparse._AppendAction) and "=" in (a.metavar or "")
            for o in a.option_strings if o.startswith("--")}


def _tokens(parser: argparse.ArgumentParser, path: Path, key: str, value: Any) -> list[str]:
    """The command-line tokens of one setting."""
    options = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    flag = "--" + key.replace("_", "-")
    action = options.get(flag)
    if action is None or flag in (FLAG, "--help"):
        close = difflib.get_close_matches(flag, [o for o in options if o not in (FLAG, "--help")], n=1)
        hint = f" (did you mean {close[0][2:]!r}?)" if close else ""
        raise ConfigFileError(f"{FLAG} {path}: {key!r} is not a flag of asyncpp-train{hint}; the keys are its "
                              "long flags without the dashes")
    boolean = isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction))
    if boolean:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{FLAG} {path}: {key} is an on/off flag: give true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if isinstance(value, bool):
        raise ConfigFileError(f"{FLAG} {path}: {key} takes a value, not {value!r}")
    if isinstance(value, list):
        if not isinstance(action, argparse._AppendAction):
            raise ConfigFileError(f"{FLAG} {path}: {key} takes one value, not a list")
        return [token for item in value for token in (flag, _checked(action, path, key, item))]
    return [flag, _checked(action, path, key, value)]


def _checked(action: argparse.Action, path: Path, key: str, value: Any) -> str:
    """``value``'s token, after the flag's own conversion and choices: a value they refuse is
    refused here, naming the file and its key (argparse would name only the flag, which the
    command line may not even hold)."""
    text = str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ConfigFileError(f"{FLAG} {path}: {key} = {value!r}: {exc}") from None
    except (TypeError, ValueError):
        kind = getattr(action.type, "__name__", "valid")
        raise ConfigFileError(f"{FLAG} {path}: {key} = {value!r} is not {'an' if kind[0] in 'aeiou' else 'a'} "
                              f"{kind} value") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigFileError(f"{FLAG} {path}: {key} = {value!r} is not one of "
                              f"{', '.join(map(str, action.choices))}")
    return text


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the flags the file holds, placed first (so the
    command line's win); ConfigFileError for a file that cannot give them."""
    path: Optional[Path] = None
    rest, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == FLAG or token.startswith(FLAG + "="):
            if path is not None:
                raise ConfigFileError(f"{FLAG} is given twice; give one file")
            if token == FLAG:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):  # as argparse reads a flag's value
                    raise ConfigFileError(f"{FLAG} needs a FILE")
                path, i = Path(argv[i + 1]), i + 2
            else:
                path, i = Path(token.split("=", 1)[1]), i + 1
            continue
        rest.append(token)
        i += 1
    if path is None:
        return list(argv)
    tokens = [t for key, value in _flat(_read(path), path, _keyed_flags(parser))
              for t in _tokens(parser, path, key, value)]
    return tokens + rest


__all__ = ["ConfigFileError", "expand_config"]
