"""Quintic Newton-Schulz orthogonalisation for Muon, batched over same-shape matrices.

Precision: float32, or bfloat16. bfloat16 runs native bf16 matmuls (bf16 operands, float32
accumulation, bf16 result: what cuBLAS and oneDNN do, and what torch.optim.Muon runs) on CUDA and on
CPUs with bf16 dot-product instructions (AVX512-BF16 or AMX). Other CPUs run bf16 matmuls very
slowly, so there bf16 is *emulated*: every intermediate (X, A = X X^T, G = bA + cA^2, the output)
is rounded to bf16 exactly where a bf16 run stores it, and the products run in float32 BLAS. That is
the same arithmetic: a product of two bf16 numbers is exact in float32 (8+8 significant bits < 24),
sums are float32 in both, and the results are rounded to bf16 at the same points. Only the order of
the float32 summation differs, as it does between any two GEMM libraries.

The symmetric trick (only the upper half of G = X X^T, 3 of the 4 r/2-row blocks) was measured on
an AMX CPU on the GPT shapes: bf16 3-5x slower than one full bmm (three small products plus block
copies), float32 0.94-1.13x. It does not pay, so it is not used.
"""
from __future__ import annotations

import os

import torch

from .checks import non_negative, real_number, whole_number

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


BF16_MATMUL_MODES = ("auto", "native", "emulated")
BF16_MATMUL_ENV = "ASYNCPP_BF16_MATMUL"
"""Forces the CPU bf16 Newton-Schulz path for every call that passes bf16_matmul="auto":
"native" or "emulated" ("auto" or unset: native exactly when the CPU has bf16 dot products)."""
_cpu_has_bf16_dot = None


def cpu_has_bf16_dot() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX tiles), i.e. when
    torch's native bf16 matmul is fast here (measured 5-7x faster than float32 on an AMX CPU)."""
    global _cpu_has_bf16_dot
    if _cpu_has_bf16_dot is None:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        _cpu_has_bf16_dot = any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return _cpu_has_bf16_dot


def bf16_matmul_choice(requested: str = "auto") -> tuple[str, str]:
    """(mode, reason): which CPU bf16 path a call with ``bf16_matmul=requested`` takes, and why.

    An explicit "native"/"emulated" argument wins; "auto" takes $ASYNCPP_BF16_MATMUL if set, else
    the CPU's capability. Both paths run on every CPU (native is only slow without bf16 dot
    products), so either can be forced anywhere."""
    if requested not in BF16_MATMUL_MODES:
        raise ValueError(f"bf16_matmul must be one of {BF16_MATMUL_MODES}, got {requested!r}")
    if requested != "auto":
        return requested, f"bf16_matmul={requested!r} passed by the caller"
    forced = os.environ.get(BF16_MATMUL_ENV, "").strip().lower()
    if forced not in ("",) + BF16_MATMUL_MODES:
        raise ValueError(f"{BF16_MATMUL_ENV}={os.environ[BF16_MATMUL_ENV]!r} is not one of "
                         f"{', '.join(BF16_MATMUL_MODES)}; set one of those or unset it")
    if forced in ("native", "emulated"):
        return forced, f"forced by {BF16_MATMUL_ENV}={forced}"
    if cpu_has_bf16_dot():
        return "native", "auto: this CPU has bf16 dot products (AVX512-BF16 or AMX)"
    return "emulated", "auto: this CPU has no bf16 dot products (AVX512-BF16 or AMX)"


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


class Workspace:
    """Buffers of the batched Newton-Schulz chain, kept from one optimizer step to the next.

    A fresh multi-megabyte CPU tensor is new memory from the OS, and writing it the first time
    costs a page fault per 4 KiB; reusing the buffers (with tall matrices kept in their layout)
    took the bf16 Muon step on the 24-matrix GPT set from 38 to 28 ms. Buffers are keyed by
    (role, shape, dtype, device); a shape seen once stays allocated (about two ns_dtype copies of
    the Muon matrices in all)."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, role: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        key = (role, tuple(shape), dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


def _check_orthogonalize_arguments(v, norms, steps, ns_dtype, eps) -> None:
    """ValueError naming the argument of ``orthogonalize`` that it cannot run on (a few checks of
    Python values, nothing read from the tensors)."""
    if not (torch.is_tensor(v) and v.dim() == 3 and v.is_floating_point()):
        got = f"{v.dim()}-D {v.dtype}" if torch.is_tensor(v) else type(v).__name__
        raise ValueError(f"orthogonalize: v must be a (batch, rows, cols) floating-point tensor (one matrix: "
                         f"v[None]), got {got}")
    if not (torch.is_tensor(norms) and tuple(norms.shape) == (v.shape[0],)):
        got = tuple(norms.shape) if torch.is_tensor(norms) else type(norms).__name__
        raise ValueError(f"orthogonalize: norms must hold one Frobenius norm per matrix, shape ({v.shape[0]},), "
                         f"got {got}")
    whole_number(steps, "orthogonalize: steps", "an integer >= 0", non_negative)
    if ns_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"orthogonalize: ns_dtype must be torch.float32 or torch.bfloat16, got {ns_dtype!r}")
    check_eps(eps, "orthogonalize: eps")


def check_eps(eps, what: str = "eps") -> float:
    """``eps`` as a float, or a ValueError naming ``what`` unless it is a finite number >= 0."""
    return real_number(eps, what, "a finite number >= 0", non_negative)


def orthogonalize(v: torch.Tensor, norms: torch.Tensor, *, steps: int = 5,
                  coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  ns_dtype: torch.dtype = torch.float32, bf16_matmul: str = "auto",
                  workspace: Workspace | None = None, overwrite_input: bool = False) -> torch.Tensor:
    """NS5 of each matrix in v (B, rows, cols); returns (B, rows, cols) contiguous in v's dtype.

    norms[i] = ||v[i]||_F (from the momentum kernel); X = v / (norm + eps). The iteration runs on
    the wide side, X = v for wide and square matrices and X = v^T for tall ones; a tall matrix is
    kept in its own layout throughout (with Y = X^T: Y <- a Y + Y P^T, the same products as
    a X + P X), so no transpose is ever copied. `bf16_matmul` (only for ns_dtype=bfloat16 on CPU):
    "native" bf16 matmuls, "emulated" (float32 products of bf16-rounded values), or "auto" (see
    `bf16_matmul_choice`: $ASYNCPP_BF16_MATMUL, else native when `cpu_has_bf16_dot()`).

    `workspace`: reuse its buffers (the result then lives in one of them, valid until the next
    call with the same shapes). What it keeps per shape, r = min(rows, cols): native bf16 and
    float32 NS two ns_dtype buffers of v's shape and two (B, r, r); emulated bf16 the same four in
    float32, plus a bfloat16 buffer of v's shape to round through unless v may be overwritten.
    `overwrite_input`: v may be scaled in place and reused as a buffer.
    """
    _check_orthogonalize_arguments(v, norms, steps, ns_dtype, eps)
    mode, _ = bf16_matmul_choice(bf16_matmul)
    batch, rows, cols = v.shape
    emulate = ns_dtype == torch.bfloat16 and v.device.type == "cpu" and mode == "emulated"
    workspace = workspace or Workspace()
    # The scale is rounded to ns_dtype in both bf16 modes, so they divide by the same number.
    scale = (norms.to(torch.float32) + eps).view(batch, 1, 1).to(ns_dtype)
    if emulate:
        # Products run in float32 buffers; every stored value is rounded to bf16 in place by a
        # copy through a bfloat16 buffer of v's shape (v itself when it may be overwritten). The
        # last rounding leaves the result there, in bfloat16.
        reuse_v = overwrite_input and v.dtype == torch.bfloat16 and v.is_contiguous()
        rounding = v if reuse_v else workspace.get("bf16_round", v.shape, torch.bfloat16, v.device)

        def rnd(t: torch.Tensor) -> torch.Tensor:
            r = rounding.view(-1)[:t.numel()].view(t.shape)
            return t.copy_(r.copy_(t))

        x = workspace.get("x_in", v.shape, torch.float32, v.device)
        torch.div(v, scale.to(torch.float32), out=x)  # before v is overwritten as the scratch
        out = _iterate(rnd(x), steps, coefficients, rows > cols, rnd, workspace)
        return rounding if v.dtype == torch.bfloat16 else out.to(v.dtype)
    if overwrite_input and v.dtype == ns_dtype and v.is_contiguous():
        x = v.div_(scale)
    else:
        x = v.to(ns_dtype) / scale
    return _iterate(x, steps, coefficients, rows > cols, None, workspace).to(v.dtype)


def _iterate(x, steps, coefficients, tall, rnd, workspace):
    """The NS steps on x (B, rows, cols), kept in x's own layout, in the workspace's buffers.
    rnd: in-place rounding after every product (emulated bf16) or None."""
    a, b, c = coefficients
    batch, rows, cols = x.shape
    r = min(rows, cols)
    gram = workspace.get("gram", (batch, r, r), x.dtype, x.device)
    poly = workspace.get("poly", (batch, r, r), x.dtype, x.device)
    other = workspace.get("x", x.shape, x.dtype, x.device)
    rnd = rnd or (lambda t: t)
    for _ in range(steps):
        if tall:  # Y = X^T: G = Y^T Y, Y' = a Y + Y P^T
            g = rnd(torch.bmm(x.mT, x, out=gram))
            p = rnd(torch.baddbmm(g, g, g, beta=b, alpha=c, out=poly))
            nxt = rnd(torch.baddbmm(x, x, p.mT, beta=a, out=other))
        else:
            g = rnd(torch.bmm(x, x.mT, out=gram))
            p = rnd(torch.baddbmm(g, g, g, beta=b, alpha=c, out=poly))
            nxt = rnd(torch.baddbmm(x, p, x, beta=a, out=other))
        other = x  # ping-pong: the old X is the next step's output buffer
        x = nxt
    return x.contiguous()
