"""The real-compute workload shared by bench/real_compute.py and bench/memory.py: a preset GPT, its
stage split, token minibatches from the built-in corpus, and the AdamW factory every run uses.

Every rank builds the same model from the same seed, so our runtime and torch's see identical
stage modules; both take the split from ``asyncpp_ext.pipeline.split`` (balanced parameter counts).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncpp_ext.data import BatchStream, load_tokens  # noqa: E402
from asyncpp_ext.models import GPT, preset_config  # noqa: E402
from asyncpp_ext.optim import build_optimizer  # noqa: E402
from asyncpp_ext.pipeline import split  # noqa: E402

MODELS = ("tiny", "small")
LR, WEIGHT_DECAY = 1e-3, 0.1
SEED = 0


def build_gpt(model: str) -> GPT:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return GPT(preset_config(model), seed=SEED)


def stage_module(gpt: GPT, stages: int, stage: int) -> nn.Sequential:
    """This stage's blocks, split exactly as ``Pipeline`` splits them by default."""
    blocks = gpt.blocks()
    return nn.Sequential(*[blocks[i] for i in split(blocks, stages)[stage]])


def adamw_factory(ef_beta: float = 0.0):
    """The optimizer of every run: the project's fused AdamW (EF on when ef_beta > 0)."""
    return lambda module: build_optimizer(module, "adamw", lr=LR, weight_decay=WEIGHT_DECAY, ef_beta=ef_beta)


def minibatches(model: str, microbatches: int, micro_batch_size: int, concatenated: bool = False):
    """Endless minibatches: a list of m (inputs, targets) pairs, or, with ``concatenated``, one
    (m*B, T) pair (what torch's schedules split themselves)."""
    cfg = preset_config(model)
    stream = BatchStream(load_tokens("builtin"), microbatches=microbatches,
                         micro_batch_size=micro_batch_size, seq_len=cfg.seq_len, seed=SEED)
    for batch in stream:
        if concatenated:
            yield torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])
        else:
            yield batch


def tokens_per_step(model: str, microbatches: int, micro_batch_size: int) -> int:
    return microbatches * micro_batch_size * preset_config(model).seq_len


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
