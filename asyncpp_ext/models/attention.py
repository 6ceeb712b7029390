"""Which kernel ``F.scaled_dot_product_attention`` runs on CUDA: ``--attention auto|cudnn|flash``.

torch picks an SDPA kernel by a fixed priority list that puts FlashAttention (version 2) first.
On Hopper (compute capability 9.x) cuDNN's fused attention kernels are faster for training shapes
(they use the chip's wgmma and bulk copy units, which FlashAttention-2 does not), so ``auto``
puts cuDNN first there and leaves torch's order elsewhere. Either way it is a *preference*: every
backend stays enabled, and a shape or setting the first cannot serve (deterministic algorithms for
cuDNN, say) goes to the next, as torch would.

The priority is process-wide torch state, read when a call picks its kernel: for compiled blocks
when they are traced, for CUDA graphs when they are captured. A run therefore holds it for its
whole length (``attention_preference``), set alike in a pipeline's ranks and in its ``--simulate``
run, and restores the caller's on exit.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

ATTENTION_BACKENDS = ("auto", "cudnn", "flash")
"""The ``--attention`` values: auto (cudnn on Hopper GPUs, else flash) | cudnn | flash (first in
the priority list; the others follow in torch's order)."""


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
    major, _ = torch.cuda.get_device_capability(device)
    return "cudnn" if major == 9 else "flash"


def priority_order(first: str) -> list:
    """Every SDPA backend, ``first`` ("cudnn" or "flash") at the head, the rest in torch's order."""
    from torch.nn.attention import SDPBackend

    head = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[first]
    rest = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    return [head] + [b for b in rest if b != head]


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
