"""ErrorFeedback: the EF delay correction around ANY torch.optim.Optimizer."""
from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import torch

from . import _kernels as K
from .checks import non_negative, real_number
from .errors import NonFiniteGradientError
from .fused import check_ef_source, check_versions
from .versioned import copy_sources


class ErrorFeedback(torch.optim.Optimizer):
    """Wraps `base` so each step applies W <- W + D + beta*(D - E), where D is what `base.step()`
    added to W this step. `ef_source` says where E, the previous update, comes from: "buffer"
    (default) keeps E <- D in a buffer (the first step is the plain update and only records E);
    "weights" takes E = W(t) - W(t-1) from the previous version given to `step_from` (a parameter
    without one gets the plain update) and keeps no buffer.

    D is recovered as a snapshot difference, W_after - W_before, in the parameter dtype: it carries
    the rounding of W_after (about one ulp of |W|, not of |D|), so for tiny updates on large weights
    it is less exact than the fused optimizers (asyncpp_ext.optim.Muon/AdamW/MuonHybrid with
    `ef_beta`), which compute D explicitly.

    Memory beyond the base optimizer: with "buffer", the EF buffer ("ef_buffer" in base.state, so
    base.state_dict() carries it), plus, for an in-place step, a model-sized snapshot of W(t) during
    the step (a step given `sources` reads W(t) there instead). With "weights", no buffer; during a
    step that is given `previous`, a temporary holding E for each parameter in it (computed before
    anything is written, since in 2bw W(t-1) is the destination's storage), plus, when in place,
    the snapshot of those parameters; without `previous` the step is the base's alone.

    beta == 0 calls base.step() and nothing else. Gradients are checked for NaN/Inf before the base
    step runs (when no closure is given), raising NonFiniteGradientError with nothing modified,
    unless ``check_finite`` is set False (a caller that scans them itself; the base's own check
    follows the setting).
    param_groups, state and state_dict() are the base optimizer's.
    """

    def __init__(self, base: torch.optim.Optimizer, beta: float, ef_source: str = "buffer"):
        if not isinstance(base, torch.optim.Optimizer):
            raise ValueError(f"ErrorFeedback wraps a torch.optim.Optimizer, got {type(base).__name__}")
        beta = real_number(beta, "beta", "a finite float >= 0 (0 turns error feedback off)", non_negative)
        # Deliberately no Optimizer.__init__: this object shares the base's groups and state.
        self.base = base
        self.beta = float(beta)
        self.ef_source = check_ef_source(ef_source)
        self._check_finite_on = True
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    # torch's Optimizer pickles only defaults, state and param_groups, which here are the base's
    # (properties over self.base): the wrapper's own attributes, the base first, are its state.
    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def check_finite(self) -> bool:
        """Whether a step first scans every gradient for NaN/Inf (one scan and host sync per
        parameter here); False where the caller has scanned them already."""
        return self._check_finite_on

    @check_finite.setter
    def check_finite(self, value: bool) -> None:
        self._check_finite_on = bool(value)
        if hasattr(self.base, "check_finite"):  # the fused base scans them again otherwise
            self.base.check_finite = bool(value)

    @property
    def state(self):
        return self.base.state

    @property
    def defaults(self):
        return self.base.defaults

    def __repr__(self):
        return f"ErrorFeedback(beta={self.beta}, ef_source={self.ef_source!r}, base={self.base!r})"

    def zero_grad(self, set_to_none: bool = True):
        self.base.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state_dict):
        self.base.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self.base.add_param_group(param_group)

    def _check_finite(self):
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None or g.is_sparse:
                    continue
                finite = (K.first_nonfinite([g.contiguous()]) < 0 if g.dtype == torch.float32
                          else bool(torch.isfinite(g).all()))
                if not finite:
                    who = f"parameter '{names[pi]}'" if names else f"parameter {pi} of param group {gi}"
                    raise NonFiniteGradientError(f"{who} has a NaN/Inf gradient; no weight or optimizer "
                                                 "state was changed")

    @torch.no_grad()
    def step(self, closure=None):
        return self._step(None, None, closure)

    @torch.no_grad()
    def step_from(self, sources: Mapping[torch.Tensor, torch.Tensor] | None = None,
                  previous: Mapping[torch.Tensor, torch.Tensor] | None = None):
        """The versioned step (versioned.py): W(t) from ``sources`` (parameter -> tensor; None or
        a missing parameter = in place), W(t+1) into the parameters. ``previous`` (parameter ->
        W(t-1)) is read with ef_source "weights" only. A base optimizer with its own ``step_from``
        steps out of place; any other gets W(t) copied into the parameter and steps in place. The
        result is bitwise that of copying W(t) in and calling ``step()``."""
        return self._step(sources, previous, None)

    def _step(self, sources, previous, closure):
        weights = self.ef_source == "weights"
        if not weights or self.beta == 0:
            previous = None
        check_versions(self.param_groups, sources, previous, contiguous=False)
        if closure is None and self._check_finite_on:
            self._check_finite()
        sources = sources or {}
        if self.beta == 0:
            return self._base_step(sources, closure)
        params = [p for g in self.param_groups for p in g["params"]]
        # E from the weights first: in 2bw, W(t-1) is the very storage W(t) is about to be copied to.
        applied = {}
        for p, prev in (previous or {}).items():
            if prev is not None and p.grad is not None:
                applied[p] = sources.get(p, p) - prev
        # D is needed where a correction follows (with "buffer" everywhere: the closure may only
        # now produce gradients), taken against W(t): the source when it has storage of its own,
        # else a snapshot.
        corrected = [p for p in params if p in applied] if weights else params
        before = {}
        for p in corrected:
            src = sources.get(p)
            before[p] = src if src is not None and src.data_ptr() != p.data_ptr() else p.detach().clone()
        loss = self._base_step(sources, closure)
        for p in corrected:
            if p.grad is None:
                continue  # the base skipped it: no update, no history
            d = p.detach() - before[p]
            if weights:
                p.add_(d - applied[p], alpha=self.beta)  # p is W + D already
                continue
            st = self.state[p]
            e = st.get("ef_buffer")
            if e is not None:
                p.add_(d - e, alpha=self.beta)
                e.copy_(d)
            else:
                st["ef_buffer"] = d
        return loss

    def _base_step(self, sources, closure):
        """The base optimizer's step from W(t) in ``sources`` into the parameters."""
        step_from = getattr(self.base, "step_from", None)
        if step_from is not None and closure is None:
            return step_from(sources or None, None)
        copy_sources(sources)
        return self.base.step(closure)
