"""Optimizers taken from the `pytorch-optimizer` package (Lion, Adan, SOAP, MARS), behind one
constructor with the arguments every optimizer of asyncpp_ext takes (lr, weight_decay).

The package is the optional extra ``study`` (``pip install 'asyncpp_ext[study]'``) and is imported
only when one of these optimizers is built or checked, so the core never needs it. The optimizers
run unchanged; `build_optimizer` (factory.py) wraps them in `ErrorFeedback` for ef_beta > 0.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect

import torch

from .decay import split_by_decay
from .param_groups import named_param_groups
from .registry import library_classes

PACKAGE = "pytorch-optimizer"
"""The distribution name (its import name is ``pytorch_optimizer``)."""
MODULE = "pytorch_optimizer"
INSTALL_HINT = "pip install 'asyncpp_ext[study]'"

LIBRARY_OPTIMIZERS = library_classes()
"""Optimizer name (as build_optimizer and the CLI spell it) -> class name in pytorch_optimizer: the
registry's family "library" (registry.py, where a new one goes)."""


class MissingExtraError(ValueError):
    """A library optimizer was asked for but the optional package that provides it is missing."""


class LibraryOptimizerError(ValueError):
    """A library optimizer name or keyword argument that cannot be used."""


def _fair_overrides(name: str, lr: float, weight_decay: float) -> dict:
    """The constructor arguments build_library_optimizer sets itself (see its docstring for why)."""
    overrides = dict(lr=lr, weight_decay=weight_decay)
    if name == "mars":
        overrides.update(lr_1d=lr, weight_decay_1d=weight_decay)
    return overrides


def _library_class(name: str) -> type:
    """The pytorch_optimizer class of `name`; MissingExtraError when the package (or, in a version
    older than the extra asks for, the class) is missing."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        raise MissingExtraError(f"optimizer '{name}' needs the package {PACKAGE}, which is not installed; "
                                f"install it with: {INSTALL_HINT}") from None
    cls = getattr(module, LIBRARY_OPTIMIZERS[name], None)
    if cls is None:
        try:
            version = importlib.metadata.version(PACKAGE)
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        raise MissingExtraError(f"optimizer '{name}' needs {PACKAGE}>=3.5, but the installed {PACKAGE} "
                                f"{version} has no {LIBRARY_OPTIMIZERS[name]}; upgrade it with: {INSTALL_HINT}")
    return cls


def check_available(name: str) -> None:
    """Raise MissingExtraError if `name` is a library optimizer whose package is not installed;
    nothing for any other name (the fused optimizers need no extra)."""
    if name in LIBRARY_OPTIMIZERS:
        _library_class(name)


def build_library_optimizer(named_params, name: str, lr: float, weight_decay: float, undecayed=(),
                            **kwargs) -> torch.optim.Optimizer:
    """The pytorch_optimizer optimizer `name` (a key of LIBRARY_OPTIMIZERS) over `named_params`.

    named_params: (name, tensor) pairs, kept as pairs so the param group carries "param_names".
    All parameters go in one group, but those `undecayed` names, which go in a second with every
    weight-decay setting 0 (decay.py). kwargs (e.g. betas=...) go to the class and win over
    everything below; a keyword the class does not take raises LibraryOptimizerError (the classes
    would otherwise store it silently, and their group-level extras such as cautious= are
    therefore not reachable from here).

    Defaults are the library's, except what a fair comparison with the other optimizers needs:
    - every optimizer takes the caller's `lr` and `weight_decay` (the library's own differ per
      class; SOAP, for one, decays by 0.01 unless told otherwise);
    - MARS updates 1-D tensors (norm gains, biases) with an AdamW of its own at `lr_1d` (default
      3e-3 whatever lr is) and `weight_decay_1d` (default 0.1 whatever weight_decay is). Every
      other optimizer moves all its tensors with the one learning rate under study (and its
      schedule) and decays them at the run's weight_decay, so both are set to `lr` and
      `weight_decay` (at MARS's default lr, 3e-3, its 1-D learning rate is unchanged).
    Kept as the library has them: Lion betas (0.9, 0.99) and decoupled decay; Adan betas
    (0.98, 0.92, 0.99) and its proximal decay W / (1 + lr*wd); SOAP betas (0.95, 0.95), eigenbasis
    refreshed every 10 steps, no update on its first step (it only builds its preconditioner);
    MARS gamma 0.025, betas (0.95, 0.99), 1-D betas (0.9, 0.95).
    """
    if name not in LIBRARY_OPTIMIZERS:
        raise LibraryOptimizerError(f"library optimizer must be one of {tuple(LIBRARY_OPTIMIZERS)}, got {name!r}")
    cls = _library_class(name)
    accepted = {p.name for p in inspect.signature(cls.__init__).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self", "params"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise LibraryOptimizerError(f"{cls.__name__} ({name}) takes no argument(s) {unknown}; "
                                    f"it takes {sorted(accepted)}")
    named = list(named_params)
    if not named:
        raise LibraryOptimizerError(f"{name}: no parameters to optimize")
    args = _fair_overrides(name, lr, weight_decay)
    args.update(kwargs)
    decay = {key: value for key, value in args.items() if key.startswith("weight_decay")}
    return cls(named_param_groups(split_by_decay(dict(params=named, **decay), set(undecayed))), **args)


__all__ = ["LIBRARY_OPTIMIZERS", "INSTALL_HINT", "MissingExtraError", "LibraryOptimizerError", "check_available",
           "build_library_optimizer"]
