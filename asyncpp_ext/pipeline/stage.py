"""One pipeline stage as the executor sees it: forward, backward and optimizer step on demand.

Weight versions: the stage's parameters live in a ring of n flat buffers, version v in buffer
v % n (n = 1 for sync schedules, 2 for 2bw, S - s on stage s for pipedream). One module replica
views each buffer, so running a microbatch on version v means running replica v % n -- no copies
and no pointer swaps under autograd. All replicas' ``.grad`` view one flat gradient buffer. With
n > 1 the optimizer owns another set of parameter *handles* (stable identities for its state)
pointed at the buffer being written just before each step: OPTIMIZER_STEP(t) writes version t+1
into buffer (t+1) % n, whose version t+1-n no instruction needs any more (docs/design.md §1.3,
§1.16). A single buffer is stepped in place. The step reads W(t) from its own buffer through
per-parameter views (``step_versioned``; optimizers without an out-of-place step get it copied
first), and, for error feedback from the weights, W(t-1) from buffer (t-1) % n.

Staleness mitigations (optim/mitigations.py) run per stage with the stage's delay d = n - 1:
"dc" corrects the flat gradient with W(t) and W(t-d) (buffer (t+1) % n, before the step writes
there), "lr-rescale" scales the stage's learning rates by (1 + d) ** -max(0, 1 - t/K).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..models.base import forward_through
from ..models.graphs import GraphedCompute
from ..models.document_mask import within_documents
from ..models.head_loss import head_loss, kernel_for_graphs
from ..models.z_loss import check_z_loss, plain_loss
from ..optim.lr_schedule import apply_lr
from ..optim.mitigations import MitigationSettings, delay_compensate_
from ..optim.versioned import step_versioned, wants_previous_weights
from ..schedule.table import schedule_spec
from .data_parallel import GradientAverager
from .compute_copies import ReplicaCopies
from .main_grad import fusion_available
from .flat_buffers import flatten_into, point_at, views_of
from .memory import ActivationMeter
from .recompute import RngState, autocast_context
from .stage_state import load_stage_state, stage_state_dict
from .nonfinite import NonFiniteGuard
from .peer_errors import TransportError, peer_failure_reason, peer_gone
from .stream_worker import StreamStopped

ACTIVATION, GRADIENT = 0, 1


@dataclass(frozen=True)
class Signature:
    """Shape and dtype of the tensor crossing a stage boundary, agreed once at start-up."""
    shape: tuple
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}"


class StageError(RuntimeError):
    """A stage cannot go on; the message names the stage, the step and the microbatch."""


# torch.autograd.backward converts and validates its arguments, a few microseconds per call; a
# stage's output gradient has the output's shape and dtype by construction (the signature agreed
# at start-up), so where torch exposes its engine call the stage makes that call directly.
_engine_run_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


def run_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate d(output . grad)/d(leaves) into the leaves' .grad, as torch.autograd.backward."""
    if _engine_run_backward is None:
        torch.autograd.backward(output, grad)
    else:
        _engine_run_backward((output,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _mean_loss(losses: list[float]) -> float:
    """The step loss: the mean of its microbatches' losses."""
    return sum(losses) / len(losses)


class StageHost:
    """The executor's callbacks for one stage (see csrc/core/executor.h)."""

    def __init__(self, module: nn.Module, *, stage: int, stages: int, schedule: str, microbatches: int,
                 optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
                 loss_fn: Callable | None, batch_source: Callable[[int], tuple],
                 on_step: Callable | None = None, track_memory: bool = False, recompute: bool = False,
                 autocast_dtype: torch.dtype | None = None, on_nonfinite: str = "stop",
                 param_names: Sequence[str] = (), lr_schedule=None,
                 mitigation: MitigationSettings | None = None, exchange=None,
                 dp_group=None, dp: int = 1, shard_optimizer: bool = False, head_loss: str = "plain",
                 head_loss_kernel: str = "auto", cuda_graphs: bool = False, compute_copies: bool = False,
                 params_in_compute_dtype: bool = False, gradient_accumulation_fusion: bool = False,
                 z_loss: float = 0.0, document_mask: int | None = None,
                 device: torch.device | str | None = None):
        """``device``: where the stage computes (default: where its first parameter lives; a stage
        without parameters needs it to set up autocast and its receive buffers there).
        ``on_nonfinite`` and ``param_names`` configure the NaN/Inf guard (nonfinite.py);
        ``lr_schedule`` (optim/lr_schedule.py) scales every group's lr at each step; ``mitigation``
        is the staleness mitigation this stage applies (optim/mitigations.py); ``exchange`` the
        tied-weight and clipping exchange (step_exchange.py; None when it has nothing to do);
        with ``dp`` > 1 the gradient is averaged over ``dp_group`` before each step and, with
        ``shard_optimizer``, Muon's orthogonalisations are split among the replicas. On the last
        stage ``head_loss`` "fused" computes the last block's loss without whole logits
        (models/head_loss.py, with ``head_loss_kernel``); "plain" is ``loss_fn(blocks(x), targets)``;
        either with the z-loss's gradient where ``z_loss`` > 0 (models/z_loss.py).
        ``document_mask``: a boundary token id; each microbatch's blocks then attend within the
        documents of its input ids (models/document_mask.py), which every stage reads from the
        batch source, and for a recomputation in backward again.
        ``cuda_graphs`` replays each microbatch's forward and backward from CUDA graphs, per
        weight-version replica (models/graphs.py); not with ``recompute``. ``compute_copies`` (under
        bf16 autocast) runs each replica's microbatches on bf16 copies of its linear weights,
        refreshed when the replica's buffer takes a new version (compute_copies.py; the same
        numbers as autocast's casts; with data parallelism they announce their weights' gradients
        complete to its buckets); ``params_in_compute_dtype`` (``--dtype bf16-params``) copies
        every parameter; ``gradient_accumulation_fusion``: the copies' weight-gradient products add
        into the float32 gradient buffer themselves (main_grad.py)."""
        self.stage, self.stages, self.schedule, self.m = stage, stages, schedule, microbatches
        self.recompute, self.autocast_dtype = recompute, autocast_dtype
        self.exchange, self.lr_schedule = exchange, lr_schedule
        self.peer_wait = lambda what: contextlib.nullcontext()  # see watch_peer_waits
        self.mitigation = MitigationSettings() if mitigation is None else mitigation
        self._dc_workspace: torch.Tensor | None = None
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.loss_fn, self.batch_source, self.on_step = loss_fn, batch_source, on_step
        self.stop_reason: str | None = None  # set from another thread: the stream ends (stream_worker.py)
        if head_loss not in ("plain", "fused"):
            raise ValueError(f"head_loss must be 'plain' or 'fused', got {head_loss!r}")
        self.z_loss = check_z_loss(z_loss)
        self.document_mask = document_mask
        self.head_loss, self.head_loss_kernel = head_loss, kernel_for_graphs(head_loss_kernel, cuda_graphs)
        self.num_versions = schedule_spec(schedule).stage_lags(stages)[stage].versions
        self.ring = self.num_versions > 1

        replicas = [module] + [copy.deepcopy(module) for _ in range(self.num_versions - 1)]
        if self.ring:
            handles_module = copy.deepcopy(module)
        params = [list(r.parameters()) for r in replicas]
        numel = sum(p.numel() for p in params[0])
        ref = params[0][0] if params[0] else torch.empty(0, device=device)
        self.flat = [torch.empty(numel, dtype=ref.dtype, device=ref.device) for _ in replicas]
        for ps, flat in zip(params, self.flat):
            flatten_into(ps, flat)
        self.grad_flat = torch.zeros_like(self.flat[0])
        for ps in params:
            point_at(ps, self.grad_flat, attr="grad")
        self.replicas = replicas
        # version_in[k]: the weight version buffer k holds (W(0) in buffer 0 only at the start).
        self.version_in = [0] + [-1] * (self.num_versions - 1)
        if self.ring:
            self.opt_params = list(handles_module.parameters())
            point_at(self.opt_params, self.flat[1])
            point_at(self.opt_params, self.grad_flat, attr="grad")
            self.optimizer = optimizer_factory(handles_module) if numel else None
        else:
            self.opt_params = params[0]
            self.optimizer = optimizer_factory(module) if numel else None  # a parameter-free stage
        self.delay = self.num_versions - 1  # the steps this stage computes behind the newest weights
        self.wants_previous = self.optimizer is not None and wants_previous_weights(self.optimizer)
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]} if self.optimizer else set()
        # Per buffer, made once: the optimizer's parameter -> its view there (sources / previous
        # of a versioned step), and the views of the parameters the optimizer does not update
        # (tied mirrors, frozen tensors), which the step copies from W(t) itself.
        views = [views_of(self.opt_params, flat) for flat in self.flat] if self.ring else []
        self._buffer_views = views  # per buffer, every handle's view: pointing them costs no view op
        self._held_views = [{p: v for p, v in zip(self.opt_params, vs) if id(p) in held} for vs in views]
        self._other_views = [[v for p, v in zip(self.opt_params, vs) if id(p) not in held] for vs in views]

        # bf16 compute copies, one set per replica (= weight buffer). With data parallelism they
        # announce their masters' gradients complete in each step's last backward (below).
        every = params_in_compute_dtype
        self.copies = ReplicaCopies.build(replicas, autocast_dtype, compute_copies or every,
                                          exclude_last=self.is_last and head_loss == "fused" and not every,
                                          every=every,  # the fused head casts its own weight
                                          fuse_weight_gradients=gradient_accumulation_fusion)
        if gradient_accumulation_fusion and self.copies is None:
            raise ValueError("gradient_accumulation_fusion fuses the bf16 compute copies' weight gradients, but "
                             "this stage has none (float32, or compute_copies off)")
        if gradient_accumulation_fusion and (why := fusion_available(self.flat[0].device)) is not None:
            raise ValueError(f"gradient_accumulation_fusion: {why}")

        # Opt-in: counts the bytes autograd keeps for in-flight microbatches (see memory.py).
        held = list(self.flat) + ([c.flat for c in self.copies.sets] if self.copies else [])
        self.activation_meter = ActivationMeter(exclude=held) if track_memory else None
        self.nonfinite = NonFiniteGuard(stage, stages, microbatches, on_nonfinite)
        self.nonfinite.names = list(param_names)
        self.nonfinite.sizes = [p.numel() for p in self.opt_params]
        if hasattr(self.optimizer, "check_finite"):
            # The guard scans grad_flat -- every optimizer parameter's gradient -- right before each
            # step and never lets a bad step reach the optimizer: its own scan would repeat it.
            self.optimizer.check_finite = False
        # Under data parallelism: averages grad_flat over the stage's replicas.
        self.grad_sync = GradientAverager(self.grad_flat, [list(r.parameters()) for r in self.replicas],
                                          dp_group, dp) if dp > 1 else None
        if self.grad_sync is not None and self.copies is not None:
            # the weights computed on copies get no gradient from autograd (nor, fused, a .grad
            # it adds into), so no hook of the averager's fires for them: the copies and the
            # fused products say when each is complete, and its bucket's all-reduce still starts
            # inside the backward
            for replica, copies in zip(self.replicas, self.copies.sets):
                index = {id(p): i for i, p in enumerate(replica.parameters())}
                copies.announce_final_grads(lambda p, index=index: self.grad_sync.grad_final(index[id(p)]))
        if dp > 1 and shard_optimizer and hasattr(self.optimizer, "shard_across"):
            self.optimizer.shard_across(dp_group)
        if cuda_graphs and recompute:
            raise ValueError("cuda_graphs replays a forward together with its backward; it cannot run "
                             "with recompute")
        # Per replica (= weight buffer, whose address never changes): its graphed compute (on the
        # replica's compute copies where it has them: they never move either).
        computed = [c.module for c in self.copies.sets] if self.copies else replicas
        self.graphs = {id(r): GraphedCompute(r, self._compute) for r in computed} if cuda_graphs else None
        self.in_sig: Signature | None = None   # set by the start-up handshake
        self.out_sig: Signature | None = None
        self._batches: dict[int, tuple] = {}    # step -> (inputs[m], targets[m]) while in use
        self._saved: dict[tuple, tuple] = {}    # (step, mb) -> (input, output or scaled loss)
        self._losses: dict[int, list] = {}     # step -> its microbatches' losses (tensors, floats once read)
        self._loss_grad: torch.Tensor | None = None  # 1/m, made at the first backward

    # ---- weights ---------------------------------------------------------------------------
    def newest_version(self) -> int:
        return max(self.version_in)

    def buffer_for(self, version: int) -> torch.Tensor:
        """The flat buffer that holds (or will hold) ``version``."""
        return self.flat[version % self.num_versions]

    def replica_for(self, version: int) -> nn.Module:
        k = version % len(self.replicas)
        if self.version_in[k] != version:
            raise StageError(f"stage {self.stage}: weight version {version} is not held (buffers hold "
                             f"{self.version_in}); the schedule and the version rule disagree")
        return self.replicas[k]

    def newest_replica(self) -> nn.Module:
        return self.replica_for(self.newest_version())

    def compute_module(self, version: int) -> nn.Module:
        """What a training microbatch on ``version`` runs: its replica, or its bf16 compute copies."""
        replica = self.replica_for(version)
        if self.copies is None:
            return replica
        return self.copies.module_for(version % len(self.replicas), version, replica)

    def memory_report(self) -> dict:
        """Bytes held by this stage: weight versions, gradient buffer, optimizer state (incl. EF
        buffers), the fused optimizers' Newton-Schulz workspace (Muon: about two ns_dtype copies
        of the matrices, kept between steps; emulated bf16 on CPU keeps them in float32) and, when tracked, the peak of in-flight activations."""
        from .memory import optimizer_state_bytes

        workspace = getattr(self.optimizer, "workspace", None)
        return {"weights": sum(f.numel() * f.element_size() for f in self.flat),
                "weight_versions": len(self.flat),
                "grads": self.grad_flat.numel() * self.grad_flat.element_size(),
                "optimizer_state": optimizer_state_bytes(self.optimizer),
                "optimizer_workspace": workspace.nbytes() if workspace is not None else 0,
                "compute_copies": self.copies.nbytes() if self.copies else 0,
                "peak_activations": self.activation_meter.peak if self.activation_meter else None}

    # ---- state (keyed by global parameter names, the same layout as DelaySimulator) ---------
    def state_dict(self, names: Sequence[str]) -> dict:
        """Newest weights W(k) (``params``), W(k-1) (``stash``) and W(k-2)..W(k-n+1) (``older``, as
        lists by name) for the versions this stage keeps, optimizer state, step count."""
        return stage_state_dict(self, names)

    def load_state_dict(self, state: dict, names: Sequence[str]) -> None:
        """Load a state written at any pipeline depth (only this stage's names are taken)."""
        load_stage_state(self, state, names)

    # ---- data ------------------------------------------------------------------------------
    def _batch(self, step: int) -> tuple:
        if step not in self._batches:
            self._batches[step] = self.batch_source(step)
        return self._batches[step]

    # ---- executor callbacks ----------------------------------------------------------------
    def autocast(self):
        return autocast_context(self.flat[0].device, self.autocast_dtype, cache=self.graphs is None)

    def _run_blocks(self, replica: nn.Module, x: torch.Tensor, step: int, mb: int):
        """The stage output, or on the last stage its loss (backward starts there with the
        gradient 1/m, see ``_loss_gradient``)."""
        if self.document_mask is not None:
            with within_documents(self._batch(step)[0][mb], self.document_mask):
                return self._autocast_blocks_and_loss(replica, x, step, mb)
        return self._autocast_blocks_and_loss(replica, x, step, mb)

    def _autocast_blocks_and_loss(self, replica: nn.Module, x: torch.Tensor, step: int, mb: int):
        if self.autocast_dtype is None:  # the common case: no context manager per microbatch
            return self._blocks_and_loss(replica, x, step, mb)
        with self.autocast():
            return self._blocks_and_loss(replica, x, step, mb)

    def _blocks_and_loss(self, replica: nn.Module, x: torch.Tensor, step: int, mb: int):
        args = (x, self._batch(step)[1][mb]) if self.is_last else (x,)
        if self.graphs is not None:  # replayed while gradients are on, eager otherwise
            return self.graphs[id(replica)](*args)
        return self._compute(replica, *args)

    def _compute(self, replica: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None):
        """The stage's output of ``x``; on the last stage its loss against ``targets``."""
        if not self.is_last:
            return replica(x)
        return self.loss_of(replica, x, targets)

    def loss_of(self, replica: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of input ``x`` through ``replica`` (training and evaluation)."""
        if self.head_loss == "plain":
            return plain_loss(self.loss_fn, replica(x), targets, self.z_loss)
        *body, head = replica  # the stage's blocks; the last one is the model's head
        return head_loss(head, forward_through(body, x), targets, "fused", kernel=self.head_loss_kernel,
                         z_loss=self.z_loss)

    def _loss_gradient(self, loss: torch.Tensor) -> torch.Tensor:
        """d(step loss)/d(microbatch loss) = 1/m, computed once as ``ones / m`` in the loss's dtype:
        the very value autograd would derive for ``(loss / m).backward()`` (the simulator's form),
        without a division node per microbatch."""
        grad = self._loss_grad
        if grad is None or grad.dtype != loss.dtype or grad.device != loss.device:
            grad = self._loss_grad = torch.ones((), dtype=loss.dtype, device=loss.device) / self.m
        return grad

    def forward(self, step: int, mb: int, version: int, received: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward of microbatch ``mb`` of ``step`` on weight ``version``. ``received`` is the
        input activation (a receive slot the runtime reuses once this microbatch's backward has
        returned; None on the first stage). Returns the activation to send (None on the last)."""
        if self.stop_reason is not None:
            raise StreamStopped(f"stage {self.stage}: {self.stop_reason} (at step {step}, microbatch {mb})")
        if self.exchange is not None:  # tied values of this version, from their owner stage
            self.exchange.install(version, self.buffer_for(version))
        replica = self.compute_module(version)
        if self.is_first:
            x = self._batch(step)[0][mb]
            self._check(x, self.in_sig, "input microbatch", step, mb)
        else:  # a leaf of its own: the slot itself never accumulates a .grad
            x = received.detach().requires_grad_()
        if self.recompute:  # no graph now; keep the input (counted as in-flight) and the RNG state
            rng = RngState(x.device)
            with torch.no_grad():
                out = self._run_blocks(replica, x, step, mb)
            held = self.activation_meter.hold(x) if self.activation_meter else None
            self._saved[(step, mb)] = (x, (rng, held))
        elif self.activation_meter is None and torch.is_grad_enabled():  # the per-microbatch fast path
            out = self._run_blocks(replica, x, step, mb)
            self._saved[(step, mb)] = (x, out)
        else:
            tracking = self.activation_meter.track() if self.activation_meter else contextlib.nullcontext()
            with torch.enable_grad(), tracking:
                out = self._run_blocks(replica, x, step, mb)
            self._saved[(step, mb)] = (x, out)
        if self.is_last:
            self._record_loss(step, mb, out)
            return None
        self._check(out, self.out_sig, "output activation", step, mb)
        return out.detach().contiguous()

    def _record_loss(self, step: int, mb: int, loss: torch.Tensor) -> None:
        """Keep the microbatch's loss on its device; the step's losses are read together at its
        last backward (``_read_losses``), one host sync per step instead of one per microbatch."""
        if loss.numel() != 1:
            raise StageError(f"stage {self.stage}: loss_fn returned a tensor of shape {tuple(loss.shape)} "
                             f"for microbatch {mb} of step {step}; it must return a scalar (reduce it, e.g. "
                             "with .mean())")
        self._losses.setdefault(step, []).append(loss.detach().reshape(()))

    def _read_losses(self, step: int) -> list[float]:
        """The step's microbatch losses as floats (read once; a non-finite one stops the run or
        marks the step, see NonFiniteGuard.check_losses)."""
        losses = self._losses[step]
        if losses and isinstance(losses[0], torch.Tensor):
            losses = self._losses[step] = torch.stack(losses).tolist()
            self.nonfinite.check_losses(step, losses)
        return losses

    def backward(self, step: int, mb: int, version: int, received: torch.Tensor | None = None) -> torch.Tensor | None:
        """Backward of microbatch ``mb`` of ``step``; ``received`` is the gradient of this stage's
        output (None on the last stage). Returns the input's gradient to send (None on the first)."""
        x, out = self._saved.pop((step, mb))
        if self.recompute:
            rng, held = out
            tracking = self.activation_meter.track() if self.activation_meter else contextlib.nullcontext()
            with rng.replay(), torch.enable_grad(), tracking:
                out = self._run_blocks(self.compute_module(version), x, step, mb)
            del held  # the graph now holds what the input kept alive
        last = mb == self.m - 1
        if last and self.is_last:  # every loss of the step is computed: read them (one sync)
            self._read_losses(step)
        if last and self.grad_sync is not None:  # gradient all-reduce overlaps this backward
            self.grad_sync.arm(_mean_loss(self._losses[step]) if self.is_last else None)
        copies = self.copies.sets[version % len(self.replicas)] if self.copies is not None else None
        if copies is not None and self.grad_sync is not None:
            copies.start_final_backward(last)
        try:
            if self.is_last:
                run_backward(out, self._loss_gradient(out))
            else:
                self.nonfinite.note_received_gradient(step, mb, received)
                run_backward(out, received)
        finally:
            if copies is not None and self.grad_sync is not None:
                copies.start_final_backward(False)
        if copies is not None:  # the copies' bf16 gradients into the float32 buffer
            copies.accumulate()
        own = None
        if last and self.grad_sync is not None:
            self.grad_sync.launch_rest()
            own = self.grad_sync.own_first_nonfinite  # grad_flat is being averaged: judge what was ours
        self.nonfinite.after_backward(step, mb, self.grad_flat, None if self.is_first else x.grad, own)
        if last:
            self._batches.pop(step, None)
        return None if self.is_first else x.grad.contiguous()

    def watch_peer_waits(self, peer_wait: Callable[[str], contextlib.AbstractContextManager]) -> None:
        """``peer_wait(what)``: a context around each wait of this stage's optimizer step on other
        ranks (the data-parallel all-reduce, the tied weights' exchange, a sharded optimizer's
        gather), so that a watchdog reports a stall there as waiting on a peer, not as this rank's."""
        self.peer_wait = peer_wait
        if self.exchange is not None:
            self.exchange.peer_wait = peer_wait
        if hasattr(self.optimizer, "peer_wait"):
            self.optimizer.peer_wait = peer_wait

    def optimizer_step(self, step: int, new_version: int) -> None:
        global_loss = None
        if self.grad_sync is not None:
            with self.peer_wait(f"waiting for the data-parallel all-reduce of stage {self.stage}'s gradients (step {step})"):
                try:
                    global_loss = self.grad_sync.finish()
                except RuntimeError as e:
                    if not peer_gone(e):
                        raise
                    raise TransportError(f"stage {self.stage}: the data-parallel all-reduce of its gradients (step "
                                         f"{step}) failed -- a replica has probably exited: "
                                         f"{peer_failure_reason(e)}") from None
        if self.grad_sync is not None:  # a replica's bad step reaches every replica through the average
            self.nonfinite.after_average(step, self.grad_flat, global_loss)
        skip = self.nonfinite.skip_step(step)  # then W(t+1) = W(t): no update on any stage
        if self.exchange is not None:  # tied gradients summed, gradient clipped
            self.exchange.before_step(step, self.grad_flat, skip)
        if self.mitigation.compensates and self.delay and not skip:
            self._compensate_delay(step)
        if self.optimizer is not None and (self.lr_schedule is not None or self.mitigation.rescales_lr):
            schedule = self.lr_schedule.multiplier(step) if self.lr_schedule is not None else 1.0
            apply_lr(self.optimizer, schedule * self.mitigation.lr_multiplier(self.delay, step))
        dst = (step + 1) % self.num_versions
        if self.ring:  # W(t+1) goes into the buffer of the version no instruction needs any more
            self._point_handles(dst)
            if self.optimizer is None or skip:  # W(t+1) = W(t)
                self.flat[dst].copy_(self.flat[step % self.num_versions])
            else:
                self._step_into(dst, step)
        elif self.optimizer is not None and not skip:
            step_versioned(self.optimizer)
        self.version_in[dst] = new_version
        if self.exchange is not None:
            self.exchange.after_step(step, self.flat[dst])
        self.grad_flat.zero_()
        loss = None
        if self.is_last:
            losses = self._read_losses(step)
            del self._losses[step]
            loss = _mean_loss(losses) if global_loss is None else global_loss
        if self.on_step is not None:
            self.on_step(step, loss, skip)

    def _held_buffer(self, version: int) -> torch.Tensor:
        """The flat buffer holding ``version`` (versions before 0 are W(0)), checked."""
        version = max(version, 0)
        k = version % self.num_versions
        if self.version_in[k] != version:
            raise StageError(f"stage {self.stage}: weight version {version} is not held (buffers hold "
                             f"{self.version_in})")
        return self.flat[k]

    @torch.no_grad()
    def _compensate_delay(self, step: int) -> None:
        """dc on the whole flat gradient: g + lambda g^2 (W(t) - W(t-d)); W(t-d) sits in buffer
        (t+1) % n until this step overwrites it (W(0) in buffer 0 while t < d)."""
        if self._dc_workspace is None:
            self._dc_workspace = torch.empty_like(self.grad_flat)
        delay_compensate_(self.grad_flat, self._held_buffer(step), self._held_buffer(step - self.delay),
                          self.mitigation.dc_lambda, workspace=self._dc_workspace)

    def _point_handles(self, buffer: int) -> None:
        """Point the optimizer's parameter handles at flat buffer ``buffer``."""
        for p, view in zip(self.opt_params, self._buffer_views[buffer]):
            p.data = view

    def _step_into(self, dst: int, step: int) -> None:
        """The optimizer step of ``step`` writing W(t+1) into buffer ``dst`` (the handles point
        there): W(t) read from its own buffer, W(t-1) passed for EF from the weights."""
        src = step % self.num_versions
        if getattr(self.optimizer, "step_from", None) is None and not self.wants_previous:
            # It steps in place: W(t) goes into the destination in one copy of the flat buffer
            # (bitwise what copying parameter by parameter gives, without a Python call per tensor).
            self.flat[dst].copy_(self.flat[src])
            step_versioned(self.optimizer)
            return
        for to, value in zip(self._other_views[dst], self._other_views[src]):
            to.copy_(value)
        previous = self._held_views[(step - 1) % self.num_versions] if self.wants_previous and step >= 1 else None
        step_versioned(self.optimizer, self._held_views[src], previous)

    # ---- transport buffers -----------------------------------------------------------------
    def new_recv_buffer(self, kind: int) -> torch.Tensor:
        """A tensor a receive of ``kind`` lands in (the runtime allocates a few and reuses them)."""
        sig = self.in_sig if kind == ACTIVATION else self.out_sig
        return torch.empty(sig.shape, dtype=sig.dtype, device=self.flat[0].device)

    def _check(self, t: torch.Tensor, sig: Signature, what: str, step: int, mb: int) -> None:
        if sig is not None and (tuple(t.shape) != tuple(sig.shape) or t.dtype != sig.dtype):
            raise StageError(
                f"stage {self.stage}: {what} of step {step}, microbatch {mb} is "
                f"{Signature(tuple(t.shape), t.dtype).describe()} but the pipeline agreed on "
                f"{sig.describe()} at start-up; every microbatch must keep the micro-batch size, "
                "sequence length and dtype the run started with")
