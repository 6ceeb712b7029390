"""The optimizer registry: every optimizer the package builds, with its defaults, in one table.

``OPTIMIZERS`` maps each name (as ``build_optimizer`` and ``--optimizer`` spell it) to an
``OptimizerSpec``. Everything that needs a name list or a default reads it from here:
``build_optimizer`` (factory.py), ``MuonHybrid``'s defaults, the library mapping (library.py), the
run configuration (``OptimConfig``: ``LR_AUTO``, ``EF_BETA_AUTO``, ``MUON_ADAMW_LR_AUTO``,
``MUON_FAMILY``, ``OPTIMIZERS`` in training/config.py are derived from this table) and the
command line's help. So a Python caller and a command-line run get the same training
(tests/test_optimizer_registry.py compares every param group's hyper-parameters).

This module imports neither torch nor any optimizer: it is data, cheap to import for --help and docs.
Adding an optimizer: docs/design.md, "Where a new optimizer goes".
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional

FAMILIES = ("adamw", "muon", "sgd", "library")
"""How build_optimizer builds a family: "adamw" the fused AdamW; "muon" MuonHybrid (Muon or
NorMuon matrices, an AdamW part for everything else); "sgd" torch.optim.SGD; "library" a
pytorch-optimizer class (library.py), all parameters in one group."""

DEFAULT_WEIGHT_DECAY = 0.0
"""Weight decay of every optimizer when none is given (``OptimConfig.weight_decay``, build_optimizer)."""
DEFAULT_EF_SOURCE = "buffer"
"""Where error feedback takes its previous update when not told (optim/versioned.py: EF_SOURCES)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: its name, how it is built, and the defaults a run gets when it leaves a value out."""

    name: str
    family: str
    """One of FAMILIES."""
    lr: float
    """Learning rate when none is given (of the Muon matrices for the muon family)."""
    ef_beta: float
    """Error-feedback strength when none is given; 0 = off."""
    summary: str
    """One line for --help and the docs."""
    adamw_lr: Optional[float] = None
    """Muon family only: learning rate of the AdamW part (embeddings, head, norms, biases)."""
    momentum: Optional[float] = None
    """Momentum when none is given: of the Muon matrices (muon family), of SGD (sgd); None where
    the optimizer takes no momentum argument."""
    extra: Optional[str] = None
    """The optional extra (``pip install 'asyncpp_ext[EXTRA]'``) the optimizer needs; None = none."""
    library_class: Optional[str] = None
    """family "library": the class name in pytorch_optimizer."""
    build_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Fixed keyword arguments of the family's constructor that make this optimizer (normuon:
    ``normuon=True`` for MuonHybrid); read-only."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"optimizer {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        if (self.family == "library") != (self.library_class is not None):
            raise ValueError(f"optimizer {self.name!r}: library_class is set exactly for family 'library'")
        if (self.family == "muon") != (self.adamw_lr is not None):
            raise ValueError(f"optimizer {self.name!r}: adamw_lr is set exactly for family 'muon'")
        object.__setattr__(self, "build_kwargs", MappingProxyType(dict(self.build_kwargs)))


MUON_LR = 0.02
MUON_ADAMW_LR = 3e-3
"""The AdamW part of the muon family (embeddings, head, norms, biases) when ``adamw_lr`` is not given.
3e-3 is the value the command line was tuned with (muon 0.02 with its AdamW part at 3e-3: the
evidence at OPTIMIZERS below). Until the registry, ``build_optimizer`` and ``MuonHybrid`` used 3e-4
instead, so a Python caller trained differently from a command-line run; 3e-3 is now the one
default. (docs/results.md's delay study: the AdamW part at 3e-4 was 0.31 worse in sync loss than at
1e-3 with Muon at 0.04.)"""
MUON_MOMENTUM = 0.95
"""Momentum of the Muon matrices (torch.optim.Muon's default)."""
EF_BETA = 0.5

OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw", "adamw", lr=1e-3, ef_beta=EF_BETA,
                  summary="fused AdamW (betas 0.9, 0.999)"),
    OptimizerSpec("muon", "muon", lr=MUON_LR, ef_beta=EF_BETA, adamw_lr=MUON_ADAMW_LR, momentum=MUON_MOMENTUM,
                  summary="Muon for hidden matrices, AdamW for embeddings, head, norms and biases"),
    OptimizerSpec("normuon", "muon", lr=MUON_LR, ef_beta=EF_BETA, adamw_lr=MUON_ADAMW_LR, momentum=MUON_MOMENTUM,
                  build_kwargs={"normuon": True},
                  summary="muon with NorMuon's per-row normalisation of the Muon update"),
    OptimizerSpec("sgd", "sgd", lr=0.02, ef_beta=0.0, momentum=0.9,
                  summary="torch.optim.SGD with momentum (error feedback off unless asked for)"),
    OptimizerSpec("lion", "library", lr=3e-4, ef_beta=EF_BETA, extra="study", library_class="Lion",
                  summary="Lion (pytorch-optimizer): sign updates"),
    OptimizerSpec("adan", "library", lr=1e-3, ef_beta=EF_BETA, extra="study", library_class="Adan",
                  summary="Adan (pytorch-optimizer): Nesterov-style adaptive momentum"),
    OptimizerSpec("soap", "library", lr=3e-3, ef_beta=EF_BETA, extra="study", library_class="SOAP",
                  summary="SOAP (pytorch-optimizer): Adam in Shampoo's eigenbasis"),
    OptimizerSpec("mars", "library", lr=1e-3, ef_beta=EF_BETA, extra="study", library_class="MARS",
                  summary="MARS (pytorch-optimizer): variance-reduced adaptive updates"),
)}
"""Every optimizer, in display order (--help, docs). The defaults and the evidence for them:

Learning rates (``lr``). On the tiny preset, 2bw, 2 stages, 200 steps of tinyshakespeare: muon 0.02
(with its AdamW part at 3e-3) reached eval loss 2.48 where the former one-size default 1e-3 reached
3.46; the delay study (docs/results.md) tuned adamw 1e-3 and muon 0.02-0.04 on the small preset.
adamw 1e-3: AdamW without warmup stalls near the byte-unigram loss at 3e-3 on the small preset.
sgd (momentum 0.9): 0.02 reached 2.97 where 0.05 reached 3.18 and 0.2 diverged (tiny preset, 2bw
simulated, 200 steps).
The study's other optimizers, each at the best of 3-4 rates, every best one inside its range (small
preset, sync, builtin data, no EF, 200 steps, one seed; eval loss; adamw 1e-3 gave 2.39 and muon
0.02 1.98 there): normuon 0.02 (1.95; 0.01 2.00, 0.04 2.01; AdamW part at 3e-3 as for muon);
lion 3e-4 (2.53; 1e-4 2.89, 1e-3 2.87: sign updates move every weight by lr, hence ~1/3 of
AdamW's); adan 1e-3 (2.51; 3e-4 2.67, 3e-3 2.94); soap 3e-3 (2.16; 1e-3 2.69, 1e-2 2.39);
mars 1e-3 (2.38; 3e-4 2.56, 3e-3 2.61).

Error-feedback strength (``ef_beta``). Muon's 0.5 comes from the beta sweep
(docs/paper_reproduction.md, ``ef`` table and the 200-step sweep): 0.5 won back 37-53 % of the 2bw
gap on average and part of it in every seed of every table; 1.0 as much on average (40-44 %) with
four times the spread (one seed lost 62 %); 1.5 63 % at 200 steps but 2.0 33 %. AdamW: 0.5 lowered
the 2bw loss in every seed of the delay study (docs/results.md). NorMuon and the library optimizers
(lion, adan, soap, mars) use the same 0.5 so the ``optimizers`` table compares like with like; at
60 steps its effect on them is within the seeds' spread. sgd (EF via the snapshot wrapper) was not
studied, so it stays off unless asked.

The AdamW part of the muon family (``adamw_lr``): MUON_ADAMW_LR above. Momentum: MUON_MOMENTUM for
the muon family, 0.9 for sgd (torch's SGD has none by default).
"""


class UnknownOptimizerError(ValueError):
    """A name that is not in OPTIMIZERS."""


def optimizer_names() -> tuple[str, ...]:
    """Every optimizer's name, in display order."""
    return tuple(OPTIMIZERS)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of `name`; UnknownOptimizerError (a ValueError) naming the valid names otherwise."""
    try:
        return OPTIMIZERS[name]
    except (KeyError, TypeError):
        raise UnknownOptimizerError(f"optimizer name must be one of {optimizer_names()}, got {name!r}") from None


def family_names(family: str) -> tuple[str, ...]:
    """The names of `family`'s optimizers, in display order."""
    return tuple(n for n, s in OPTIMIZERS.items() if s.family == family)


def muon_family() -> tuple[str, ...]:
    """The optimizers built as MuonHybrid: those with Muon's momentum, Newton-Schulz dtype and an AdamW part."""
    return family_names("muon")


def library_classes() -> dict[str, str]:
    """Library optimizer name -> its class name in pytorch_optimizer."""
    return {n: s.library_class for n, s in OPTIMIZERS.items() if s.family == "library"}


class DefaultsView(Mapping):
    """A read-only, live view name -> one default of each optimizer (``DefaultsView("lr")``): it
    reads OPTIMIZERS on every access, so it never goes stale, and it cannot be written (change the
    registry entry instead)."""

    def __init__(self, attribute: str):
        self.attribute = attribute

    def __getitem__(self, name: str):
        if name not in OPTIMIZERS:
            raise KeyError(name)
        return getattr(OPTIMIZERS[name], self.attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(OPTIMIZERS))

    def __len__(self) -> int:
        return len(OPTIMIZERS)

    def __repr__(self) -> str:
        return f"DefaultsView({self.attribute!r}, {dict(self)!r})"


__all__ = ["OptimizerSpec", "OPTIMIZERS", "FAMILIES", "DEFAULT_WEIGHT_DECAY", "DEFAULT_EF_SOURCE", "MUON_ADAMW_LR",
           "MUON_MOMENTUM", "UnknownOptimizerError", "optimizer_names", "optimizer_spec", "family_names",
           "muon_family", "library_classes", "DefaultsView"]
