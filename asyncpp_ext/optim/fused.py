"""The shared engine of the fused optimizers: one `step()` over param groups that are either Muon
groups (2-D matrices) or AdamW groups, all updated by the multi-tensor kernels of asyncpp_ext._C.

Order inside `step_from()` (`step()` is `step_from(None, None)`): (1) collect and validate every
parameter with a gradient, and the weight versions given, (2) scan all gradients for NaN/Inf and
raise `NonFiniteGradientError` naming the parameter -- nothing has been modified yet (skipped when
`check_finite` is False: the caller has checked; or when the caller passes the device-side result
of its own scan as `skip`, which the kernels read: a step the device skips), (3) update the AdamW
groups, (4) update the Muon
groups (momentum kernel -> batched Newton-Schulz -> apply kernel). The final kernel of each reads
W(t) from the source (the parameter itself in place) and writes W(t+1) into the parameter
(versioned.py). Error feedback (ef_beta > 0) is fused into that kernel and uses the explicitly
computed update D (docs/design.md §1.5: W <- W + D + beta*(D - E)), with E from the optimizer's
buffer (ef_source "buffer": E <- D after each step) or from the weights (ef_source "weights":
E = W(t) - W(t-1), the update applied last step, read from the previous version).
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Mapping, NamedTuple

import torch
import torch.distributed as dist

from ..precision import auto_dtype
from . import _kernels as K
from .checks import non_negative, positive, real_number, unit_interval, whole_number
from .errors import NonFiniteGradientError
from .newton_schulz import Workspace, check_eps, orthogonalize
from .normuon import NORMUON_BETA2, check_normuon_args, normuon_updates
from .param_groups import check_listed_once, named_param_groups, param_label
from .sharding import assign_owners, gather_updates
from .versioned import EF_SOURCES, copy_sources

MUON = "muon"
ADAMW = "adamw"
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_COMMON_KEYS = ("params", "param_names", "algorithm", "lr", "weight_decay", "ef_beta", "eps",
                "initial_lr")  # initial_lr: the base lr of lr_schedule.apply_lr and torch's schedulers
GROUP_KEYS = {MUON: _COMMON_KEYS + ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn",
                                    "ns_dtype", "normuon", "normuon_beta2"),
              ADAMW: _COMMON_KEYS + ("betas",)}
"""The keys a param group of each algorithm may hold; add_param_group refuses any other (a
misspelt option would otherwise leave the default in force)."""


def muon_lr_scale(shape, adjust_lr_fn) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def check_common(lr, weight_decay, ef_beta) -> dict:
    """lr, weight_decay and ef_beta as floats, or a ValueError naming the one that cannot run."""
    return dict(lr=real_number(lr, "lr", "a finite float > 0", positive),
                weight_decay=real_number(weight_decay, "weight_decay", "a finite number >= 0", non_negative),
                ef_beta=real_number(ef_beta, "ef_beta", "a finite number >= 0 (0 turns error feedback off)",
                                    non_negative))


def check_muon_args(momentum, ns_steps, adjust_lr_fn, ns_dtype, eps, ns_coefficients) -> dict:
    """A Muon group's numbers as Python floats and ints, or a ValueError naming the one that cannot run."""
    momentum = real_number(momentum, "momentum", "in [0, 1)", unit_interval)
    ns_steps = whole_number(ns_steps, "ns_steps", "an int in [0, 100)", lambda n: 0 <= n < 100)
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    if ns_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"ns_dtype must be torch.float32, torch.bfloat16 or None (auto), got {ns_dtype!r}")
    eps = check_eps(eps)
    coefficients = tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list)) else ()
    try:
        coefficients = tuple(real_number(c, "ns_coefficients") for c in coefficients)
    except ValueError:
        coefficients = ()
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three finite floats (a, b, c), got {ns_coefficients!r}")
    return dict(momentum=momentum, ns_steps=ns_steps, eps=eps, ns_coefficients=coefficients)


def check_ef_source(ef_source) -> str:
    if ef_source not in EF_SOURCES:
        raise ValueError(f"ef_source must be one of {', '.join(map(repr, EF_SOURCES))} (where error feedback "
                         f"takes the previous update from), got {ef_source!r}")
    return ef_source


def check_versions(param_groups, sources, previous, contiguous: bool) -> None:
    """Check step_from's dicts before anything is written (a bad entry found halfway would leave
    some groups stepped): keys are parameters of ``param_groups``, values tensors shaped, typed and
    placed like their parameter (and contiguous where the kernels read them). None values are
    allowed in ``previous`` (no correction)."""
    where = {id(p): (group, gi, pi) for gi, group in enumerate(param_groups)
             for pi, p in enumerate(group["params"])}
    for what, mapping in (("sources", sources), ("previous", previous)):
        if mapping is None:
            continue
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{what} must be a dict parameter -> tensor (or None), got {type(mapping).__name__}")
        for p, t in mapping.items():
            if id(p) not in where:
                raise ValueError(f"{what} holds a key that is not a parameter of this optimizer; key it by "
                                 "the parameter tensors the optimizer holds")
            if t is None and what == "previous":
                continue
            name = param_label(*where[id(p)])
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what} for {name}: expected a tensor, got {type(t).__name__}")
            problem = (f"shape {tuple(t.shape)}" if t.shape != p.shape else f"dtype {t.dtype}" if t.dtype != p.dtype
                       else f"device {t.device}" if t.device != p.device
                       else "a non-contiguous layout" if contiguous and not t.is_contiguous() else None)
            if problem:
                raise ValueError(f"{what} for {name} has {problem}; pass a tensor like the parameter "
                                 f"(shape {tuple(p.shape)}, {p.dtype}, on {p.device}"
                                 f"{', contiguous' if contiguous else ''})")


class FinalArgs(NamedTuple):
    """What the final kernel of a group takes besides the update: EF buffers and first-step flags
    (ef_source "buffer"), where each parameter reads W(t) ([] = in place) and W(t-1) (ef_source
    "weights"; None = no correction)."""
    ef_bufs: list
    ef_first: list
    sources: list
    previous: list


def check_adamw_args(betas, eps) -> dict:
    """An AdamW group's betas and eps as Python floats, or a ValueError naming the one that cannot run."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    betas = tuple(real_number(b, f"betas[{i}]", "in [0, 1)", unit_interval) for i, b in enumerate(betas))
    return dict(betas=betas, eps=check_eps(eps))


def check_group_keys(group, default_algorithm) -> None:
    """ValueError naming the keys of ``group`` that no step of its algorithm reads (the group's
    "algorithm", else ``default_algorithm``; an unknown algorithm is left to the group's check)."""
    algo = group.get("algorithm", default_algorithm)
    unknown = sorted(set(group) - set(GROUP_KEYS.get(algo, group)))
    if unknown:
        raise ValueError(f"unknown param group key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; a group of algorithm {algo!r} takes only: "
                         f"{', '.join(sorted(GROUP_KEYS[algo]))}")


def _no_peer_wait(what: str):
    """The default ``peer_wait``: nothing to watch (a module function: the optimizer pickles)."""
    return contextlib.nullcontext()


class FusedOptimizer(torch.optim.Optimizer):
    """Base of Muon, AdamW and MuonHybrid. Each param group carries "algorithm" ("muon"/"adamw")."""

    def __init__(self, params, defaults, shard_group=None, ef_source: str = "buffer"):
        # Where error feedback takes E from (versioned.EF_SOURCES); "weights" allocates no buffer and
        # needs W(t-1) passed to step_from as `previous`.
        self.ef_source = check_ef_source(ef_source)
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            self._validate_group(gi, group)
        self.shard_group = None
        self.orthogonalized_last_step = 0  # matrices this rank ran Newton-Schulz on in the last step
        self.workspace = Workspace()  # Newton-Schulz buffers reused across steps (not saved)
        # Scan every gradient for NaN/Inf before writing anything. A caller that has just verified
        # the same gradients and keeps a bad step from reaching step() (the pipeline's NaN/Inf
        # guard) turns it off to save a read of all gradients (and a host sync on CUDA).
        self.check_finite = True
        # A context around waits on other ranks (the sharded step's all-gather), given what is
        # awaited: a pipeline's watchdog then reports a stall there as waiting on a peer.
        self.peer_wait = _no_peer_wait
        if shard_group is not None:
            self.shard_across(shard_group)

    def shard_across(self, group) -> None:
        """Split the Muon orthogonalisations among the ranks of ``group`` (a torch.distributed
        process group of data-parallel replicas holding identical gradients; None = unsharded).
        Every rank of the group must call ``step()`` together; the updates equal the unsharded
        ones (see sharding.py). Process groups are not saved in ``state_dict``."""
        if group is not None and not dist.is_initialized():
            raise ValueError("shard_group needs torch.distributed to be initialised (init_process_group) "
                             "before the optimizer is built")
        self.shard_group = group

    def add_param_group(self, param_group):
        # (name, tensor) pairs split here, as torch >= 2.6 would (torch 2.5 takes only tensors);
        # torch's __init__ hands every group to this method.
        (param_group,) = named_param_groups([param_group])
        check_group_keys(param_group, self.defaults.get("algorithm"))
        check_listed_once(self.param_groups, param_group)
        super().add_param_group(param_group)
        if hasattr(self, "_validated"):
            try:
                self._validate_group(len(self.param_groups) - 1, self.param_groups[-1])
            except ValueError:
                self.param_groups.pop()  # a refused group is not kept
                raise

    def __getstate__(self):
        # torch's keeps only defaults, state and param_groups: a copy would lose ef_source, the
        # workspace and the checks' settings, and fail at its first step
        return dict(self.__dict__)

    def load_state_dict(self, state_dict):
        """torch's load, with each group checked as a new one is: a state of another optimizer
        (torch's AdamW, or AdamW's loaded into a Muon) or with a key missing is one ValueError
        naming the group, instead of a KeyError, or another algorithm, at the next step."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        for gi, (mine, saved) in enumerate(zip(self.param_groups, groups or [])):
            if saved.get("algorithm") != mine["algorithm"]:
                found = (f"the algorithm {saved['algorithm']!r}" if "algorithm" in saved
                         else "no 'algorithm' (a state of another optimizer, such as torch.optim's?)")
                raise ValueError(f"param group {gi} of the state has {found} where this {type(self).__name__} "
                                 f"runs {mine['algorithm']!r}; load a state saved by the same optimizer")
        super().load_state_dict(state_dict)
        for gi, group in enumerate(self.param_groups):
            try:
                self._validate_group(gi, group)
            except KeyError as exc:
                raise ValueError(f"param group {gi} of the state has no {exc.args[0]!r}; load a state saved by "
                                 f"{type(self).__name__}.state_dict()") from None

    def _validate_group(self, gi, group):
        self._validated = True
        algo = group.get("algorithm")
        if algo not in (MUON, ADAMW):
            raise ValueError(f"param group {gi}: 'algorithm' must be 'muon' or 'adamw', got {algo!r}")
        # Numbers are stored back as Python floats and ints (a NumPy scalar becomes one).
        group.update(check_common(group["lr"], group["weight_decay"], group["ef_beta"]))
        if algo == MUON:
            group.update(check_muon_args(group["momentum"], group["ns_steps"], group["adjust_lr_fn"],
                                         group["ns_dtype"], group["eps"], group["ns_coefficients"]))
            beta2 = check_normuon_args(group.get("normuon", False), group.get("normuon_beta2", NORMUON_BETA2))
            if "normuon_beta2" in group:
                group["normuon_beta2"] = beta2
            if not isinstance(group["nesterov"], bool):
                raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
        else:
            group.update(check_adamw_args(group["betas"], group["eps"]))
        for pi, p in enumerate(group["params"]):
            self._check_param(group, gi, pi, p)

    def _check_param(self, group, gi, pi, p) -> None:
        """What the kernels need of a parameter; checked when its group is added and again at each
        step before any kernel runs (``p.data`` may have been replaced since)."""
        if p.dtype != torch.float32:
            raise ValueError(f"{self._param_name(group, gi, pi)}: the fused optimizers keep float32 weights, "
                             f"got {p.dtype}; convert the model with .float()")
        if group["algorithm"] == MUON and p.ndim != 2:
            raise ValueError(
                f"{self._param_name(group, gi, pi)}: Muon only updates 2-D matrices, got shape "
                f"{tuple(p.shape)}; put this tensor in an AdamW group (use MuonHybrid / "
                "build_optimizer(name='muon'))")
        if not p.is_contiguous():
            raise ValueError(f"{self._param_name(group, gi, pi)}: the fused kernels need contiguous "
                             "parameters; call .data = p.data.contiguous() on it first")

    _param_name = staticmethod(param_label)

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_from(None, None)
        return loss

    def supports_device_skip(self) -> bool:
        """Whether ``step_from(skip=...)`` can leave a step to the device to skip: every tensor the
        step changes is changed by the fused kernels (not NorMuon's second moment, computed by torch;
        not a sharded step, whose ranks exchange updates)."""
        return self.shard_group is None and not any(g.get("normuon", False) for g in self.param_groups)

    @torch.no_grad()
    def step_from(self, sources: Mapping[torch.Tensor, torch.Tensor] | None = None,
                  previous: Mapping[torch.Tensor, torch.Tensor] | None = None,
                  skip: torch.Tensor | None = None):
        """One step that reads W(t) from ``sources`` and writes W(t+1) into the parameters, with no
        copy (the protocol of versioned.step_versioned). sources: parameter -> W(t); None, or a
        parameter missing from it, = in place. previous: parameter -> W(t-1), read by error feedback
        with ef_source "weights" only (ignored with "buffer"); a parameter missing from it gets the
        plain update this step. Either tensor may be the parameter's own storage (in 2bw the
        destination holds W(t-1)): each element is read before it is written. Bitwise the same as
        copying W(t) into the parameters and stepping in place.

        skip: the one-element int32 tensor ``_kernels.nonfinite_flag`` wrote over the gradients (in
        place only, where ``supports_device_skip()``; no scan of the optimizer's own): the kernels
        change nothing where it holds an index, so the caller launches the step before it knows.
        Returns then a callable that puts back what the step changed on the host (step counts, the
        state a first step creates, EF's first-step flags), for the caller to call once it has read
        the flag and found the step skipped; None without ``skip``."""
        if skip is not None and (sources or not self.supports_device_skip()):
            raise ValueError("skip= needs an in-place step (sources=None) of an optimizer whose every change "
                             "is in the fused kernels (supports_device_skip(): not NorMuon, not sharded)")
        if self.ef_source != "weights":
            previous = None
        check_versions(self.param_groups, sources, previous, contiguous=True)
        work = []  # (group, [(param, grad)])
        for gi, group in enumerate(self.param_groups):
            items = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self._check_param(group, gi, pi, p)  # every check before the first kernel: no half step
                g = p.grad
                if g.is_sparse:
                    raise ValueError(f"{self._param_name(group, gi, pi)}: sparse gradients are not supported")
                if g.dtype != torch.float32:
                    raise ValueError(f"{self._param_name(group, gi, pi)}: gradient dtype {g.dtype}, "
                                     "expected float32 like the parameter")
                items.append((p, g if g.is_contiguous() else g.contiguous(), gi, pi))
            work.append((group, items))
        if self.check_finite and skip is None:
            self._check_finite(work)
        undo = self._restorer(work) if skip is not None else None
        versions = (sources or {}, previous or {})
        self._copy_unstepped(sources)
        for group, items in work:
            if items and group["algorithm"] == ADAMW:
                self._adamw_group(group, items, versions, skip)
        for group, items in work:
            if items and group["algorithm"] == MUON:
                self._muon_group(group, items, versions, skip)
        return undo

    def _restorer(self, work):
        """A callable putting each stepped parameter's state entry back as it is now (a shallow copy:
        the tensors in it are the kernels' to leave alone on a skipped step), or taking away the
        entry a first step creates."""
        saved = [(p, dict(self.state[p]) if p in self.state else None) for _, items in work for p, *_ in items]
        count = getattr(self, "orthogonalized_last_step", None)

        def undo():
            for p, before in saved:
                if before is None:
                    self.state.pop(p, None)
                else:
                    self.state[p] = before
            if count is not None:
                self.orthogonalized_last_step = count
        return undo

    @staticmethod
    def _copy_unstepped(sources):
        """A parameter without a gradient is not stepped, yet its destination must hold
        W(t+1) = W(t): copy it there (check_versions has made sure every key is a parameter)."""
        copy_sources({p: src for p, src in (sources or {}).items() if p.grad is None})

    def _check_finite(self, work):
        by_device = defaultdict(list)
        for group, items in work:
            for p, g, gi, pi in items:
                by_device[g.device].append((g, group, gi, pi))
        for entries in by_device.values():
            bad = K.first_nonfinite([e[0] for e in entries])
            if bad >= 0:
                _, group, gi, pi = entries[bad]
                raise NonFiniteGradientError(
                    f"{self._param_name(group, gi, pi)} has a NaN/Inf gradient; no weight or optimizer "
                    "state was changed. Skip this step (zero_grad) or lower the learning rate / clip gradients")

    def _final_args(self, group, params, versions) -> FinalArgs:
        sources, previous = versions
        srcs = [sources.get(p, p) for p in params] if sources else []
        if group["ef_beta"] == 0:
            return FinalArgs([], [], srcs, [])
        if self.ef_source == "weights":
            return FinalArgs([], [], srcs, [previous.get(p) for p in params])
        bufs, first = self._ef(group, params)
        return FinalArgs(bufs, first, srcs, [])

    def _ef(self, group, params):
        """EF buffers and first-step flags for `params` (ef_source "buffer", ef_beta > 0)."""
        bufs, first = [], []
        for p in params:
            st = self.state[p]
            if "ef_buffer" not in st:
                st["ef_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                st["ef_initialized"] = False
            bufs.append(st["ef_buffer"])
            first.append(not st["ef_initialized"])
        return bufs, first

    @staticmethod
    def _ef_mark(state, params, ef_bufs):
        for p in params if ef_bufs else ():
            state[p]["ef_initialized"] = True

    def _adamw_group(self, group, items, versions, skip=None):
        params = [it[0] for it in items]
        grads = [it[1] for it in items]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if "exp_avg" not in st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(int(st["step"]) + 1)
        final = self._final_args(group, params, versions)
        beta1, beta2 = group["betas"]
        K.adamw_step(params, grads, exp_avgs, exp_avg_sqs, final.ef_bufs, steps, final.ef_first, lr=group["lr"],
                     beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                     ef_beta=group["ef_beta"], sources=final.sources, previous=final.previous, skip=skip)
        for p, s in zip(params, steps):
            self.state[p]["step"] = s
        self._ef_mark(self.state, params, final.ef_bufs)

    def _muon_group(self, group, items, versions, skip=None):
        # Same-shape matrices side by side: each shape's batch is one contiguous run of the lists
        # (and of sumsq, read below as a slice: no index tensor, no host round trip on CUDA).
        first_seen = {}
        for it in items:
            first_seen.setdefault(tuple(it[0].shape), len(first_seen))
        items = sorted(items, key=lambda it: first_seen[tuple(it[0].shape)])  # stable
        params = [it[0] for it in items]
        grads = [it[1] for it in items]
        device = params[0].device
        ns_dtype = group["ns_dtype"] or auto_dtype(device)
        storage = torch.bfloat16 if ns_dtype == torch.bfloat16 else torch.float32
        bufs = []
        for p in params:
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                st["step"] = 0
            bufs.append(st["momentum_buffer"])
        # Same-shape matrices share one (B, rows, cols) buffer so Newton-Schulz runs as one bmm chain.
        batches = defaultdict(list)
        for i, p in enumerate(params):
            batches[tuple(p.shape)].append(i)
        outs = [None] * len(params)
        batch_tensors = {}
        for shape, idx in batches.items():
            v = self.workspace.get("momentum", (len(idx),) + shape, storage, device)
            batch_tensors[shape] = v
            for k, i in enumerate(idx):
                outs[i] = v[k]
        sumsq = torch.empty(len(params), dtype=torch.float32, device=device)
        K.muon_momentum(grads, bufs, outs, momentum=group["momentum"], nesterov=group["nesterov"],
                        sumsq=sumsq, skip=skip)
        owners, me = None, 0
        if self.shard_group is not None and dist.get_world_size(self.shard_group) > 1:
            owners = assign_owners([p.shape for p in params], dist.get_world_size(self.shard_group))
            me = dist.get_rank(self.shard_group)
        updates = [None] * len(params)
        for shape, idx in batches.items():
            chosen = [k for k, i in enumerate(idx) if owners is None or owners[i] == me]
            if not chosen:
                continue
            norms = sumsq[idx[0]:idx[-1] + 1].sqrt()
            if len(chosen) == len(idx):
                v = batch_tensors[shape]
            else:  # sharded: this rank's share of the batch
                pick = torch.tensor(chosen, device=device)
                v, norms = batch_tensors[shape][pick], norms[pick]
            o = orthogonalize(v, norms, steps=group["ns_steps"],
                              coefficients=tuple(group["ns_coefficients"]), eps=group["eps"],
                              ns_dtype=ns_dtype, workspace=self.workspace, overwrite_input=True)
            for j, k in enumerate(chosen):
                updates[idx[k]] = o[j]
        self.orthogonalized_last_step = sum(u is not None for u in updates)
        if owners is not None:
            mine = {i: u for i, u in enumerate(updates) if u is not None}
            with self.peer_wait("waiting for the sharded optimizer's all-gather of updates with the data-parallel replicas"):
                updates = gather_updates(mine, [p.shape for p in params], owners, self.shard_group,
                                         storage, device)
        if group.get("normuon", False):
            # After the gather: every rank normalises every matrix, so "normuon_v" stays replicated.
            updates = normuon_updates(updates, [self.state[p] for p in params],
                                      group.get("normuon_beta2", NORMUON_BETA2))
        lr = group["lr"]
        scales = [-(lr * muon_lr_scale(p.shape, group["adjust_lr_fn"])) for p in params]
        final = self._final_args(group, params, versions)
        K.apply_update(params, updates, final.ef_bufs, scales, final.ef_first, lr=lr,
                       weight_decay=group["weight_decay"], ef_beta=group["ef_beta"],
                       sources=final.sources, previous=final.previous, skip=skip)
        for p in params:
            self.state[p]["step"] = int(self.state[p]["step"]) + 1
        self._ef_mark(self.state, params, final.ef_bufs)
