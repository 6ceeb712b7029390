"""Which kernel ``F.scaled_dot_product_attention`` runs on CUDA: ``--attention auto|cudnn|flash``.

On Hopper (compute capability 9.x) cuDNN's fused attention kernels are the faster ones for
training shapes: bench/attention_kernels.py measured 1.47x FlashAttention-2's forward + backward
at smollm-360m's shape on an H100 (docs/gpu.md). torch chooses among its SDPA backends by a
priority list and per-shape rules of its own, which differ between versions (torch 2.11 already
runs cuDNN's kernels in our compiled SmolLM blocks on an H100, though its list puts flash first).
``--attention`` pins the choice instead:

- ``cudnn``: cuDNN first, then the others in torch's order (a shape cuDNN cannot serve, or
  deterministic algorithms, fall through to the next);
- ``flash``: cuDNN's kernels off, flash first, then the others in torch's order;
- ``auto``: cudnn on Hopper GPUs, flash on other CUDA GPUs; off CUDA torch chooses (the CPU has
  neither kernel).

The choice is process-wide torch state, read when a call picks its kernel: for compiled blocks
when they are traced, for CUDA graphs when they are captured. A run therefore holds it for its
whole length (``attention_preference``), set alike in a pipeline's ranks and in its ``--simulate``
run, and restores the caller's on exit.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

ATTENTION_BACKENDS = ("auto", "cudnn", "flash")
"""The ``--attention`` values (the module's docstring says what each does)."""


def resolve_attention(name: str, device) -> str:
    """``name`` for ``device``: "cudnn" or "flash" on CUDA ("auto" by the device's generation),
    "default" off CUDA (torch's own choice; the CPU has neither kernel). ValueError (one line)
    for an explicit cudnn or flash off CUDA."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    device = torch.device(device)
    if device.type != "cuda":
        if name != "auto":
            raise ValueError(f"--attention {name} picks a CUDA attention kernel, but the run's device is "
                             f"{device.type}; use --device cuda or drop --attention")
        return "default"
    if name != "auto":
        return name
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except (AssertionError, RuntimeError):  # no CUDA runtime to ask (a run without a GPU stops before training)
        return "flash"
    return "cudnn" if major == 9 else "flash"


def priority_order(first: str) -> list:
    """The SDPA backends enabled under ``first`` ("cudnn" or "flash"), in priority order: that one
    at the head, the rest in torch's order; "flash" leaves cuDNN's out."""
    from torch.nn.attention import SDPBackend

    head = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[first]
    rest = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    dropped = {head} | ({SDPBackend.CUDNN_ATTENTION} if first == "flash" else set())
    return [head] + [b for b in rest if b not in dropped]


@contextlib.contextmanager
def attention_preference(resolved: str) -> Iterator[None]:
    """Hold the SDPA priority of ``resolved`` (from resolve_attention) while a run trains; torch's
    own order for "default"."""
    if resolved == "default":
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(priority_order(resolved), set_priority=True):
        yield


def chosen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False) -> str:
    """The backend torch picks now for a causal call on these tensors ("cudnn", "flash",
    "efficient", "math", ...): what a profile would show, without running the kernel."""
    from torch.nn.attention import SDPBackend

    index = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    return {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
            SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}.get(SDPBackend(index), "other")


__all__ = ["ATTENTION_BACKENDS", "resolve_attention", "priority_order", "attention_preference", "chosen_kernel"]
