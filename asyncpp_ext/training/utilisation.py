"""Model TFLOP/s and MFU of a run's steps, for metrics.jsonl and the summary line.

model TFLOP/s = tokens/s (every replica's) x the model's FLOPs per token (models/flops.py, the
PaLM convention); MFU = model TFLOP/s / (devices x the peak of one). The devices are the GPUs the
run's ranks use (ranks sharing a GPU count it once), or for a CPU run one per machine; the peak is
``--peak-tflops``, else on cuda the dense bf16 peak of the GPU's name (an H100 989 TFLOP/s), else
unknown -- then only the TFLOP/s are written.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..models.flops import peak_tflops
from ..pipeline.devices import local_world_size
from ..pipeline.launch import launcher
from .config import RunConfig

SIGNIFICANT = 4
"""Significant digits the metrics keep of each figure."""


def devices_in_use(cfg: RunConfig) -> int:
    """How many devices the run computes on: distinct GPUs over all machines on cuda (ranks beyond a
    machine's GPUs share them), machines on cpu."""
    ranks = 1 if cfg.train.simulate else cfg.pipeline.stages * cfg.pipeline.dp
    local = local_world_size(launcher(), ranks, os.environ) if ranks > 1 else 1
    machines = max(1, ranks // local)
    if cfg.train.device != "cuda":
        return machines
    return machines * min(local, max(1, torch.cuda.device_count()))


def run_peak_tflops(cfg: RunConfig, device: torch.device) -> Optional[float]:
    """The peak TFLOP/s of all the run's devices together, or None when one device's is unknown."""
    one = cfg.train.peak_tflops
    if one is None and device.type == "cuda":
        one = peak_tflops(torch.cuda.get_device_name(device))
    return None if one is None else one * devices_in_use(cfg)


def _rounded(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT}g}")


def step_figures(tokens_per_s: Optional[float], flops_per_token: Optional[float],
                 peak: Optional[float]) -> dict:
    """``{"tflops": ..., "mfu": ...}`` of a step (each where it is known) for its metrics row."""
    if not tokens_per_s or not flops_per_token:
        return {}
    tflops = tokens_per_s * flops_per_token / 1e12
    return {"tflops": _rounded(tflops), **({"mfu": _rounded(tflops / peak)} if peak else {})}


__all__ = ["devices_in_use", "run_peak_tflops", "step_figures"]
