"""Quintic Newton-Schulz orthogonalisation for Muon, batched over same-shape matrices.

Precision: float32, or bfloat16. bfloat16 runs native bf16 matmuls (bf16 operands, float32
accumulation, bf16 result: what cuBLAS and oneDNN do, and what torch.optim.Muon runs) on CUDA and on
CPUs with bf16 dot-product instructions (AVX512-BF16 or AMX). Other CPUs run bf16 matmuls very
slowly, so there bf16 is *emulated*: every intermediate (X, A = X X^T, G = bA + cA^2, the output)
is rounded to bf16 exactly where a bf16 run stores it, and the products run in float32 BLAS. That is
the same arithmetic: a product of two bf16 numbers is exact in float32 (8+8 significant bits < 24),
sums are float32 in both, and the results are rounded to bf16 at the same points. Only the order of
the float32 summation differs, as it does between any two GEMM libraries.

The symmetric trick (computing only half of X X^T and A A) was measured on this CPU with 2-block
bmm calls and was 2-5x slower than one full bmm, so it is not used.
"""
from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


BF16_MATMUL_MODES = ("auto", "native", "emulated")
_cpu_has_bf16_dot = None


def cpu_has_bf16_dot() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX tiles), i.e. when
    torch's native bf16 matmul is fast here (measured 5-7x faster than float32 on an AMX CPU)."""
    global _cpu_has_bf16_dot
    if _cpu_has_bf16_dot is None:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        _cpu_has_bf16_dot = any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return _cpu_has_bf16_dot


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def orthogonalize(v: torch.Tensor, norms: torch.Tensor, *, steps: int = 5,
                  coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  ns_dtype: torch.dtype = torch.float32, bf16_matmul: str = "auto") -> torch.Tensor:
    """NS5 of each matrix in v (B, rows, cols); returns (B, rows, cols) contiguous in v's dtype.

    norms[i] = ||v[i]||_F (from the momentum kernel); X = v / (norm + eps). Tall matrices are
    processed transposed (on the wide side); the last step writes the result straight back in the
    original layout, so no transpose copy is made. `bf16_matmul` (only for ns_dtype=bfloat16 on
    CPU): "native" bf16 matmuls, "emulated" (float32 products of bf16-rounded values), or "auto" =
    native when `cpu_has_bf16_dot()`, else emulated.
    """
    if bf16_matmul not in BF16_MATMUL_MODES:
        raise ValueError(f"bf16_matmul must be one of {BF16_MATMUL_MODES}, got {bf16_matmul!r}")
    a, b, c = coefficients
    batch, rows, cols = v.shape
    tall = rows > cols
    native = bf16_matmul == "native" or (bf16_matmul == "auto" and cpu_has_bf16_dot())
    emulate = ns_dtype == torch.bfloat16 and v.device.type == "cpu" and not native
    compute = torch.float32 if emulate else ns_dtype
    rnd = _round_bf16 if emulate else (lambda t: t)
    x = v.mT if tall else v
    # The scale is rounded to ns_dtype in both bf16 modes, so they divide by the same number.
    scale = (norms.to(torch.float32) + eps).view(batch, 1, 1).to(ns_dtype)
    x = rnd(x.to(compute) / scale.to(compute))
    if steps == 0:
        out = x.mT.contiguous() if tall else x
        return out.to(v.dtype)
    for k in range(steps):
        gram = rnd(torch.bmm(x, x.mT))
        poly = rnd(torch.baddbmm(gram, gram, gram, beta=b, alpha=c))
        if k < steps - 1:
            x = rnd(torch.baddbmm(x, poly, x, beta=a))
        elif tall:
            # (a X + P X)^T = a X^T + X^T P^T, and P is symmetric: result in the parameter layout.
            x = rnd(torch.baddbmm(x.mT, x.mT, poly.mT, beta=a))
        else:
            x = rnd(torch.baddbmm(x, poly, x, beta=a))
    return x.to(v.dtype).contiguous()
