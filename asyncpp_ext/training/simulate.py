"""Single-process reference of the update semantics (docs/design.md §1, §1.10).

Every parameter p has a delay d_p (steps it computes behind the newest weights):

* sync (also "gpipe", "1f1b"): d_p = 0            W(t+1) = W(t) - lr * U(grad f_t(W(t)))
* 2bw:                         d_p = 1            W(t+1) = W(t) - lr * U(grad f_t(W(t-1)))
* 2bw with ``delay=K``:        d_p = K (research knob: a constant K-step delay, simulator only)
* pipedream (weight stashing): d_p = S - 1 - s for the parameters of stage s of S, so the stages
  of one forward compute on different versions; one microbatch per step.

Step t computes parameter p's gradient (forward and backward) on W_p(max(t - d_p, 0)), i.e.
versions before 0 are W(0), and the optimizer applies it to the newest weights W(t).

One step consumes a minibatch of m microbatches. For each microbatch i = 0..m-1, in that order,
forward on the versions the schedule prescribes, then backward of ``loss_i / m`` accumulating into
``.grad``; the step's loss is ``(loss_0 + ... + loss_{m-1}) / m``. The optimizer then steps the
newest weights W(t) with those gradients. A multi-process pipeline run with the same data and the
same accumulation order must reproduce these numbers to floating-point tolerance.

Tied weights (docs/design.md §1.13): every use of a tied tensor accumulates its own gradient
and the owner's becomes ``owner + mirrors`` before the step, as on a pipeline. Under pipedream a
tie whose uses sit on stages with different delays has no consistent version and is refused.
Learning-rate schedule and clipping by the previous step's norm (§1.14) are applied at the step.

Staleness mitigations (``mitigation``; definitions in optim/mitigations.py): "predict" runs a
delayed parameter's forward and backward on W(t-d) + d * (W(t-d) - W(t-d-1)) (one more kept
version), "dc" adds lambda * g * g * (W(t) - W(t-d)) to the gradient after the tied sum and
clipping, "lr-rescale" multiplies the lr by (1 + d) ** -max(0, 1 - t/K) on top of the lr schedule
(one delay for all parameters: refused under pipedream, whose stages differ). "ef" and "none"
leave the engine alone; error feedback lives in the optimizer. An optimizer running EF with
ef_source "weights" gets W(t-1) as ``previous`` (optim/versioned.py) for every delayed parameter.

Non-finite values (``on_nonfinite``): "stop" raises NonFiniteError when a microbatch loss or a
gradient holds NaN/Inf, before the optimizer runs; "skip" skips that step's update (the next
version is a copy of W(t)) -- the rule a pipeline applies on every stage (see
pipeline/nonfinite.py; the one difference: a pipeline stops where a gradient turns non-finite on
an early stage only, as its later stages have applied the step by then).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..models.base import row_losses
from ..optim.lr_schedule import apply_lr, check_lr_schedule
from ..optim.mitigations import (DEFAULT_DC_LAMBDA, MitigationError, delay_compensate_, predicted_weights,
                                 resolve_mitigation)
from ..optim.state import load_optimizer_state_by_name, optimizer_state_by_name, regroup_optimizer_state
from ..optim.versioned import step_versioned, wants_previous_weights
from ..pipeline.clipping import PreviousNormClipper, block_norms, block_of, keep_norm
from ..pipeline.compute_copies import ComputeCopies
from ..pipeline.devices import to_device
from ..pipeline.nonfinite import POLICIES, DeferredScan, NonFiniteError, first_nonfinite_index
from ..pipeline.partition import as_blocks, split
from ..pipeline.ties import TieError, block_prefixes, check_ties_on_one_stage, find_ties, sum_tied_gradients, untie
from ..schedule.table import SCHEDULES
from .delays import (DelaySimulatorError, check_delay_arguments, check_versions_fit, only_some_delayed,  # noqa: F401
                     per_stage_delays, stage_delay)  # DelaySimulatorError, stage_delay: public names kept here
from .trainer import StepOutcome

SIMULATED_SCHEDULES = tuple(SCHEDULES)
"""Every schedule the simulator runs: all rows of the schedule table (schedule/table.py)."""


def _train_mode(module: nn.Module) -> nn.Module:
    """``module`` in training mode: ``train()`` walks every submodule (hundreds in a deep model:
    about a millisecond of host time a GPU would wait for), so only when the module itself is not
    in it (the simulator puts every submodule in training mode once, and eval_loss puts the mode
    back; a submodule switched to eval mode alone by the caller stays so)."""
    return module if module.training else module.train()


def model_logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The logits of a model whose forward returns logits (or (logits, _))."""
    out = model(inputs)
    return out[0] if isinstance(out, tuple) else out


def default_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``model.loss(logits, targets)`` of a model whose forward returns logits (or (logits, _))."""
    return model.loss(model_logits(model, inputs), targets)


def default_row_losses(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed cross entropy through a model's ``blocks()`` (models/base.row_losses)."""
    return row_losses(model.blocks(), inputs, targets)


class DelaySimulator:
    """Step engine running a schedule's update rule (sync, 2bw, pipedream, K-step delay) in one
    process.

    Each parameter p with delay d_p >= 1 keeps a ring of its d_p previous versions, newest first:
    ``[W(t-1), ..., W(t-d_p)]`` (all W(0) at the start), plus W(t-d_p-1) when weight prediction
    reads it, or when error feedback from the weights needs W(t-1) after the ring has moved on
    (d_p = 1). During a step W(t-d_p) (or, for "predict", the version extrapolated from it) is
    swapped into the parameter (``p.data``) for the forward/backward passes and swapped back before
    the optimizer step; then the oldest slot is overwritten with W(t) and becomes the newest. So
    parameter identity (and the optimizer's per-parameter state) never changes, and a parameter
    with delay 0 (sync, the last pipedream stage) keeps no copy.

    ``stages``/``split_points`` place the model's blocks on pipedream stages exactly as a Pipeline
    does (``pipeline.partition.split``); the other schedules' delays do not depend on the split,
    so there they are ignored. ``delay`` (2bw only) is the constant K-step delay; 1 is plain 2bw.
    ``mitigation`` ("none", "ef", "predict", "dc", "lr-rescale"; None = "none"), ``dc_lambda`` and
    ``rescale_steps`` (K, required for "lr-rescale") select a staleness mitigation
    (optim/mitigations.py). ``compute_copies`` makes the 16-bit compute copies the training
    microbatches run on (pipeline/compute_copies.py; called with the untied model, may return
    None): refreshed at each step's start (after the delayed versions are swapped in), their
    gradients added into the parameters' after each microbatch's backward. ``device_skip`` (default
    True) lets a step queue its optimizer before the host reads the gradients' scan where that
    applies (``step``); False always reads the scan first (the same numbers).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: str,
                 loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
                 on_nonfinite: str = "stop", lr_schedule=None, clip_grad_norm: float | None = None,
                 stages: int | None = None, split_points: Sequence[int] | None = None,
                 delay: int | None = None, mitigation: str | None = None, dc_lambda: float = DEFAULT_DC_LAMBDA,
                 rescale_steps: int | None = None, delay_only: str | None = None,
                 compute_copies: Callable[[nn.Module], Optional[ComputeCopies]] | None = None,
                 device_skip: bool = True,
                 row_loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = default_row_losses,
                 block_grad_norms: bool = False):
        if schedule not in SCHEDULES:
            raise DelaySimulatorError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DelaySimulatorError(f"optimizer must be a torch.optim.Optimizer over the model's parameters, "
                                      f"got {type(optimizer).__name__}")
        try:
            check_lr_schedule(lr_schedule)
        except TypeError as exc:
            raise DelaySimulatorError(str(exc)) from None
        per_stage = SCHEDULES[schedule].lag_per_stage
        if on_nonfinite not in POLICIES:
            raise DelaySimulatorError(f"on_nonfinite={on_nonfinite!r} is not one of {', '.join(POLICIES)}")
        check_delay_arguments(schedule, stages, delay)
        try:
            self.mitigation = resolve_mitigation(mitigation, dc_lambda, rescale_steps)
        except MitigationError as exc:
            raise DelaySimulatorError(str(exc)) from None
        if self.mitigation.rescales_lr and per_stage:
            raise DelaySimulatorError("mitigation 'lr-rescale' scales each stage's lr by its own delay, but the "
                                      "simulator steps every pipedream stage with one optimizer; run it on a "
                                      "real pipeline (without --simulate), or simulate 2bw / --delay K")
        self.on_nonfinite = on_nonfinite
        self.last_skipped = False
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.stages = stages if per_stage else None  # the depth matters only where lags differ
        self.loss_fn, self.row_loss_fn = loss_fn, row_loss_fn
        self.lr_schedule = lr_schedule
        self.clipper = PreviousNormClipper(clip_grad_norm) if clip_grad_norm is not None else None
        # Untie (each use its own Parameter on the owner's storage) after the optimizer was built on
        # the tied model: the optimizer holds the owners only.
        self.tied = []
        blocks, ties, partition = None, [], None
        if hasattr(model, "blocks") or per_stage:
            blocks = as_blocks(model)
            ties = find_ties(model, blocks)
        if per_stage:  # refuse before the model is touched
            partition = split(blocks, stages, split_points)
            try:
                check_ties_on_one_stage(ties, partition)
            except TieError as exc:
                raise DelaySimulatorError(str(exc)) from None
        if hasattr(model, "blocks"):
            self.tied = untie(blocks, ties)
        mirrors = {id(m) for _, m in self.tied}
        named = [(n, p) for n, p in model.named_parameters() if id(p) not in mirrors]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._check_optimizer_covers_model()
        if per_stage:
            self.delays = per_stage_delays(schedule, named, blocks, partition)
        else:
            self.delays = [stage_delay(schedule, 0, 1, delay)] * len(self.params)
        if delay_only is not None:
            self.delays = only_some_delayed(model, named, self.delays, delay_only, per_stage)
        self.delayed = any(d > 0 for d in self.delays)
        if self.mitigation.rescales_lr and len(set(self.delays)) > 1:
            raise DelaySimulatorError("mitigation lr-rescale scales the learning rate by the delay, but these "
                                      f"parameters have different delays ({sorted(set(self.delays))}); "
                                      "rescaling needs one delay for every parameter")
        self.copies = compute_copies(model) if compute_copies is not None else None
        self.wants_previous = wants_previous_weights(optimizer)
        kept = [self._versions_kept(d) for d in self.delays]
        check_versions_fit(self.params, kept)
        # Versions before 0 are W(0): the first d_p steps compute on the initial weights.
        self.history = [[p.detach().clone() for _ in range(n)] for p, n in zip(self.params, kept)]
        # "predict": the extrapolated weights are built here each step, then swapped in.
        self.predicted = [torch.empty_like(p) if d and self.mitigation.predicts else None
                          for p, d in zip(self.params, self.delays)]
        self.steps_done = 0
        self.grad_norms: dict[int, float] = {}  # step index -> its gradient's global norm (clipping's)
        # --log-block-grad-norms: each parameter's block (the clipping terms summed per block)
        if block_grad_norms and (self.clipper is None or blocks is None):
            raise DelaySimulatorError("block_grad_norms sums the clipping measurement's norms per block: it needs "
                                      "clip_grad_norm (math.inf to only measure) and a model with blocks()")
        prefixes = block_prefixes(model, blocks, range(len(blocks))) if block_grad_norms else []
        self.block_labels = [block_of(n, prefixes) for n in self.names] if block_grad_norms else None
        self.block_grad_norms: dict[int, dict] = {}
        # Every submodule in training mode once (a loaded model may hold some in eval mode); a
        # step then walks the modules only when something switched the whole model out of it.
        model.train()
        if self.copies is not None:
            self.copies.module.train()
        # The step queued before the host reads the gradients' scan (step()): where nothing between
        # the scan and the optimizer's kernels needs its answer -- no delayed versions to rotate, no
        # clipping by the step's norm -- and the optimizer's every change is in fused kernels that
        # read the scan's flag on the device.
        # (The optimizer is asked at every step: a group added later may change its answer.)
        self._device_skip = (device_skip and not self.delayed and self.clipper is None
                             and hasattr(optimizer, "supports_device_skip"))
        self._scan = DeferredScan()
        if hasattr(optimizer, "check_finite"):
            # step() scans every gradient and never lets a bad step reach the optimizer: the
            # optimizer's own scan would repeat it, with a host sync of its own (set last, so
            # that a refused construction leaves the caller's optimizer as it was)
            optimizer.check_finite = False

    def _versions_kept(self, delay: int) -> int:
        """Ring length of a parameter with ``delay``: its d older versions, plus W(t-d-1) for
        prediction, or one slot more for d = 1 under EF from the weights (after the ring moves
        on, ``ring[1]`` must still hold W(t-1))."""
        if delay == 0:
            return 0
        if self.mitigation.predicts or (self.wants_previous and delay == 1):
            return delay + 1
        return delay

    def _versions_read(self, delay: int) -> int:
        """Kept versions a step reads (a checkpoint must hold them): W(t-1)..W(t-d), and
        W(t-d-1) for prediction. An extra EF slot is scratch, refilled before it is read."""
        return delay + 1 if delay and self.mitigation.predicts else delay

    @property
    def stash(self) -> list[torch.Tensor]:
        """W(t-1) of every parameter with delay >= 1, in parameter order (2bw: all of them)."""
        return [ring[0] for ring in self.history if ring]

    def _check_optimizer_covers_model(self) -> None:
        in_optimizer = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in zip(self.names, self.params) if id(p) not in in_optimizer]
        if missing:
            raise DelaySimulatorError(f"the optimizer does not hold parameter(s) {missing[:3]}...; "
                                      "build it from this model's parameters")

    @torch.no_grad()
    def _swap_compute_versions(self, entering: bool) -> None:
        """Exchange each delayed parameter's values with the version step t computes on: W(t - d_p)
        (ring slot d_p - 1), or its extrapolation under "predict" (built when ``entering``). The
        same call with ``entering=False`` puts W(t) back."""
        for p, ring, d, guess in zip(self.params, self.history, self.delays, self.predicted):
            if not ring:
                continue
            if guess is None:
                p.data, ring[d - 1].data = ring[d - 1].data, p.data
                continue
            if entering:  # W^ = W(t-d) + d (W(t-d) - W(t-d-1))
                predicted_weights(ring[d - 1], ring[d], d, out=guess)
            p.data, guess.data = guess.data, p.data
        self._sync_mirrors()

    @torch.no_grad()
    def _compensate_delays(self) -> None:
        """dc: grad <- grad + lambda grad^2 (W(t) - W(t - d_p)) for every delayed parameter."""
        lam = self.mitigation.dc_lambda
        for p, ring, d in zip(self.params, self.history, self.delays):
            if ring and p.grad is not None:
                delay_compensate_(p.grad, p, ring[d - 1], lam)

    def _previous_versions(self):
        """W(t-1) of every delayed parameter for EF from the weights (called after the ring moved
        on, so it is ring slot 1), or None: not asked for, or step 0 (no update applied yet)."""
        if not (self.wants_previous and self.steps_done >= 1):
            return None
        return {p: ring[1] for p, ring in zip(self.params, self.history) if ring}

    def _sync_mirrors(self) -> None:
        for owner, mirror in self.tied:  # a mirror views its owner's current values
            mirror.data = owner.data

    @torch.no_grad()
    def _push_newest(self) -> None:
        """W(t) becomes the newest kept version; the oldest, W(t - d_p), is no longer needed."""
        for p, ring in zip(self.params, self.history):
            if ring:
                slot = ring.pop()
                slot.copy_(p)
                ring.insert(0, slot)

    def step(self, minibatch: Sequence[tuple[torch.Tensor, torch.Tensor]],
             before_sync: Callable[[], None] | None = None) -> float:
        """One optimizer step on ``minibatch`` (a list of (inputs, targets)); returns its loss.
        ``before_sync`` is called once the step's microbatches are queued, before the host waits
        for them (train_steps fetches the next minibatch there)."""
        m = len(minibatch)
        if m == 0:
            raise DelaySimulatorError("a minibatch needs at least one microbatch")
        try:
            SCHEDULES[self.schedule].check(self.stages or 1, m)
        except ValueError as exc:
            raise DelaySimulatorError(str(exc)) from None
        _train_mode(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        if self.delayed:
            self._swap_compute_versions(entering=True)  # params <- W(t - d_p) or its prediction
        compute = self.model
        if self.copies is not None:  # the weights this step computes on, rounded once
            self.copies.begin_step()  # (fused weight gradients: the buffer they add into, zeroed)
            self.copies.refresh()
            compute = _train_mode(self.copies.module)
        # The losses stay on the device until the step's microbatches are queued: one host sync per
        # step, not two per microbatch, so a GPU never waits for the host between microbatches.
        losses = []
        try:
            for inputs, targets in minibatch:
                loss = self.loss_fn(compute, inputs, targets)
                (loss / m).backward()
                if self.copies is not None:
                    self.copies.accumulate()
                losses.append(loss.detach())
        finally:
            if self.delayed:
                self._swap_compute_versions(entering=False)  # params <- W(t)
        if before_sync is not None:
            before_sync()
        sum_tied_gradients(self.tied)
        # The losses ride along in the gradients' scan: one host sync for both, after which
        # reading them back waits for nothing.
        named = [(n, p.grad) for n, p in zip(self.names, self.params) if p.grad is not None]
        stacked = torch.stack(losses)
        riders = [stacked] if stacked.dtype == torch.float32 else []  # what the fused scan takes
        scanned = [g for _, g in named] + riders
        undo = None
        if self._device_skip and riders and self.optimizer.supports_device_skip() and DeferredScan.takes(scanned):
            # The optimizer step is queued before the host reads the scan, and skipped by its
            # kernels if the scan found a NaN/Inf: no idle device while the host decides and launches.
            # (Only with the losses in the scan: a bad loss the device did not see would be stepped.)
            lrs = [(g["lr"], "initial_lr" in g) for g in self.optimizer.param_groups]
            flag = self._scan.start(scanned, stacked)
            self._apply_lr()
            undo = self.optimizer.step_from(None, None, skip=flag)
            index, values = self._scan.result()
        else:
            index = first_nonfinite_index(scanned)
            values = stacked.tolist()
        total, bad = 0.0, None
        for i, value in enumerate(values):  # the same float sum, in microbatch order
            if bad is None and not math.isfinite(value):
                bad = f"non-finite loss ({value:g}) in microbatch {i}"
            total += value
        if bad is None and 0 <= index < len(named):
            bad = f"non-finite gradient in {named[index][0]}"
        if bad is not None and undo is not None:  # the device skipped the step: the host's part too
            undo()
            if self.on_nonfinite == "stop":  # the lrs as a stop before the step leaves them
                for group, (lr, had_base) in zip(self.optimizer.param_groups, lrs):
                    group["lr"] = lr
                    if not had_base:
                        group.pop("initial_lr", None)
        if bad is not None and self.on_nonfinite == "stop":
            raise NonFiniteError(f"{bad} at step {self.steps_done + 1}; stopping (use --on-nonfinite "
                                 "skip to skip such steps)")
        self.last_skipped = bad is not None
        if undo is None:
            if self.clipper is not None:
                self.clipper.clip([p.grad for p in self.params if p.grad is not None], self.last_skipped)
                if not self.last_skipped:
                    keep_norm(self.grad_norms, self.steps_done, self.clipper.previous_norm)
                    if self.block_labels is not None:
                        self._keep_block_norms()
            if self.mitigation.compensates and not self.last_skipped:  # W(t - d_p) is still in the ring
                self._compensate_delays()
            if self.delayed:
                self._push_newest()
            self._apply_lr()
            if not self.last_skipped:  # a skipped step leaves weights and optimizer state as they are
                step_versioned(self.optimizer, None, self._previous_versions())
        self.steps_done += 1
        return total / m

    def _apply_lr(self) -> None:
        """This step's learning rates: the schedule's multiplier times the mitigation's rescale."""
        rescale = self.mitigation.lr_multiplier(self.delays[0] if self.delays else 0, self.steps_done)
        if self.lr_schedule is not None or self.mitigation.rescales_lr:
            schedule = self.lr_schedule.multiplier(self.steps_done) if self.lr_schedule is not None else 1.0
            apply_lr(self.optimizer, schedule * rescale)

    def _keep_block_norms(self) -> None:
        """This step's norm per block from the clipper's terms (a parameter without a gradient: a
        term of 0, as the pipeline's zero gradient gives; adding it changes no sum)."""
        terms = iter(self.clipper.last_terms)
        keep_norm(self.block_grad_norms, self.steps_done, block_norms(
            [next(terms) if p.grad is not None else 0.0 for p in self.params], self.block_labels))

    def take_block_grad_norms(self) -> dict[int, dict]:
        """Each block's gradient norm of the steps run since the last call, by step index
        (--log-block-grad-norms)."""
        norms, self.block_grad_norms = self.block_grad_norms, {}
        return norms

    def take_grad_norms(self) -> dict[int, float]:
        """The global gradient norms (before clipping) of the steps run since the last call, by step
        index, where --clip-grad-norm measured them (StepEngine)."""
        norms, self.grad_norms = self.grad_norms, {}
        return norms

    def train_steps(self, stream, steps: int):
        """``steps`` steps on the stream's next minibatches, yielding each loss (StepEngine)."""
        device = self.params[0].device if self.params else torch.device("cpu")

        def fetch():  # the stream's next minibatch on the device (from pinned memory: asynchronous)
            return [(to_device(x, device), to_device(y, device)) for x, y in stream.next()]
        ahead = []
        for i in range(steps):
            minibatch = ahead.pop() if ahead else fetch()
            # the next step's minibatch is fetched while this one's kernels run, never past the
            # segment's last step (the stream's position is what a checkpoint records)
            prefetch = (lambda: ahead.append(fetch())) if i + 1 < steps else None
            loss = self.step(minibatch, before_sync=prefetch)
            yield StepOutcome(loss, True) if self.last_skipped else loss

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the newest weights over ``batches`` (in eval mode, no gradients)."""
        if not batches:
            raise ValueError("eval_loss needs at least one batch")
        return sum(self._evaluated(self.loss_fn, batches, lambda loss: loss.item())) / len(batches)

    @torch.no_grad()
    def row_losses(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Per row of ``batches``, in order, the newest weights' summed cross entropy over the row's
        targets (``row_loss_fn``; --eval-choices)."""
        return [x for sums in self._evaluated(self.row_loss_fn, batches, lambda sums: sums.tolist()) for x in sums]

    def _evaluated(self, fn, batches, read) -> list:
        """``read(fn(model, x, y))`` of each batch, the model in eval mode on what training computes
        with (its compute copies; bf16-params: every weight in bf16)."""
        model = self.model
        if self.copies is not None:
            self.copies.refresh()
            model = self.copies.module
        was_training = model.training
        model.eval()
        try:
            return [read(fn(model, x, y)) for x, y in batches]
        finally:
            model.train(was_training)

    # -- state: keyed by global parameter names so a checkpoint can be re-split later ------------
    def state_dict(self) -> dict:
        """Newest weights W(t) (``params``), W(t-1) of every delayed parameter (``stash``), its
        other kept versions ``[W(t-2), ..., W(t-d_p)]`` (``older``; with W(t-d_p-1) last where
        prediction or EF from the weights keeps it), optimizer state by parameter name, step
        count, clipping norm."""
        return {
            "schedule": self.schedule,
            "steps_done": self.steps_done,
            "params": {n: p.detach().clone() for n, p in zip(self.names, self.params)},
            "stash": {n: ring[0].clone() for n, ring in zip(self.names, self.history) if ring},
            "older": {n: [t.clone() for t in ring[1:]] for n, ring in zip(self.names, self.history)
                      if len(ring) >= 2},
            "optimizer": optimizer_state_by_name(self.optimizer, self.model),
            "clip": self.clipper.state_dict() if self.clipper is not None else {"previous_norm": None},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from ``state_dict`` (or merged pipeline shards); the run continues bitwise."""
        if state.get("schedule") != self.schedule:
            raise DelaySimulatorError(f"state was saved with schedule {state.get('schedule')!r}, this "
                                      f"simulator runs {self.schedule!r}; use the same schedule")
        _check_names("params", state["params"], self.names)
        for n, p in zip(self.names, self.params):  # before anything is written
            if tuple(state["params"][n].shape) != tuple(p.shape):
                raise DelaySimulatorError(f"saved {n!r} has shape {tuple(state['params'][n].shape)}, this model's "
                                          f"{tuple(p.shape)}; load a state saved from the same model shape")
        older = {n: v for n, v in (state.get("older") or {}).items() if len(v)}  # [] = none kept
        if self.delayed:
            versions_hint = "load a state saved with the same schedule, delay and stage split"
            _check_names("stash", state["stash"], [n for n, r in zip(self.names, self.history) if r],
                         versions_hint)
            # Older versions a step reads must be saved; an EF scratch slot may be missing (a
            # pipeline's 2bw checkpoint has none) and is filled from W(t-1).
            needed = [n for n, d in zip(self.names, self.delays) if self._versions_read(d) >= 2]
            kept = [n for n, r in zip(self.names, self.history) if len(r) >= 2]
            _check_names("older", older, needed, versions_hint, optional=kept)
            for n, ring, d in zip(self.names, self.history, self.delays):
                saved = len(older.get(n, []))
                if len(ring) >= 2 and not self._versions_read(d) - 1 <= saved <= len(ring) - 1:
                    raise DelaySimulatorError(
                        f"saved older versions of {n!r} are {saved}, this simulator keeps "
                        f"{len(ring) - 1} (delay {d}); {versions_hint}")
        with torch.no_grad():
            for n, p, ring in zip(self.names, self.params, self.history):
                p.copy_(state["params"][n])
                saved = [state["stash"][n], *older.get(n, [])] if ring else []
                for slot, value in zip(ring, saved + saved[:1] * (len(ring) - len(saved))):
                    slot.copy_(value)
        self._sync_mirrors()
        load_optimizer_state_by_name(self.optimizer, self.model,
                                     regroup_optimizer_state(state["optimizer"], self.optimizer, self.model))
        if self.clipper is not None:
            self.clipper.load_state_dict(state.get("clip"))
        self.steps_done = int(state["steps_done"])


def _check_names(what: str, saved: dict, expected: list[str],
                 hint: str = "load a state saved from the same model shape", optional=()) -> None:
    """``saved`` must hold every name of ``expected`` and nothing outside it and ``optional``."""
    allowed = set(expected) | set(optional)
    if not set(expected) <= set(saved) <= allowed:
        missing = sorted(set(expected) - set(saved))[:3]
        extra = sorted(set(saved) - allowed)[:3]
        raise DelaySimulatorError(f"saved {what} do not match the model (missing {missing}, "
                                  f"unexpected {extra}); {hint}")


__all__ = ["DelaySimulator", "DelaySimulatorError", "default_loss", "stage_delay",
           "SIMULATED_SCHEDULES"]
