"""Model FLOPs per token and the GPUs' peaks: the arithmetic behind TFLOP/s and MFU (model FLOPs
utilisation) in ``asyncpp-train``'s metrics and in bench/gpu_throughput.py.

The PaLM convention (Chowdhery et al. 2022, appendix B; nanoGPT and torchtitan count so too)::

    FLOPs per token = 6 * N  +  12 * L * C * T

N: the parameters that take part in a matrix product -- every parameter of the model except the
input embedding tables (a lookup is no matmul); a table tied to the output head counts once, as
the head; norms and biases are kept (a fraction of a percent). L layers whose attention has query
heads x head width C (the model's ``attention_width``: the embedding width in the package's GPT and
Llama, wider in a Hugging Face config whose ``head_dim`` says so), T the sequence length: the
attention term counts the full T x T score and value products, without halving for the causal
mask. Forward and backward together (the 6: 2 for the forward's multiply-adds, 4 for the
backward's two products per weight).
Recomputation (``--recompute``) and the optimizer's own work are not model FLOPs.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

PEAK_TFLOPS = [("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0),
               ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0)]
"""Dense bf16 tensor-core peaks (TFLOP/s) from NVIDIA's datasheets (the "with sparsity" figure / 2),
by a part of the device's name; the first match wins, so more specific names come first ("GH200"
contains "H200")."""


def palm_flops_per_token(matmul_params: int, layers: int, width: int, seq_len: int) -> float:
    """6 N + 12 L C T (the module docstring)."""
    return 6.0 * matmul_params + 12.0 * layers * width * seq_len


def matmul_params(model: nn.Module) -> int:
    """N of a model: each distinct parameter once, less the weights of its ``nn.Embedding`` tables
    that no other module uses (a table tied to the head is the head's matrix)."""
    owners: dict[int, list[nn.Module]] = {}
    sizes: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
            sizes[id(p)] = p.numel()
    return sum(n for key, n in sizes.items() if not all(isinstance(m, nn.Embedding) for m in owners[key]))


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of one of the package's models (``layers``: its transformer blocks;
    the width: its ``attention_width``, models/base.py) at ``seq_len``."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    layers = getattr(model, "layers", None)
    if not embeddings or layers is None:
        raise ValueError(f"{type(model).__name__} has no embedding table or no layers: not one of the package's "
                         "models (blocks(): embed, layers, head)")
    width = getattr(model, "attention_width", None) or embeddings[0].embedding_dim
    return palm_flops_per_token(matmul_params(model), len(layers), width, seq_len)


def peak_tflops(device_name: Optional[str]) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``), None when the
    table does not know it."""
    for key, tflops in PEAK_TFLOPS:
        if device_name and key.lower() in device_name.lower():
            return tflops
    return None


__all__ = ["PEAK_TFLOPS", "palm_flops_per_token", "matmul_params", "flops_per_token", "peak_tflops"]
