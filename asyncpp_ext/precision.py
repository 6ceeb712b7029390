"""What the "auto" precisions run as: bfloat16 on a CUDA device, float32 elsewhere.

One rule for a stage's autocast dtype (``--dtype auto``), a Muon-family optimizer's Newton-Schulz
dtype (``--ns-dtype auto``, ``ns_dtype=None``) and the resume check that compares both across
runs, so the three cannot drift apart. Why this rule: a GPU's bf16 tensor cores make bf16 the
fast choice there, while on most CPUs bf16 matrix products are slower than float32 ones.
"""
from __future__ import annotations

import torch


def auto_dtype(device) -> torch.dtype:
    """The dtype "auto" runs at on ``device`` (a ``torch.device`` or its name)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def auto_precision_name(device) -> str:
    """``auto_dtype`` by its command-line name: "bf16" or "fp32"."""
    return "bf16" if auto_dtype(device) == torch.bfloat16 else "fp32"


__all__ = ["auto_dtype", "auto_precision_name"]
