"""ErrorFeedback: the EF delay correction around ANY torch.optim.Optimizer."""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from . import _kernels as K
from .errors import NonFiniteGradientError


class ErrorFeedback(torch.optim.Optimizer):
    """Wraps `base` so each step applies W <- W + D + beta*(D - E), E <- D, where D is what
    `base.step()` added to W this step (the first step is the plain update and only records E).

    D is recovered as a snapshot difference, W_after - W_before, in the parameter dtype: it carries
    the rounding of W_after (about one ulp of |W|, not of |D|), so for tiny updates on large weights
    it is less exact than the fused optimizers (asyncpp_ext.optim.Muon/AdamW/MuonHybrid with
    `ef_beta`), which compute D explicitly. The wrapper costs one model-sized snapshot per step plus
    the EF buffer ("ef_buffer" in base.state, so base.state_dict() carries it).

    beta == 0 calls base.step() and nothing else. Gradients are checked for NaN/Inf before the base
    step runs (when no closure is given), raising NonFiniteGradientError with nothing modified.
    param_groups, state and state_dict() are the base optimizer's.
    """

    def __init__(self, base: torch.optim.Optimizer, beta: float):
        if not isinstance(base, torch.optim.Optimizer):
            raise ValueError(f"ErrorFeedback wraps a torch.optim.Optimizer, got {type(base).__name__}")
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be a finite float >= 0 (0 turns error feedback off), got {beta!r}")
        # Deliberately no Optimizer.__init__: this object shares the base's groups and state.
        self.base = base
        self.beta = float(beta)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def state(self):
        return self.base.state

    @property
    def defaults(self):
        return self.base.defaults

    def __repr__(self):
        return f"ErrorFeedback(beta={self.beta}, base={self.base!r})"

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
        if closure is None:
            self._check_finite()
        if self.beta == 0:
            return self.base.step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        loss = self.base.step(closure)
        for p, w0 in zip(params, before):
            if p.grad is None:
                continue  # the base skipped it: no update, no history
            d = p.detach() - w0
            st = self.state[p]
            e = st.get("ef_buffer")
            if e is not None:
                p.add_(d - e, alpha=self.beta)  # p is W + D already
                e.copy_(d)
            else:
                st["ef_buffer"] = d
        return loss
