"""`Pipeline`: one rank's view of a pipeline-parallel training run.

Every rank builds the same model (same seed) and keeps its own stage's blocks. At the first
``train`` call the stages agree, in a chain from stage 0 to S-1, on the run's settings and on the
shape and dtype of every boundary tensor; later microbatches are checked against that agreement
locally (no extra messages). Each ``train`` call is one continuous instruction stream (for 2bw:
no drain between its steps) executed by the C++ executor in a worker thread, while the caller
receives per-step statistics as steps complete (streams.py: the base class `StreamControl`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .._ext import C
from ..optim.mitigations import (DEFAULT_DC_LAMBDA, SIMULATOR_ONLY_MITIGATIONS, MitigationError,
                                 resolve_mitigation)
from ..models.base import BlockSequence, row_losses
from ..models.document_mask import check_document_mask, within_documents
from ..models.z_loss import check_kernel_z_loss, check_z_loss
from ..models.head_loss import KERNELS as HEAD_LOSS_KERNELS
from ..models.compile_support import check_inductor_options, inductor_mode
from ..models.regions import compile_regions, scope_regions
from ..schedule.table import schedule_names, schedule_spec
from .arguments import check_arguments, is_int
from .clipping import check_max_norm
from .data_parallel import Layout, create_dp_group, replica_share
from .partition import GlobalView, as_blocks, split
from .recompute import PARAMS_IN_COMPUTE_DTYPE, resolve_autocast
from .handshake import p2p
from .stage import Signature, StageHost
from .stage_state import engine_state, newest_params
from .stream_worker import join_left_streams
from .streams import StreamControl
from .step_exchange import StepExchange, norm_term_blocks
from .ties import block_prefixes, check_ties_on_one_stage, find_ties, mirror_names, untie
from .devices import TRANSPORTS, check_device, choose_transport  # noqa: F401 (TRANSPORTS: public name kept here)
from .transports import TransportContext, create_transport
from .watchdog import Watchdog, check_timeout, default_timeout_s

SCHEDULES = schedule_names(pipeline_only=True)
"""The schedules a Pipeline runs: the pipeline rows of the schedule table (schedule/table.py)."""
_EVAL_TAG = 2


class Pipeline(StreamControl):
    """Pipeline-parallel trainer for this rank's stage.

    Args:
        model: an nn.Sequential, a list of blocks, or a model with ``blocks()``; every rank passes
            the same (identically initialised) model.
        loss_fn: ``loss_fn(output, targets)`` on the last stage (mean over the microbatch).
        optimizer: ``factory(module) -> torch.optim.Optimizer`` for the stage's blocks.
        schedule: "gpipe", "1f1b" (synchronous), "2bw" (PipeDream-2BW, one-step delay) or
            "pipedream" (PipeDream with weight stashing: one microbatch per step, stage s delayed
            by S-1-s steps and keeping S-s weight versions; docs/design.md §1.16).
        microbatches: microbatches per step (2bw needs >= stages).
        stages: pipeline depth; defaults to the world size divided by dp.
        split_points: first block index of stages 1..S-1; default balances parameter counts.
        timeout_s: the rank aborts with a stall report (see watchdog.py) when no instruction
            completes for this long; default ``ASYNCPP_TIMEOUT`` or 300 s. Transport waits fail
            after twice as long, as a backstop.
        recv_ahead: receives posted ahead of need per message kind (the receive-buffer budget).
        track_memory: measure the peak bytes of in-flight activations (``host.memory_report()``).
        device: where this stage's blocks run, e.g. "cuda:0" (default CPU). Batches are moved there.
        transport: "gloo" (torch.distributed over gloo; on CUDA staged through host memory, so
            ranks may share a GPU), "nccl" (the C++ NCCL transport, CUDA only), "torch"
            (torch.distributed isend/irecv on a group per link and direction: NCCL on CUDA, gloo
            on CPU), "socket" (the C++ TCP transport, CPU), "ipc" (shared memory between stages
            on one host: CUDA IPC, so ranks may share a GPU without host copies; ipc.py), or
            "auto": nccl on CUDA, else socket (see devices.py). On CUDA the default
            process group must still carry CPU tensors, i.e. be "gloo" or "cpu:gloo,cuda:nccl",
            for the start-up handshake and evaluation.
        run_id: names this pipeline's NCCL rendezvous keys; equal on every rank (see nccl.py).
        dp: data-parallel replicas R of the S-stage pipeline (world = S * R, rank = replica * S +
            stage; see data_parallel.py). Every rank is fed the same global minibatches; replica r
            takes rows r*B..(r+1)*B-1 of each microbatch of R*B sequences, so the losses equal one
            pipeline's on the whole global microbatches. Gradients are averaged over each stage's
            replicas before every optimizer step.
        shard_optimizer: with dp > 1, split the stage's Muon orthogonalisations among its replicas
            (asyncpp Muon / MuonHybrid only; the result equals the unsharded step).
        recompute: keep only each microbatch's stage input and re-run the forward right before its
            backward (same numbers, less in-flight activation memory).
        dtype: "auto" (bf16 autocast on CUDA, float32 on CPU), "fp32", "bf16" (autocast; weights,
            gradients and optimizer state stay float32) or "bf16-params" (every parameter copied to
            bf16 per weight version: activations and residual stream in bf16; float32 master
            weights, gradient accumulation and optimizer state).
        on_nonfinite: "stop" (a NaN/Inf loss or gradient ends the run, naming stage and step) or
            "skip" (that step's update is skipped on every stage); see nonfinite.py.
        lr_schedule: an object with ``multiplier(step)`` (optim/lr_schedule.py): every parameter
            group's learning rate is its initial value times it at each optimizer step.
        clip_grad_norm: clip each step's gradient by the global norm of the previous step's
            (clipping.py); ``math.inf`` measures the norms (``take_grad_norms``) without clipping;
            None = off.
        mitigation: staleness mitigation applied per stage with its own delay (optim/mitigations.py):
            None/"none", "ef" (error feedback, inside the optimizer), "dc" (delay compensation of the
            gradient, strength ``dc_lambda``) or "lr-rescale" (the lr scaled by (1 + d) ** -p(t),
            fading out over ``rescale_steps`` steps, which it requires). "predict" needs one more
            weight version than a stage keeps and is refused: the simulator runs it.
        compile: compile each of the stage's blocks with torch.compile (models/compile.py: regional,
            shared by the weight versions' replicas, eager with one warning if compiling fails).
        compile_scope: with ``compile``, "block" (each block alone) or "stage" (the stage's blocks
            but the model's head as one region, models/regions.py).
        compile_mode: with ``compile``, inductor's mode: "default" or "max-autotune" (kernel
            configurations benchmarked at compile time; no CUDA graphs).
        compile_options: with ``compile``, inductor config options on top of the mode's (names
            torch._inductor.config has; models/compile_support.check_inductor_options).
        head_loss: "plain" (``loss_fn`` of the last block's logits) or "fused" (the last block's
            matmul and cross entropy without whole logits, models/head_loss.py, by
            ``head_loss_kernel``: "auto", "liger", "cce" or "chunked").
        cuda_graphs: replay each microbatch's forward and backward from CUDA graphs (CUDA only, not
            with recompute or track_memory; models/graphs.py).
        compute_copies: under bf16, run the stage's linear layers on bf16 copies of their weights
            made once per weight version instead of autocast casting them every microbatch (the
            same numbers; compute_copies.py). With dp > 1 the copies announce their weights'
            gradients complete to the gradient buckets, whose all-reduce still overlaps the backward.
        gradient_accumulation_fusion: with the compute copies, each linear layer's weight-gradient
            product adds into the float32 gradient itself (main_grad.py: no bf16 rounding of each
            microbatch's weight gradient; cuBLAS on CUDA). With dp > 1 each product announces its
            weights' gradients complete to the buckets.
        z_loss: coefficient z >= 0 of the z-loss, z * mean(logsumexp(logits)^2) over the last stage's
            targets (PaLM's; 1e-4 there): added to the gradient of the last stage's loss, not to its
            value (models/z_loss.py), with either ``head_loss``; 0 = off.
        document_mask: a boundary token id: each position attends only to the earlier positions of
            its document, documents starting at that token in the microbatch's input ids
            (models/document_mask.py; every stage reads the input ids from ``batches``); for models
            whose attention reads the mask (the package's and its Hugging Face adapter's); not with
            ``cuda_graphs``. None = off.
        block_grad_norms: also each block's gradient norm (the clipping measurement's terms summed
            per block, step_exchange.norm_term_blocks): ``take_block_grad_norms``-style, in
            ``self.exchange.block_norms`` by step index; needs ``clip_grad_norm`` (math.inf: only
            measure).

    Tied weights (a Parameter used by several blocks, e.g. embedding and output head) are untied
    into one copy per use in ``model`` itself; the copies stay bitwise equal (ties.py).
    """

    def __init__(self, model, *, loss_fn: Callable, optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 schedule: str = "2bw", microbatches: int = 4, stages: int | None = None,
                 split_points: Sequence[int] | None = None, timeout_s: float | None = None, recv_ahead: int = 2,
                 device: str | torch.device | None = None, transport: str = "auto", run_id: str | None = None,
                 track_memory: bool = False, dp: int = 1, shard_optimizer: bool = True,
                 recompute: bool = False, dtype: str = "auto", on_nonfinite: str = "stop",
                 lr_schedule=None, clip_grad_norm: float | None = None, mitigation: str | None = None,
                 dc_lambda: float = DEFAULT_DC_LAMBDA, rescale_steps: int | None = None,
                 compile: bool = False, compile_scope: str = "block", compile_mode: str = "default",
                 compile_options: dict | None = None, head_loss: str = "plain",
                 head_loss_kernel: str = "auto", cuda_graphs: bool = False, compute_copies: bool = True,
                 gradient_accumulation_fusion: bool = False, z_loss: float = 0.0,
                 document_mask: int | None = None, block_grad_norms: bool = False):
        if schedule not in schedule_names(pipeline_only=True):
            raise ValueError(f"unknown schedule {schedule!r}; choose one of "
                             f"{', '.join(schedule_names(pipeline_only=True))}")
        check_arguments(optimizer=optimizer, loss_fn=loss_fn, microbatches=microbatches, stages=stages,
                         recv_ahead=recv_ahead, lr_schedule=lr_schedule, flags=dict(
                             track_memory=track_memory, shard_optimizer=shard_optimizer, recompute=recompute,
                             compile=compile, cuda_graphs=cuda_graphs, compute_copies=compute_copies,
                             gradient_accumulation_fusion=gradient_accumulation_fusion))
        z_loss = check_z_loss(z_loss)
        check_document_mask(document_mask, cuda_graphs, device if device is not None else "cpu")
        if not isinstance(block_grad_norms, bool):
            raise TypeError(f"block_grad_norms must be True or False, got {block_grad_norms!r}")
        if block_grad_norms and clip_grad_norm is None:
            raise ValueError("block_grad_norms sums the clipping measurement's norms per block: pass "
                             "clip_grad_norm (math.inf to measure without clipping)")
        if head_loss_kernel != "auto" and head_loss_kernel not in HEAD_LOSS_KERNELS:  # a typo, whatever the head
            raise ValueError(f"unknown head_loss_kernel {head_loss_kernel!r}; choose auto, {', '.join(HEAD_LOSS_KERNELS)}")
        if z_loss and head_loss == "fused":
            check_kernel_z_loss(head_loss_kernel, z_loss)
        if clip_grad_norm is not None:
            clip_grad_norm = check_max_norm(clip_grad_norm)
        spec = schedule_spec(schedule)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: launch with torchrun or "
                               "asyncpp_ext.pipeline.spawn, or call init_distributed() first")
        join_left_streams("before a new Pipeline starts")  # the start-up talks to the other ranks
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if not is_int(dp) or dp < 1 or world % dp:
            raise ValueError(f"dp must be a positive integer dividing the world size {world}, got {dp!r}")
        self.stages = world // dp if stages is None else stages
        if self.stages * dp != world:
            raise ValueError(f"{self.stages} stages x {dp} replicas need a world of {self.stages * dp} "
                             f"ranks, got {world}")
        spec.check(self.stages, microbatches)
        if spec.lag_per_stage and clip_grad_norm is not None:
            raise ValueError(f"clip_grad_norm is not supported with {schedule}: its stages finish a step "
                             "S-1 steps apart, so a global norm would stall them; use 2bw to clip")
        mitigation_settings = resolve_mitigation(mitigation, dc_lambda, rescale_steps)
        if mitigation_settings.name in SIMULATOR_ONLY_MITIGATIONS:
            raise MitigationError(f"mitigation {mitigation_settings.name!r} (weight prediction) needs one more weight "
                                  "version than a pipeline stage keeps; run it in the simulator (--simulate)")
        self.schedule, self.core_schedule, self.m = schedule, spec.core, microbatches
        timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s, f"timeout_s={timeout_s!r}")
        self.device = check_device(device)
        self.autocast_dtype = resolve_autocast(dtype, self.device)
        every_param = dtype in PARAMS_IN_COMPUTE_DTYPE  # every parameter computes in bf16 (bf16-params)
        transport = _choose_transport(transport, self.device)
        if transport == "nccl":  # before touching the device: say what to install or rebuild
            from .nccl import require_nccl
            require_nccl(need_gpu=True)
        if self.device.type == "cuda":
            if self.device.index is None:  # the worker thread needs the index (current device is per thread)
                self.device = torch.device("cuda", torch.cuda.current_device())
        if cuda_graphs and (self.device.type != "cuda" or recompute or track_memory):
            raise ValueError("cuda_graphs needs a CUDA device and neither recompute nor track_memory "
                             f"(device {self.device}, recompute={recompute}, track_memory={track_memory})")
        self.dp, self.layout = dp, Layout(self.stages, dp)
        self.replica, self.stage = self.layout.coords(self.rank)
        self.stage_ranks = self.layout.pipeline_ranks(self.replica)
        self.dp_group = create_dp_group(self.layout, self.rank)
        blocks = as_blocks(model)
        ties = find_ties(model, blocks)
        untie(blocks, ties)
        self.partition = split(blocks, self.stages, split_points)
        if spec.lag_per_stage:  # a tie across stages would join two weight versions
            check_ties_on_one_stage(ties, self.partition)
        self.block_indices = self.partition[self.stage]
        head = blocks[-1]
        if head_loss == "fused" and not all(hasattr(head, a) for a in ("features", "output_weight", "output_bias")):
            raise ValueError(f"head_loss='fused' needs a last block with features(x), output_weight and "
                             f"output_bias (the package's models' heads), not {type(head).__name__}; "
                             "use head_loss='plain'")
        module = BlockSequence(*[blocks[i] for i in self.block_indices]).to(self.device)
        regions = scope_regions(compile_scope, [self.block_indices], len(blocks), first=self.block_indices[0])
        mode = inductor_mode(compile_mode)  # a bad value is refused whether or not compile is on
        options = check_inductor_options(compile_options or {}, "compile_options") or None
        self.compile_report = (compile_regions(module, regions, device=self.device, mode=mode, options=options)
                               if compile else None)
        prefixes = block_prefixes(model, blocks, self.block_indices)
        self.param_names = [n for n, _ in GlobalView(module, prefixes).named_parameters()]
        # A mirror of a tied weight is updated by its owner, never by this stage's optimizer.
        self.mirror_of = {m: o for m, o in mirror_names(ties).items() if m in self.param_names}
        user_factory = optimizer

        def optimizer(stage_module):
            view = GlobalView(stage_module, prefixes, hidden=self.mirror_of)
            if not any(True for _ in view.parameters()):
                return None
            built = user_factory(view)
            if not isinstance(built, torch.optim.Optimizer):  # a factory without its return: nothing would train
                raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer; "
                                "return the optimizer it builds (lambda m: build_optimizer(m, 'adamw'))")
            return built
        # one norm per optimizer parameter: a stage's distinct parameters less its mirrors, each labelled
        # by its block
        term_blocks = norm_term_blocks(model, blocks, self.partition, ties)
        self.exchange = StepExchange(
            stage=self.stage, replica=self.replica, layout=self.layout, partition=self.partition, ties=ties,
            names=self.param_names, sizes=[p.numel() for p in module.parameters()],
            norm_terms_per_stage=[len(labels) for labels in term_blocks],
            clip_grad_norm=clip_grad_norm, timeout_s=timeout_s,
            term_blocks=term_blocks if block_grad_norms else None)
        self.host = StageHost(module, stage=self.stage, stages=self.stages, schedule=schedule,
                              microbatches=microbatches, optimizer_factory=optimizer, loss_fn=loss_fn,
                              batch_source=self._next_batch, track_memory=track_memory,
                              recompute=recompute, autocast_dtype=self.autocast_dtype,
                              on_nonfinite=on_nonfinite, param_names=self.param_names, lr_schedule=lr_schedule,
                              mitigation=mitigation_settings,
                              exchange=self.exchange if self.exchange.active else None,
                              dp_group=self.dp_group, dp=dp, shard_optimizer=shard_optimizer,
                              head_loss=head_loss, head_loss_kernel=head_loss_kernel, cuda_graphs=cuda_graphs,
                              compute_copies=compute_copies, params_in_compute_dtype=every_param,
                              gradient_accumulation_fusion=gradient_accumulation_fusion, z_loss=z_loss,
                              document_mask=document_mask, device=self.device)
        self.transport = None
        # Boundary tensors between the host and the transport; receive slots are reused.
        self.board = C.MessageBoard(self.host)
        self.timeout_s, self.recv_ahead = timeout_s, recv_ahead
        self.watchdog = Watchdog(timeout_s, f"rank {self.rank} (stage {self.stage})",
                                 pending=self._pending_transfers)
        # The executor shows the instruction in flight here; the watchdog reads it (no Python
        # call per instruction).
        self.progress = C.Progress()
        self.watchdog.follow(self.progress.snapshot)
        from .launch import tell_launcher
        self.watchdog.on_report = tell_launcher
        # the optimizer step's waits on other ranks: a stall there is a peer's
        self.host.watch_peer_waits(lambda what: self.watchdog.doing(what, True, instruction=False))
        self.transport = create_transport(transport, TransportContext(
            host=self.host, board=self.board, stage=self.stage, stages=self.stages, stage_ranks=self.stage_ranks,
            replica=self.replica, dp=dp, layout=self.layout, device=self.device, run_id=run_id,
            timeout_s=timeout_s, watchdog=self.watchdog))
        self._init_streams()

    def _pending_transfers(self) -> list:
        pending = getattr(self.transport, "pending_transfers", None)  # None while it is being set up
        return list(pending()) if callable(pending) else []
    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This stage's share of the run state, keyed by global parameter names (see simulate.py).
        A tied tensor is stored once, under its owner's name."""
        self._settle("state_dict")
        state = self.host.state_dict(self.param_names)
        for section in ("params", "stash", "older"):
            if section in state:
                state[section] = {n: t for n, t in state[section].items() if n not in self.mirror_of}
        state["clip"] = self.exchange.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a state written at any pipeline depth (or by the single-process simulator), or a
        checkpoint's shards merged (``asyncpp_ext.training.merge_engine_states``)."""
        state = dict(engine_state(state))  # checked before anything is touched
        self._settle("load_state_dict")
        for section in ("params", "stash", "older"):
            values = dict(state.get(section, {}))
            for mirror, owner in self.mirror_of.items():
                if owner in values:
                    values[mirror] = values[owner]
            state[section] = values
        self.host.load_state_dict(state, self.param_names)
        self.exchange.load_state_dict(state.get("clip"))
        self.next_step = int(state["steps_done"])

    def gather_weights(self, dst: int = 0) -> dict | None:
        """The whole model's newest weights W(t) on rank ``dst``: CPU tensors by global parameter
        name, a tied tensor once under its owner's name (as in checkpoints), for a freshly built
        model's ``load_state_dict(weights, strict=False)`` (``strict`` where nothing is tied) or an
        export (models/hf_export.py); None on the other ranks. Every rank calls it: a collective
        over the default group, to which replica 0's stages give theirs."""
        self._settle("gather_weights", check_whole=True)
        mine = {}
        if self.replica == 0:
            mine = {n: t.cpu() for n, t in newest_params(self.host, self.param_names).items()
                    if n not in self.mirror_of}
        parts = [None] * dist.get_world_size() if self.rank == dst else None
        dist.gather_object(mine, parts, dst=dst)
        if parts is None:
            return None
        return {name: tensor for part in parts for name, tensor in part.items()}

    # ---- start-up agreement (handshake.py) ---------------------------------------------------
    def _p2p(self, op, tensor: torch.Tensor, peer: int, what: str, tag: int = 0) -> None:
        p2p(op, tensor, stage=self.stage, stage_ranks=self.stage_ranks, peer=peer, what=what, tag=tag)


    # ---- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple], per_row: bool = False) -> float | list | None:
        """Mean loss of the newest weights over ``batches`` (microbatch-sized (x, y) pairs, of R*B
        sequences with dp = R: each replica evaluates its rows), run forward-only through the
        pipeline. Returns the loss on the last stages, None elsewhere. ``per_row``: instead, each
        row's summed cross entropy over its targets (models/base.row_losses), every row of every
        batch in order (a replica's with the others' gathered), on the last stages. A batch's
        sequences may be shorter than training's: the activations between the stages take its
        length (every rank holds the batch)."""
        self._settle("evaluate", check_whole=True)
        h = self.host
        model = h.compute_module(h.newest_version())  # what training computes with (its copies)
        losses = []
        with self.watchdog.armed("evaluation"):
            for i, (x, y) in enumerate(batches):
                if self.dp > 1:
                    x, y = replica_share(x, self.replica, self.dp), replica_share(y, self.replica, self.dp)
                if h.is_first:
                    a = x.to(self.device)
                else:  # evaluation messages travel over the (CPU) default process group
                    a = torch.empty(_batch_sig(h.in_sig, x).shape, dtype=h.in_sig.dtype)
                    self._p2p(dist.recv, a, self.stage - 1, "evaluation", _EVAL_TAG)
                    a = a.to(self.device)
                ids = x.to(self.device) if h.document_mask is not None else None  # what the mask is made of
                with h.autocast(), within_documents(ids, h.document_mask):
                    if h.is_last:
                        y = y.to(self.device)
                        loss = row_losses(list(model), a, y) if per_row else h.loss_of(model, a, y)
                    out = None if h.is_last else model(a)
                if h.is_last:
                    losses.append(loss.tolist() if per_row else float(loss))
                else:
                    h._check(out, _batch_sig(h.out_sig, x), "evaluation activation", self.next_step, i)
                    self._p2p(dist.send, out.contiguous().cpu(), self.stage + 1, "evaluation", _EVAL_TAG)
                self.watchdog.beat(f"evaluation batch {i}")
        if not (h.is_last and losses):
            return None
        if per_row:
            return self._gather_rows(losses)
        mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
        if self.dp > 1:  # equal shares: the global mean is the mean of the replicas' means
            dist.all_reduce(mean, group=self.dp_group)
            mean /= self.dp
        return float(mean.item())

    def _gather_rows(self, shares: list) -> list:
        """Every row's figure, batch by batch, from each replica's ``shares`` (its rows of each
        batch: replica_share's contiguous slices, in replica order)."""
        if self.dp == 1:
            return [x for share in shares for x in share]
        every = [None] * self.dp
        dist.all_gather_object(every, shares, group=self.dp_group)
        return [x for b in range(len(shares)) for replica in every for x in replica[b]]


def _batch_sig(sig: Signature, tokens: torch.Tensor) -> Signature:
    """The agreed activation signature with a batch's rows and sequence length (an evaluation's
    batch may be shorter than training's)."""
    return Signature((tokens.shape[0], tokens.shape[1], *sig.shape[2:]), sig.dtype)


def _choose_transport(transport: str, device: torch.device) -> str:
    transport = choose_transport(transport, device)
    if device.type != "cpu" and "gloo" not in str(dist.get_backend()):
        raise ValueError(f"the default process group uses backend {dist.get_backend()!r}, but the start-up "
                         "handshake sends CPU tensors: initialise it with 'gloo' or 'cpu:gloo,cuda:nccl'")
    return transport
