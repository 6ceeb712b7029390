"""Pipeline-parallel training over real processes (gloo on CPU)."""
from .data_parallel import Layout
from .launch import LaunchError, init_distributed, spawn, under_launcher
from .partition import PartitionError, balanced_split_points, split
from .pipeline import Pipeline, StepStats, split_minibatch
from .stage import StageError

__all__ = ["Pipeline", "Layout", "StepStats", "spawn", "init_distributed", "under_launcher", "LaunchError",
           "PartitionError", "StageError", "split", "balanced_split_points", "split_minibatch"]
