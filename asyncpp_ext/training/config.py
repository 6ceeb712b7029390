"""Typed run configuration: what ``asyncpp-train`` writes to ``config.json`` and checkpoints keep.

``RunConfig.from_dict(RunConfig.to_dict(c)) == c``; ``validate()`` raises ``ConfigError`` naming the
field (``pipeline.microbatches``, ``optim.lr``...) and what to do about it.
"""
from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field, fields
from typing import Optional, Union

from ..data.batches import DEFAULT_EVAL_BATCHES
from ..models.compile_support import MODES as COMPILE_MODES  # TrainConfig.compile_mode's values
from ..models.registry import ModelConfig, as_model_config
from ..optim.lr_schedule import DECAY_SHAPES, LR_SCHEDULES
from ..optim.mitigations import DEFAULT_DC_LAMBDA, default_rescale_steps
from ..optim.registry import (DEFAULT_EF_SOURCE, DEFAULT_WEIGHT_DECAY, MUON_ADAMW_LR, MUON_MOMENTUM, DefaultsView,
                              muon_family, optimizer_names, optimizer_spec)
from ..pipeline.devices import TRANSPORTS
from ..schedule.table import SCHEDULES as SCHEDULE_TABLE, schedule_names
from .field_checks import ConfigError

SCHEDULES = schedule_names()
"""Every schedule a run can name (the schedule table, schedule/table.py; read there at validation
time, so a row added to the table is accepted here too)."""
NONFINITE_POLICIES = ("stop", "skip")
NONFINITE_CHECKS = ("auto", "host")
"""Where a one-process step's NaN/Inf check is decided (``TrainConfig.nonfinite_check``)."""
OPTIMIZERS = optimizer_names()
"""Every optimizer name, in display order (the registry's, optim/registry.py)."""
DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16", "bf16-params")
NS_DTYPES = ("auto", "fp32", "bf16")

# What a learning-rate schedule complaint calls each LRSchedule field: the flags that set them.
LR_SCHEDULE_FLAGS = {"kind": "--lr-schedule", "steps": "--steps", "warmup_steps": "--warmup-steps",
                     "decay_steps": "--decay-steps", "min_lr_ratio": "--min-lr-ratio",
                     "decay_shape": "--decay-shape"}
HEAD_LOSSES = ("auto", "fused", "plain", "liger", "cce", "chunked")
COMPILE_SCOPES = ("block", "stage")
DELAY_ONLY = ("matrices", "others")
"""Values of PipelineConfig.delay_only: the parameter set a simulated 2bw run delays."""
SYNC_SCHEDULES = tuple(n for n, spec in SCHEDULE_TABLE.items() if not spec.delayed())
"""Schedules without a weight delay (every computation on the newest weights)."""
MIN_TIMEOUT_S = 1.0
"""Shortest --timeout accepted: the start-up handshake and every collective wait under it."""
MAX_THREADS = 1024
"""Most intra-op threads a process may ask for (--threads): beyond the cores of any machine, and
the OpenMP runtime fails to create such counts (a crash, not a message)."""
EF_BETA_MAX = 2.0
"""Largest error-feedback strength accepted: beyond it the correction outweighs the update."""
MUON_FAMILY = muon_family()
"""Optimizers whose matrices run Muon's momentum (``optim.muon_momentum``): the registry's family "muon"."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """"builtin" (Python's standard library source), a UTF-8 text file, or a .bin token file
    (uint16 nanoGPT format, an llm.c / modded-nanogpt headered shard, or uint16/uint32 with the
    JSON sidecar asyncpp-prepare-data writes); or a glob, a directory of .bin shards or a shard
    manifest, read as one sequence in sorted order (data/shards.py)."""
    eval_fraction: float = 0.1
    """Share of the tokens, taken from the end, held out for evaluation (when val_source is None)."""
    val_source: Optional[str] = None
    """A separate evaluation file (same formats as ``source``); then all of ``source`` trains."""
    eval_batches: int = DEFAULT_EVAL_BATCHES
    """Number of evaluation batches (each of micro_batch_size windows) per evaluation; 0 = the run
    never evaluates (a throughput measurement: under ``--compile`` the first evaluation compiles
    each region's no-grad graph, seconds on a GPU)."""
    seed: Optional[int] = None
    """Seed of the batch order (``--data-seed``); None = ``train.seed``, which then seeds both the
    model's init and the order. Set apart, runs can share one while the other varies."""
    sampling: str = "random"
    """Order of the training windows: random (uniform starts, nanoGPT's way) | epoch (consecutive
    windows in a seeded permutation per epoch: no token trains twice within an epoch)."""
    eval_data: list = field(default_factory=list)
    """More held-out sets evaluated at every evaluation beside ``eval_loss`` (``--eval-data PATH``,
    repeated; same formats as ``source``): each row's ``eval_losses`` holds each one's loss by its
    file's name (build.set_names), as it does each ``mix`` source's held-out part's."""
    eval_choices: list = field(default_factory=list)
    """Multiple-choice task files (``--eval-choices FILE``, repeated; JSON lines of context, endings,
    label: HellaSwag's val file as it is) scored at every evaluation with the run's tokenizer: each
    row's ``choices`` holds each task's accuracy, accuracy_norm and right_loglik by its file's name
    (training/choice_eval.py)."""
    eval_choices_limit: Optional[int] = None
    """Score only the first this many examples of each ``eval_choices`` file; None = all."""
    mix: list = field(default_factory=list)
    """A weighted mixture of sources instead of ``source``: [path, weight] pairs (``--data-mix
    PATH=WEIGHT``; weights any positive numbers, normalised). Each minibatch takes each source's
    share of its windows, to within a window (data/mixture.py); each source holds out its own last
    ``eval_fraction``, and the eval set mixes them by the weights. [] = train on ``source``."""
    skip_batches: int = 0
    """This start only (``--skip-batches N``, with ``--resume``): the stream passes over its next N
    minibatches, so the run continues from the checkpoint's step on the data after them (the
    way past a loss spike: resume from a checkpoint before it, skip the batches around it). The
    checkpoints after it record the stream's position, so later resumes keep the skip."""
    change_mix: bool = False
    """This start only (``--change-data-mix``; not kept for the next resume): a resume whose ``mix``
    differs from the checkpoint's continues with the new mixture from the checkpoint's step (a new
    phase, e.g. an annealing mix for the final decay) instead of being refused; the same mixture
    continues as it was."""


LR_AUTO = DefaultsView("lr")
"""Learning rate per optimizer when ``OptimConfig.lr`` is None: a read-only live view of the
registry (optim/registry.py ``OPTIMIZERS``, where the values and the evidence for them live)."""
MUON_ADAMW_LR_AUTO = MUON_ADAMW_LR
"""The AdamW part of muon (embeddings, head, norms, biases) when ``adamw_lr`` is None (registry.py)."""

EF_BETA_AUTO = DefaultsView("ef_beta")
"""Error-feedback strength per optimizer when ``OptimConfig.ef_beta`` is None ("auto"): a read-only
live view of the registry (optim/registry.py ``OPTIMIZERS``, with the evidence for each value)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: adamw | muon | normuon | sgd | lion | adan | soap | mars (the last four need the
    `study` extra: pytorch-optimizer)."""
    lr: Optional[float] = None
    """Learning rate (of the Muon matrices for muon). None = the registry's default for the
    optimizer (``LR_AUTO[name]``; optim/registry.py): adamw 1e-3, muon 0.02, sgd 0.02, ..."""
    adamw_lr: Optional[float] = None
    """Learning rate of the AdamW part of muon (embeddings, head, norms, biases); None = 3e-3."""
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    """Decoupled weight decay."""
    decay_norms_and_biases: bool = True
    """Whether weight decay applies to tensors of fewer than 2 dimensions (norm gains, biases);
    False leaves them undecayed (optim/decay.py)."""
    decay_embeddings: bool = True
    """Whether weight decay applies to the embedding tables (and a head tied to them); False
    leaves them undecayed (optim/decay.py)."""
    ef_beta: Optional[float] = None
    """Error-feedback delay correction strength; 0 turns it off (no extra buffer). None = "auto":
    ``EF_BETA_AUTO[name]``: 0.5 for muon and adamw, 0 (off) for sgd, chosen from the delay study
    in docs/results.md ("Delay study"; the evidence is summarized at optim/registry.py ``OPTIMIZERS``)."""
    momentum: float = optimizer_spec("sgd").momentum
    """Momentum of sgd."""
    ns_dtype: str = "auto"
    """Dtype of muon's Newton-Schulz iteration: auto (bf16 on CUDA, where tensor cores make it
    cheap; fp32 on CPU) | fp32 | bf16. Independent of ``train.dtype``, which only sets autocast."""
    lr_schedule: str = "constant"
    """Learning-rate multiplier over the run: constant | cosine (to min_lr_ratio at the end) | wsd
    (warmup, stable, then a decay over decay_steps) | linear (warmup, then a decay over the rest);
    applied to every parameter group (Muon's and AdamW's parts alike). Formulas:
    optim/lr_schedule.py and docs/design.md."""
    warmup_steps: int = 0
    """Linear warmup steps at the start (any schedule)."""
    decay_steps: Optional[int] = None
    """wsd: length of the final decay; None = the schedule's default share of train.steps."""
    min_lr_ratio: Optional[float] = None
    """Final multiplier of cosine, wsd and linear; None = the schedule's default."""
    decay_shape: str = "linear"
    """The shape of wsd's and linear's decay: linear | 1-sqrt | cosine (optim/lr_schedule.py)."""
    clip_grad_norm: Optional[float] = None
    """Clip the gradient so its global norm is at most this, measured on the PREVIOUS step's
    gradient (docs/design.md: a norm over every stage that no stage waits for); None = off."""
    z_loss: float = 0.0
    """Coefficient z of the z-loss, z * mean(logsumexp(logits)^2) over the step's targets (PaLM's
    auxiliary loss, 1e-4 there): it keeps the softmax normaliser near 1 and the logits where bf16
    holds them. Added to the gradient, not to the logged ``loss`` (which stays the cross entropy, as
    ``eval_loss`` is); 0 = off (models/z_loss.py)."""
    ef_source: str = DEFAULT_EF_SOURCE
    """Where error feedback takes its previous update E: "buffer" (the optimizer's last raw
    update, kept in a buffer of its own) or "weights" (the applied update W(t) - W(t-1), read from
    the weight versions a delayed schedule keeps anyway: no extra memory; needs a delayed schedule,
    and a parameter with delay 0 gets no correction)."""
    mitigation: Optional[str] = None
    """Staleness mitigation: none | ef (error feedback, ``ef_beta``) | predict (forward and backward on
    W(t-d) + d (W(t-d) - W(t-d-1)); simulator only) | dc (the gradient plus dc_lambda g^2 (W(t) -
    W(t-d))) | lr-rescale (the lr times (1+d)^-max(0, 1 - t/rescale_steps)); optim/mitigations.py.
    None = "ef" when the effective ef_beta is > 0, else "none" (pinned by ``pin_auto_values``). A
    mitigation other than ef turns EF off; an explicit ef_beta > 0 with it is an error."""
    dc_lambda: float = DEFAULT_DC_LAMBDA
    """Strength lambda of the dc mitigation; 0.04 is DC-ASGD's constant setting."""
    rescale_steps: Optional[int] = None
    """K of lr-rescale: steps over which the delay's lr reduction fades out. None = max(1,
    train.steps // 10), pinned by ``pin_auto_values`` when lr-rescale runs."""
    muon_momentum: float = MUON_MOMENTUM
    """Momentum of the Muon matrices of muon and normuon (torch.optim.Muon's default 0.95)."""

    def ns_torch_dtype(self):
        """The ``ns_dtype=`` to pass to Muon: None for auto (Muon picks by device)."""
        import torch

        return {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[self.ns_dtype]

    def effective_lr(self) -> float:
        """The learning rate a run uses: ``lr``, or for None the optimizer's registry default."""
        return LR_AUTO[self.name] if self.lr is None else self.lr

    def effective_adamw_lr(self) -> Optional[float]:
        """The AdamW part's learning rate for muon and normuon: ``adamw_lr``, or for None the
        registry default (None for an optimizer without an AdamW part)."""
        return optimizer_spec(self.name).adamw_lr if self.adamw_lr is None else self.adamw_lr

    def effective_ef_beta(self) -> float:
        """The EF strength a run uses: ``ef_beta``; for None the optimizer's auto value, or 0 when
        another mitigation than ef was chosen."""
        if self.ef_beta is not None:
            return self.ef_beta
        if self.mitigation not in (None, "ef"):
            return 0.0
        return EF_BETA_AUTO.get(self.name, 0.0)

    def effective_mitigation(self) -> str:
        """The mitigation a run uses: ``mitigation``, or for None "ef" when EF is on, else "none"."""
        if self.mitigation is not None:
            return self.mitigation
        return "ef" if self.effective_ef_beta() > 0 else "none"

    def effective_rescale_steps(self, total_steps: int) -> int:
        """K of lr-rescale: ``rescale_steps``, or for None a tenth of the run's ``total_steps``."""
        return default_rescale_steps(total_steps) if self.rescale_steps is None else self.rescale_steps

    def pin_auto_values(self, total_steps: Optional[int] = None) -> None:
        """Replace each None ("auto") by the number it stands for today, so the run's config.json
        and checkpoints record it and a resumed run keeps it even if a later version changes a
        default. (adamw_lr only exists for muon and normuon; rescale_steps is pinned for
        lr-rescale when the run's ``total_steps`` is given.)"""
        self.lr = self.effective_lr()
        self.ef_beta = self.effective_ef_beta()
        self.mitigation = self.effective_mitigation()
        if self.name in MUON_FAMILY:
            self.adamw_lr = self.effective_adamw_lr()
        if self.mitigation == "lr-rescale" and total_steps is not None:
            self.rescale_steps = self.effective_rescale_steps(total_steps)


@dataclass
class PipelineConfig:
    schedule: str = "2bw"
    """sync | gpipe | 1f1b (no delay), 2bw (one-step weight delay, no flush) or pipedream (one
    microbatch per step, stage s delayed by stages-1-s steps; docs/design.md §1.16)."""
    stages: int = 1
    """Pipeline stages (processes); at most the model's number of blocks (n_layer + 2)."""
    microbatches: int = 4
    """Microbatches m per step (minibatch); 2bw needs m >= stages."""
    micro_batch_size: int = 8
    """Sequences per microbatch B, per data-parallel replica (a step consumes m * dp * B)."""
    dp: int = 1
    """Data-parallel replicas R of the pipeline (world = stages * dp processes). Each global
    microbatch of dp * B sequences is split in rows among the replicas, so a run equals the dp=1 run
    with micro_batch_size dp * B."""
    shard_muon: bool = True
    """With dp > 1: each replica orthogonalises a share of the stage's Muon matrices (same result)."""
    recompute: bool = False
    """Recompute each stage's forward right before its backward instead of keeping activations."""
    transport: str = "auto"
    """How pipeline messages travel between the stage processes: auto (nccl on cuda, socket on
    cpu) | nccl (the C++ NCCL transport; cuda, one GPU per rank) | torch (torch.distributed
    isend/irecv on a group per link and direction: NCCL on cuda, one GPU per rank; gloo on cpu) |
    gloo (on cuda staged through host memory, so ranks may share a GPU) | socket (the C++ TCP
    transport; cpu) | ipc (stages on one host share memory: CUDA IPC, so ranks may share a GPU
    without host copies; POSIX shared memory on cpu). All give the same numbers."""

    delay: Optional[int] = None
    """Simulator research knob: a constant K-step delay for every parameter (2bw is K = 1); only
    with schedule 2bw under train.simulate. None = the schedule's own delay."""
    delay_only: Optional[str] = None
    """Simulator research knob: delay only "matrices" (the parameters Muon updates) or only
    "others" (embeddings, head, norms, biases: the AdamW part), the rest computing on the newest
    weights; only with schedule 2bw under train.simulate. None = every parameter delayed."""

    @property
    def global_micro_batch_size(self) -> int:
        """Sequences per microbatch over all replicas: what the data stream draws."""
        return self.dp * self.micro_batch_size


@dataclass
class TrainConfig:
    steps: int = 200
    """Total optimizer steps of the run (a resumed run continues up to this many)."""
    seed: int = 0
    """Seed of the model init and of the batch order."""
    eval_every: int = 50
    """Evaluate the held-out loss every this many steps (and at the last step); 0 = only last.
    ``data.eval_batches = 0``: never."""
    ckpt_every: int = 100
    """Checkpoint every this many steps (and at the last step); 0 = only last. ``checkpoints``
    False: never."""
    checkpoints: bool = True
    """Write checkpoints at all (``ckpt_every`` says when); False = none, not even at the end: a
    throughput or smoke run that nothing will resume (the final save of weights and optimizer
    state, 1.6 GB at smollm-135m with AdamW, and its checksum take seconds)."""
    async_checkpoints: Optional[bool] = None
    """Write each checkpoint in a background thread while training goes on (async_checkpoint.py):
    the loop waits only for a copy of the state in host memory. None = on for cuda (where that
    copy is the device-to-host one a checkpoint makes anyway), off on cpu (where it is a second
    copy of the state). The files are the same either way."""
    keep_checkpoints: Optional[int] = None
    """How many of the newest checkpoints a run directory keeps: once a checkpoint is complete, the
    older ones past this count are removed (a smollm-360m checkpoint with AdamW state is ~6 GB, one
    every ``ckpt_every`` steps). None = every one."""
    out: str = "runs/asyncpp"
    """Run directory: metrics.jsonl, config.json, loss.png, ckpt-NNNNNN/."""
    resume: Optional[str] = None
    """Run directory to continue from its latest checkpoint (None = fresh run)."""
    auto_resume: bool = False
    """Started with ``--auto-resume``: a start (its --out had no checkpoint) that may take over the
    rows of an earlier attempt which wrote none, dropping them; a resume is a plain one."""
    init_from: Optional[str] = None
    """A checkpoint directory (ckpt-NNNNNN) whose newest weights a fresh run's model starts from
    instead of the seed's initialisation: a new phase of training (other data, learning rates,
    schedule, optimizer); the optimizer state, the step count, the batch order and the lr schedule
    start anew. Its model must be this run's (``init_from_mismatch``). ``--init-from`` takes a run
    directory too and stores its latest checkpoint here; a resumed run's weights come from its own
    checkpoint instead."""
    device: str = "cpu"
    """cpu | cuda."""
    dtype: str = "auto"
    """auto (bf16 autocast on cuda, fp32 on cpu) | fp32 | bf16 (autocast; weights, gradients and
    optimizer state stay fp32; allowed on cpu when asked for, but slow there) | bf16-params (every
    parameter copied to bf16 once per weight version and the whole forward and backward computed in
    bf16 -- activations, residual stream, per-microbatch gradients -- with fp32 master weights,
    gradient accumulation and optimizer state: FSDP's param_dtype=bf16; pipeline/compute_copies.py)."""
    simulate: bool = False
    """Run the single-process delay simulator instead of the multi-process pipeline."""
    progress: bool = True
    """Show a progress bar (only when stderr is a terminal)."""
    log_grad_norm: bool = False
    """Measure each step's global gradient norm (before clipping) for the metrics rows'
    ``grad_norm`` also without ``--clip-grad-norm`` (which always measures it): the same
    measurement clipping makes, at its cost, leaving the gradients as they are."""
    log_block_grad_norms: bool = False
    """Also each block's gradient norm (the rows' ``grad_norms``: {block name: norm}, ``embed``,
    ``layers.0``, ..., ``head``): the same measurement as ``grad_norm``, summed per block -- which
    layer a spike comes from. Measures as ``log_grad_norm`` does where nothing clips."""
    log_every: int = 0
    """Print a line on stdout every this many steps (loss, lr, tokens/s, MFU, ETA) and each
    evaluation's loss, for logs no progress bar reaches (a batch job's); 0 = none (step_lines.py)."""
    timeout_s: float = 300.0
    """Seconds without any completed pipeline instruction after which every rank reports what it
    was doing and aborts (the watchdog); also the collectives' timeout. 300 s covers a slow CPU
    step and still ends a hung GPU run within minutes. ``ASYNCPP_TIMEOUT`` overrides the default."""
    on_nonfinite: str = "stop"
    """NaN/Inf loss or gradient: "stop" the run naming stage and step, or "skip" that step's update
    on every stage (recorded as ``"skipped": true`` in its metrics row)."""
    nonfinite_check: str = "auto"
    """Where a one-process step learns whether to skip its update: "auto" queues the optimizer
    before the host reads the gradients' scan, its fused kernels skipping a bad step on the device,
    wherever that applies (docs/design.md §1.9); "host" reads the scan first, then steps -- the
    same numbers, for measuring what the device-side skip is worth."""
    tensorboard: bool = False
    """Also write TensorBoard events (loss, eval loss, lr, tokens/s, each stage's compute and wait
    shares) under the run directory's tensorboard/ (needs ``pip install 'asyncpp_ext[tensorboard]'``)."""
    wandb: bool = False
    """Also log the metrics rows to Weights & Biases (wandb_log.py; needs ``pip install
    'asyncpp_ext[wandb]'``; W&B's environment, e.g. ``WANDB_MODE=offline``, applies)."""
    wandb_project: str = "asyncpp"
    """The W&B project the run logs to (``--wandb-project``)."""
    time_limit_s: Optional[float] = None
    """Wall-clock budget of the command, from its start, in seconds (``--time-limit``, e.g. a
    batch job's limit less a margin): the last segment is sized to end, with its checkpoint,
    before it passes, and the run stops there to be resumed (time_limit.py). None = no limit."""
    stop_signal: Optional[str] = None
    """A signal (``--stop-on-signal``: "SIGUSR1", "SIGUSR2" or "SIGTERM") on which the run stops at
    the end of its current segment with a checkpoint, to be resumed: a batch system's warning
    before its time limit or a preemption (stop_request.py). None = the signal's usual effect."""
    signal_response_s: float = 30.0
    """With ``stop_signal``: the longest a segment may train (``--signal-response``), so the run
    reaches its stop within about this long after the signal, plus an evaluation and the
    checkpoint. Each segment end costs a pipeline drain; steps longer than this make one-step
    segments."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one of the run's devices, for the MFU in metrics.jsonl and the summary line
    (models/flops.py: model TFLOP/s / (devices x peak)). None: on cuda the dense bf16 peak of the
    GPU's name where the table knows it; on cpu no MFU (the model TFLOP/s are written anyway)."""
    threads: Optional[int] = None
    """Intra-op threads per process (``torch.set_num_threads``). None: each rank of a multi-process
    run takes the machine's cores divided by stages x dp, a one-process run keeps torch's default.
    Float summation order in a matrix product can depend on it, so a run reproduces another's
    numbers bitwise only at the same count (e.g. a pipeline and its ``--simulate`` run)."""
    compile: Optional[bool] = None
    """Compile each block with torch.compile (regional compilation, models/compile.py). None =
    auto: on for CUDA where torch can compile, off on CPU (a first compile there costs ~25-60 s per
    run start and the small CPU models gain little). Changes losses only at float rounding."""
    compile_scope: str = "block"
    """What one compiled region covers: block (each block alone, one graph per block type: the
    shortest compile) | stage (a stage's blocks but the head as one region: one compiled call per
    microbatch and stage, fusion across block boundaries, a longer compile; models/regions.py).
    Takes effect where blocks are compiled."""
    compile_mode: str = "default"
    """Inductor's mode for the compiled regions: default | max-autotune (GEMM templates and
    kernel configurations benchmarked on the device at compile time, coordinate-descent tuning;
    minutes more compile, and slower on an H100 with torch 2.11 at smollm-360m: 0.92x, docs/gpu.md;
    its CUDA graphs stay off, models/compile.py). Takes effect where blocks are compiled."""
    inductor_options: dict = field(default_factory=dict)
    """Inductor config options for the compiled regions, on top of the mode's (``--inductor-option
    NAME=VALUE``, e.g. ``max_pointwise_cat_inputs=0``: every concatenation its own kernel); names
    torch._inductor.config has, plain values; ``freezing`` and ``triton.cudagraphs`` stay off
    (models/compile.py). Set alike in a pipeline and its --simulate run. Takes effect where blocks
    are compiled."""
    head_loss: str = "auto"
    """How the last block computes its loss: plain (logits, then cross entropy) | fused (the head's
    matmul and cross entropy chunk by chunk, the logits never whole in memory; Liger-Kernel or
    cut-cross-entropy on CUDA where installed, else the package's own chunked kernel) | liger | cce
    (fused with that library kernel; CUDA, its extra installed) | chunked (fused with the package's
    own kernel whatever is installed: the same numbers with CUDA graphs and without) | auto (fused when the vocabulary
    has >= 8192 ids, else plain; models/head_loss.py)."""
    attention: str = "auto"
    """Which kernel scaled-dot-product attention runs on CUDA: cudnn (first; a shape it cannot serve
    runs on the next, in torch's order) | flash (cuDNN's kernels off) | auto (cudnn on Hopper GPUs,
    where its kernels are the faster; torch's own choice elsewhere). Off CUDA torch chooses
    (models/attention.py)."""
    document_mask: Optional[Union[int, str]] = None
    """Attend within documents: a position attends only to the earlier positions of its own
    document, documents starting at a boundary token (models/document_mask.py). None = off (every
    earlier position of the window); "data" = the boundary token the data's sidecars record
    (asyncpp-prepare-data --doc-boundary eos|bos); an int = that token id. Not with CUDA graphs."""
    cuda_graphs: Optional[bool] = None
    """Replay each microbatch's forward and backward from CUDA graphs (models/graphs.py): one launch
    per graph instead of one per kernel, for host-bound small models. CUDA only; not with
    --recompute, nor with --simulate of a schedule with delays. None = auto: on for --schedule sync
    on CUDA (measured on an H100: 2.17x the tokens/s of smollm-135m's step without them) unless
    --recompute or a liger/cce head kernel rules it out; off for pipelines and their simulations
    (opt-in there: two stages sharing one H100 gained nothing from them) and on CPU
    (training/stage_compute.resolve_cuda_graphs)."""
    compute_copies: bool = True
    """Under bf16: keep a bf16 copy of every nn.Linear weight per weight version, refreshed when the
    weights change, and run the blocks on it (pipeline/compute_copies.py), instead of autocast
    casting each weight every microbatch and widening its gradient back. The same numbers bit for
    bit; fewer kernels, and 2 bytes per copied parameter per held version. With --dp > 1 the copies
    tell the gradient buckets when each weight's gradient is complete, so their all-reduce still
    overlaps the backward."""
    gradient_accumulation_fusion: bool = False
    """With the compute copies: each linear layer's weight-gradient product adds into the float32
    gradient itself (cuBLAS's GEMM with beta = 1 on CUDA; pipeline/main_grad.py) instead of writing a
    bf16 gradient that a second kernel adds after every microbatch. More precise than autocast's (no
    bf16 rounding of each microbatch's weight gradient), so not its numbers bit for bit; real ==
    --simulate as ever. Needs bf16 compute copies."""
    profile_steps: Optional[str] = None
    """"FIRST:LAST": trace those steps with torch.profiler into OUT/profile/ (a trace, the operator
    table, and the device-busy share and kernel time by kind; training/profiling.py). None = off."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        self.model = as_model_config(self.model)

    def to_dict(self) -> dict:
        self.model = as_model_config(self.model)
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        """Build from ``to_dict`` output; unknown sections or fields raise ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        sections = {f.name: f.type for f in fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(unknown)}; "
                              f"known: {sorted(sections)}")
        built = {}
        for f in fields(cls):
            section_cls = type(getattr(cls(), f.name))
            values = data.get(f.name, {})
            if not isinstance(values, dict):
                raise ConfigError(f"config section {f.name!r} must be an object")
            known = {sf.name for sf in fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ConfigError(f"unknown field(s) {', '.join(f'{f.name}.{b}' for b in sorted(bad))}"
                                  f"; known: {sorted(known)}")
            built[f.name] = section_cls(**values)
        return cls(**built)

    def lr_schedule(self):
        """The run's learning-rate schedule (optim/lr_schedule.py)."""
        from ..optim.lr_schedule import LRSchedule

        o = self.optim
        extra = {k: v for k, v in (("decay_steps", o.decay_steps), ("min_lr_ratio", o.min_lr_ratio))
                 if v is not None}
        return LRSchedule(kind=o.lr_schedule, steps=self.train.steps, warmup_steps=o.warmup_steps,
                          decay_shape=o.decay_shape, **extra)

    def mitigation_kwargs(self) -> dict:
        """``mitigation``, ``dc_lambda``, ``rescale_steps`` for DelaySimulator and Pipeline: the
        effective mitigation, and K resolved against train.steps for lr-rescale."""
        o = self.optim
        mitigation = o.effective_mitigation()
        return dict(mitigation=mitigation, dc_lambda=o.dc_lambda,
                    rescale_steps=o.effective_rescale_steps(self.train.steps) if mitigation == "lr-rescale" else None)

    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains: microbatches x global micro-batch (all replicas) x seq_len."""
        p = self.pipeline
        return p.microbatches * p.global_micro_batch_size * self.model.seq_len

    def writes_checkpoints_async(self) -> bool:
        """``train.async_checkpoints`` resolved: None = on for cuda."""
        t = self.train
        return t.async_checkpoints if t.async_checkpoints is not None else t.device == "cuda"

    def data_seed(self) -> int:
        """The batch order's seed: ``data.seed``, or ``train.seed`` when it is None."""
        return self.train.seed if self.data.seed is None else self.data.seed

    def grad_norm_limit(self) -> Optional[float]:
        """What the engines' ``clip_grad_norm`` gets: the clipping threshold, ``math.inf`` to only
        measure the norms (``train.log_grad_norm``), or None (neither)."""
        if self.optim.clip_grad_norm is not None:
            return self.optim.clip_grad_norm
        return math.inf if self.train.log_grad_norm or self.train.log_block_grad_norms else None

    def runs_multi_process(self) -> bool:
        """A pipeline or data-parallel run that is not simulated: one process per stage and replica."""
        return (self.pipeline.stages > 1 or self.pipeline.dp > 1) and not self.train.simulate

    def validate(self) -> None:
        """Raise ConfigError naming the first field that cannot run (config_rules.check_run)."""
        from .config_rules import check_run

        check_run(self)


__all__ = ["SCHEDULES", "SYNC_SCHEDULES", "EF_BETA_MAX", "MUON_FAMILY", "NONFINITE_POLICIES", "NONFINITE_CHECKS", "OPTIMIZERS", "DEVICES", "DTYPES", "TRANSPORTS", "EF_BETA_AUTO", "LR_AUTO", "MUON_ADAMW_LR_AUTO", "LR_SCHEDULES", "DECAY_SHAPES", "ConfigError", "ModelConfig", "DataConfig",
           "OptimConfig", "PipelineConfig", "TrainConfig", "RunConfig",
           "COMPILE_SCOPES", "COMPILE_MODES"]
