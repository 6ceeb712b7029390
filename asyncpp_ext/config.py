"""Typed run configuration: what ``asyncpp-train`` writes to ``config.json`` and checkpoints keep.

``RunConfig.from_dict(RunConfig.to_dict(c)) == c``; ``validate()`` raises ``ConfigError`` naming the
field (``pipeline.microbatches``, ``optim.lr``...) and what to do about it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from .models import GPTConfig

SCHEDULES = ("sync", "gpipe", "1f1b", "2bw")
NONFINITE_POLICIES = ("stop", "skip")
OPTIMIZERS = ("adamw", "muon", "sgd")
DEVICES = ("cpu", "cuda")

ModelConfig = GPTConfig
"""The model section is the GPT's own shape config."""


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the field."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """"builtin" (Python's standard library source), a UTF-8 text file, or a uint16 .bin file."""
    eval_fraction: float = 0.1
    """Share of the tokens, taken from the end, held out for evaluation."""
    eval_batches: int = 4
    """Number of evaluation batches (each of micro_batch_size windows) per evaluation."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer: adamw | muon | sgd."""
    lr: float = 1e-3
    """Learning rate (of the Muon matrices for muon). AdamW without warmup stalls on a plateau
    near the byte-unigram loss at 3e-3 on the small preset; 1e-3 trains both presets well."""
    adamw_lr: Optional[float] = None
    """Learning rate of the AdamW part of muon (embeddings, head, norms, biases); None = lr."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    ef_beta: float = 0.0
    """Error-feedback delay correction strength; 0 turns it off (no extra buffer)."""
    momentum: float = 0.9
    """Momentum of sgd."""


@dataclass
class PipelineConfig:
    schedule: str = "2bw"
    """sync | gpipe | 1f1b (no delay) or 2bw (one-step weight delay, no flush)."""
    stages: int = 1
    """Pipeline stages (processes); at most the model's number of blocks (n_layer + 2)."""
    microbatches: int = 4
    """Microbatches m per step (minibatch); 2bw needs m >= stages."""
    micro_batch_size: int = 8
    """Sequences per microbatch B."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Total optimizer steps of the run (a resumed run continues up to this many)."""
    seed: int = 0
    """Seed of the model init and of the batch order."""
    eval_every: int = 50
    """Evaluate the held-out loss every this many steps (and at the last step); 0 = only last."""
    ckpt_every: int = 100
    """Checkpoint every this many steps (and always at the last step); 0 = only last."""
    out: str = "runs/asyncpp"
    """Run directory: metrics.jsonl, config.json, loss.png, ckpt-NNNNNN/."""
    resume: Optional[str] = None
    """Run directory to continue from its latest checkpoint (None = fresh run)."""
    device: str = "cpu"
    """cpu | cuda."""
    simulate: bool = False
    """Run the single-process delay simulator instead of the multi-process pipeline."""
    progress: bool = True
    """Show a progress bar (only when stderr is a terminal)."""
    timeout_s: float = 300.0
    """Seconds without any completed pipeline instruction after which every rank reports what it
    was doing and aborts (the watchdog); also the collectives' timeout. 300 s covers a slow CPU
    step and still ends a hung GPU run within minutes. ``ASYNCPP_TIMEOUT`` overrides the default."""
    on_nonfinite: str = "stop"
    """NaN/Inf loss or gradient: "stop" the run naming stage and step, or "skip" that step's update
    on every stage (recorded as ``"skipped": true`` in its metrics row)."""


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
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

    def validate(self) -> None:
        """Raise ConfigError naming the first field that cannot run."""
        try:
            self.model.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _positive_int("pipeline.stages", self.pipeline.stages)
        _positive_int("pipeline.microbatches", self.pipeline.microbatches)
        _positive_int("pipeline.micro_batch_size", self.pipeline.micro_batch_size)
        _positive_int("train.steps", self.train.steps)
        _non_negative_int("train.eval_every", self.train.eval_every)
        _non_negative_int("train.ckpt_every", self.train.ckpt_every)
        _non_negative_int("data.eval_batches", self.data.eval_batches)
        if not isinstance(self.train.seed, int) or self.train.seed < 0:
            raise ConfigError(f"train.seed must be a non-negative integer, got {self.train.seed!r}")
        _choice("pipeline.schedule", self.pipeline.schedule, SCHEDULES)
        _choice("optim.name", self.optim.name, OPTIMIZERS)
        _choice("train.device", self.train.device, DEVICES)
        _choice("train.on_nonfinite", self.train.on_nonfinite, NONFINITE_POLICIES)
        _positive_number("train.timeout_s", self.train.timeout_s)
        if self.train.timeout_s == float("inf"):
            raise ConfigError("train.timeout_s must be a finite number of seconds, got inf")
        _positive_number("optim.lr", self.optim.lr)
        if self.optim.adamw_lr is not None:
            _positive_number("optim.adamw_lr", self.optim.adamw_lr)
        _non_negative_number("optim.weight_decay", self.optim.weight_decay)
        _non_negative_number("optim.ef_beta", self.optim.ef_beta)
        _non_negative_number("optim.momentum", self.optim.momentum)
        if not 0 < self.data.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be in (0, 1), got {self.data.eval_fraction}")
        blocks = self.model.num_blocks
        if self.pipeline.stages > blocks:
            raise ConfigError(f"pipeline.stages={self.pipeline.stages} exceeds the model's {blocks} "
                              f"blocks (n_layer {self.model.n_layer} + embedding + head); use "
                              f"--stages <= {blocks} or a deeper model (--n-layer)")
        if self.pipeline.schedule == "2bw" and self.pipeline.microbatches < self.pipeline.stages:
            raise ConfigError(f"pipeline.microbatches={self.pipeline.microbatches} is fewer than "
                              f"pipeline.stages={self.pipeline.stages}; 2bw needs microbatches >= "
                              "stages: raise --microbatches or lower --stages")


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _non_negative_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


def _positive_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


def _non_negative_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a non-negative number, got {value!r}")


def _choice(name, value, options):
    if value not in options:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(options)}")


# Fields that change the numbers a run produces: a checkpoint resumed under a different value of
# any of them would not continue the same run. (stages may differ: checkpoints are keyed by global
# parameter names, and the update semantics do not depend on the split.)
RESUME_MUST_MATCH = (
    [f"model.{f.name}" for f in fields(GPTConfig)]
    + [f"data.{f.name}" for f in fields(DataConfig)]
    + [f"optim.{f.name}" for f in fields(OptimConfig)]
    + ["pipeline.schedule", "pipeline.microbatches", "pipeline.micro_batch_size", "train.seed"]
)


def get_field(cfg: RunConfig, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


__all__ = ["SCHEDULES", "NONFINITE_POLICIES", "OPTIMIZERS", "DEVICES", "ConfigError", "ModelConfig", "DataConfig",
           "OptimConfig", "PipelineConfig", "TrainConfig", "RunConfig", "RESUME_MUST_MATCH",
           "get_field"]
