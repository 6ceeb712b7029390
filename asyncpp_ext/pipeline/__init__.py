"""Pipeline-parallel training over real processes (gloo on CPU)."""
from .data_parallel import Layout
from .launch import LaunchError, init_distributed, spawn, under_launcher
from .partition import PartitionError, balanced_split_points, split
from .arguments import split_minibatch
from .pipeline import Pipeline
from .streams import StepStats
from .stage import StageError

__all__ = ["Pipeline", "Layout", "StepStats", "spawn", "init_distributed", "under_launcher", "LaunchError",
           "PartitionError", "StageError", "split", "balanced_split_points", "split_minibatch"]
