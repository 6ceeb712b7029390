"""Training runs: typed configuration (``config``), the step loop with metrics and checkpoints
(``trainer``, ``checkpoint``), the single-process reference of the update rules (``simulate``),
multi-process pipeline runs (``distributed``) and the ``asyncpp-train`` command (``cli``).

Imports run one way: training -> pipeline / optim / models / data -> bindings."""
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, merge_engine_states, save_checkpoint
from .config import ConfigError, RunConfig
from .simulate import DelaySimulator, default_loss
from .run_files import read_metrics
from .trainer import Trainer

__all__ = ["RunConfig", "ConfigError", "Trainer", "read_metrics", "DelaySimulator", "default_loss",
           "merge_engine_states", "CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
