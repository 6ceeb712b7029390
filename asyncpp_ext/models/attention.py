"""Which kernel attention runs on CUDA: ``--attention auto|cudnn|flash|flex``.

On Hopper (compute capability 9.x) cuDNN's fused attention kernels are the faster ones for
training shapes: bench/attention_kernels.py measured 1.41x FlashAttention-2's forward + backward
at smollm-360m's shape on an H100, and a training step 8 % faster (docs/gpu.md). torch chooses
among its SDPA backends by a priority list (flash first) and per-shape rules of its own, which
differ between versions; ``--attention`` pins the choice instead:

- ``cudnn``: cuDNN first, then the others in torch's order (a shape cuDNN cannot serve, or
  deterministic algorithms, fall through to the next);
- ``flash``: cuDNN's kernels off, flash first, then the others in torch's order;
- ``auto``: cudnn on Hopper GPUs; elsewhere torch's own choice (unmeasured there; off CUDA its
  CPU kernels are neither);
- ``flex``: with ``--document-mask``, FlexAttention's block-sparse kernel by a BlockMask of the
  documents instead of SDPA with a boolean mask (which no flash or cuDNN kernel takes: SDPA runs
  its memory-efficient kernel over every key, masked ones included). Compiled blocks only (eager
  flex_attention is an unfused reference), the package's own models (a Hugging Face model's
  layers take a tensor mask): models/document_mask.py. Attention without a mask keeps torch's
  own SDPA choice.

The choice is process-wide torch state, read when a call picks its kernel: for compiled blocks
when they are traced, for CUDA graphs when they are captured. A run therefore holds it for its
whole length, from before it compiles (``attention_preference``), set alike in a pipeline's ranks
and in its ``--simulate`` run, and restores the caller's on exit.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .document_mask import flex_masks

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "flex")
"""The ``--attention`` values (the module's docstring says what each does)."""


def resolve_attention(name: str, device) -> str:
    """``name`` for ``device``: "cudnn", "flash", "flex", or "default" (torch's own choice): "auto"
    is cudnn on a Hopper GPU and default elsewhere. ValueError (one line) for an explicit kernel
    off CUDA (flex too: flex_attention has no backward on the CPU)."""
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
    if not torch.cuda.is_available():  # nothing to ask (a cuda run without a GPU stops before training)
        return "default"
    major, _ = torch.cuda.get_device_capability(device)
    return "cudnn" if major == 9 else "default"


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
    """Hold the SDPA choice of ``resolved`` (from resolve_attention) while a run builds and trains;
    nothing changes for "default"; "flex" holds document masks as BlockMasks (document_mask.flex_masks).

    A compiled graph keeps the kernel it was traced with, so the choice is part of what compiled
    code is looked up by: in this process through ``sdpa_state`` in each compiled group's key
    (models/compile.py), on disk through torch's compile cache tag -- without it a run asking for
    flash would load the cuDNN graphs an earlier run on the machine left in the inductor cache."""
    if resolved == "default":
        yield
        return
    if resolved == "flex":
        with flex_masks(), _cache_tag("asyncpp-attention=flex"):
            yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(priority_order(resolved), set_priority=True), _cache_tag(f"asyncpp-attention={resolved}"):
        yield


@contextlib.contextmanager
def _cache_tag(tag: str) -> Iterator[None]:
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):  # a torch without the tag keys no cache by it
        yield
        return
    old = config.cache_key_tag
    with config.patch(cache_key_tag=f"{old};{tag}" if old else tag):
        yield


def sdpa_state() -> tuple:
    """torch's current SDPA choice: the priority order and which backends are enabled."""
    b = torch.backends.cuda
    return (tuple(torch._C._get_sdp_priority_order()), b.cudnn_sdp_enabled(), b.flash_sdp_enabled(),
            b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


def chosen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False,
                  attn_mask: torch.Tensor | None = None) -> str:
    """The backend torch picks now for a causal call on these tensors, or one by ``attn_mask``
    ("cudnn", "flash", "efficient", "math", ...): what a profile would show, without running the
    kernel."""
    from torch.nn.attention import SDPBackend

    index = torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                    enable_gqa=enable_gqa)
    return {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
            SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}.get(SDPBackend(index), "other")


__all__ = ["ATTENTION_BACKENDS", "resolve_attention", "priority_order", "attention_preference", "sdpa_state",
           "chosen_kernel"]
