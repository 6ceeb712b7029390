"""Activation recomputation and mixed precision for a stage's forward.

With recomputation a stage runs each microbatch's forward without building an autograd graph and
keeps only the stage input (plus the random-number state, so dropout-like layers draw the same
numbers again); right before that microbatch's backward it runs the forward again with the graph
and back-propagates through it. 2bw keeps up to S - stage microbatches in flight per stage, so
this trades one extra forward per microbatch for all but one microbatch's activations.
"""
from __future__ import annotations

import contextlib

import torch

from ..precision import auto_precision_name

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "bf16-params": torch.bfloat16}
PARAMS_IN_COMPUTE_DTYPE = ("bf16-params",)
"""The dtypes that compute from 16-bit copies of *every* parameter (activations, the residual stream
and the per-microbatch gradients 16-bit; float32 master weights, gradient accumulation and
optimizer state): the mixed precision of FSDP's ``param_dtype=bfloat16``. Plain "bf16" is autocast,
which keeps the residual stream and the norms in float32 (pipeline/compute_copies.py)."""


def autocast_context(device: torch.device, dtype: torch.dtype | None, cache: bool = True):
    """bf16 autocast on ``device`` (weights, gradients and optimizer state stay float32), or a
    no-op for full float32. ``cache=False`` turns off autocast's cache of cast weights, which CUDA
    graph capture refuses (models/graphs.py); the casts are the same, only not reused."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)


def resolve_autocast(dtype: str, device: torch.device) -> torch.dtype | None:
    """"auto" -> bf16 on CUDA, float32 on CPU (``precision.auto_precision_name``); "fp32" / "bf16" /
    "bf16-params" as asked (bf16 on CPU is allowed when asked for explicitly, but bf16 matrix
    products are very slow on most CPUs). None: no autocast."""
    if dtype == "auto":
        dtype = auto_precision_name(device)
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, fp32, bf16 or bf16-params")
    return AUTOCAST_DTYPES[dtype]


class RngState:
    """The CPU (and, on CUDA, that device's) generator state at a microbatch's first forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        """Run the body with the saved generator state; the caller's stream is left untouched."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


__all__ = ["AUTOCAST_DTYPES", "PARAMS_IN_COMPUTE_DTYPE", "autocast_context", "resolve_autocast", "RngState"]
