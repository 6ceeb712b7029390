"""Quintic Newton-Schulz orthogonalisation for Muon, batched over same-shape matrices.

Precision: float32, or bfloat16. bfloat16 on CUDA runs native bf16 matmuls. bfloat16 on CPU keeps
every intermediate (X, A = X X^T, G = bA + cA^2, the output) rounded to bf16 exactly where a bf16
run stores them, but does the products in float32 BLAS: that is the arithmetic of a bf16 GEMM with
float32 accumulation (what oneDNN/cuBLAS do) without this CPU's very slow native bf16 matmul path.

The symmetric trick (computing only half of X X^T and A A) was measured on this CPU with 2-block
bmm calls and was 2-5x slower than one full bmm, so it is not used.
"""
from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def orthogonalize(v: torch.Tensor, norms: torch.Tensor, *, steps: int = 5,
                  coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  ns_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS5 of each matrix in v (B, rows, cols); returns (B, rows, cols) contiguous in v's dtype.

    norms[i] = ||v[i]||_F (from the momentum kernel); X = v / (norm + eps). Tall matrices are
    processed transposed (on the wide side); the last step writes the result straight back in the
    original layout, so no transpose copy is made.
    """
    a, b, c = coefficients
    batch, rows, cols = v.shape
    tall = rows > cols
    emulate = ns_dtype == torch.bfloat16 and v.device.type == "cpu"
    compute = torch.float32 if emulate else ns_dtype
    rnd = _round_bf16 if emulate else (lambda t: t)
    x = v.mT if tall else v
    scale = (norms.to(torch.float32) + eps).view(batch, 1, 1)
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
