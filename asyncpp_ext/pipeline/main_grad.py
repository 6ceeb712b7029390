"""Gradient-accumulation fusion (``--gradient-accumulation-fusion``): a compute copy's weight
gradient added into the float32 gradient of the weight it copies by the weight-gradient product
itself, instead of a bf16 product that a second kernel reads back and adds.

Why: with bf16 compute copies (compute_copies.py) every linear layer's backward writes its weight
gradient in bf16, and after each microbatch one multi-tensor kernel widens it and adds it into the
float32 ``.grad`` -- per microbatch and copied weight 2 bytes written, then 2 + 4 read and 4
written again: at smollm-360m 8.75 ms of a 453 ms step on an H100 (docs/gpu.md). Here the product
``grad_output^T @ inputs`` runs with the float32 gradient as its accumulator's starting value
(one GEMM with bf16 operands, a float32 output and beta = 1 on CUDA: torch's ``addmm`` with
``out_dtype=float32`` where this torch has it -- the head loss's gradient uses the same,
models/head_loss.addmm_writes_fp32 -- else cuBLAS's own on torch's handle,
``optim._kernels.add_weight_gradient``): the gradient is read and written once per product,
inside the GEMM, and nothing else runs.

The numbers differ from autocast's (and from the copies' default): each microbatch's weight
gradient is no longer rounded to bf16 before it is added, so the float32 sum is the more precise
one (the forward and the input gradients are the same products as autocast's). The same code runs
in a pipeline's stages and in its ``--simulate`` run, so real == simulate holds with it as without.
On the CPU torch computes the product as one float32 ``addmm_`` of the widened bf16 operands.

Pieces: ``linear_into_main_grad(x, weight, main_grad)`` (an autograd function: forward
``F.linear``, backward the input's gradient and the fused weight gradient; ``weight`` itself gets
no gradient), ``MainGradLinear`` (an ``nn.Linear`` whose forward is that; compute_copies.py turns
the compute module's bias-free linear layers into it) and ``MainGradProduct`` (the same for a
stacked weight: models/llama.STACKED_PRODUCT). The gradient buffer must keep its address: CUDA
graphs replay the products into it (and a capture's eager warm-up runs add nothing,
models/graphs.in_capture_warm_up).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..models.graphs import in_capture_warm_up
from ..models.head_loss import addmm_writes_fp32
from ..optim import _kernels as K


# After a product added into a gradient: callbacks by (address, elements) of that gradient, which
# data parallelism's compute copies register (compute_copies.announce_final_grads) to hear that the
# weights whose float32 gradient it spans are complete. A lookup here, in the op's kernel, because
# that is the one place that runs both eagerly and inside compiled code (not under a CUDA graph's
# replay, which runs no Python: those buckets start after the backward). Weak references: a
# registering object that is gone is skipped.
_ADDED_INTO: dict[tuple[int, int], list] = {}


def added_into_key(main_grad: torch.Tensor) -> tuple[int, int]:
    """What ``after_add_into`` knows a gradient by: its address and its number of elements (a
    stacked product's gradient starts where its first row block's does)."""
    return main_grad.data_ptr(), main_grad.numel()


def after_add_into(main_grad: torch.Tensor, callback) -> None:
    """Call ``callback(added_into_key(main_grad))`` (a bound method, held weakly) after each
    product that adds into ``main_grad``."""
    _ADDED_INTO.setdefault(added_into_key(main_grad), []).append(weakref.WeakMethod(callback))


def _added_into(main_grad: torch.Tensor) -> None:
    key = added_into_key(main_grad)
    for ref in _ADDED_INTO.get(key, ()):
        callback = ref()
        if callback is not None:
            callback(key)


def _add_on_cuda(main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    # (asked before the warm-up's return: the capture's eager runs ask first, never the capture)
    by_torch = addmm_writes_fp32(main_grad.device, grad_output.dtype)
    if in_capture_warm_up():
        return
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = inputs.reshape(-1, inputs.shape[-1])
    with torch.no_grad():  # a gradient buffer, never part of a graph (kernels run in the caller's grad mode)
        if by_torch:  # torch's GEMM with a float32 output, beta = 1
            torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
        else:  # a torch without it: cuBLAS's own, on torch's handle
            K.add_weight_gradient(main_grad, dy.contiguous(), x.contiguous())
            torch.autograd.graph.increment_version(main_grad)  # (it wrote through a raw pointer)
    if _ADDED_INTO:
        _added_into(main_grad)


def _add_on_cpu(main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    if in_capture_warm_up():
        return
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = inputs.reshape(-1, inputs.shape[-1])
    # float32 whatever autocast the caller's backward runs under; never part of a graph
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        main_grad.addmm_(dy.t().float(), x.float())
    if _ADDED_INTO:
        _added_into(main_grad)


# An operator of torch's dispatcher, so that dynamo and inductor keep it in their graphs as one call
# that mutates ``main_grad``. Declared with torch.library's schema API rather than its
# ``custom_op`` decorator: that one wraps every call in Python autograd and checking layers (about
# 50 us per call on a CPU core, at ~128 products per smollm-360m microbatch a host cost that
# pipelines without CUDA graphs pay), where a kernel registered per device key costs a few us over
# the function itself. The op has no autograd formula of its own: it runs inside a backward.
_LIBRARY = torch.library.Library("asyncpp", "FRAGMENT")
_LIBRARY.define("add_weight_gradient(Tensor(a!) main_grad, Tensor grad_output, Tensor inputs) -> ()",
                tags=(torch.Tag.pt2_compliant_tag,))  # (what custom_op declares: a fake kernel, a schema)
_LIBRARY.impl("add_weight_gradient", _add_on_cuda, "CUDA")
_LIBRARY.impl("add_weight_gradient", _add_on_cpu, "CPU")


@torch.library.register_fake("asyncpp::add_weight_gradient")
def _(main_grad, grad_output, inputs) -> None:
    return None


# add_weight_gradient(main_grad, grad_output, inputs): main_grad (out, in) += grad_output (..., out)^T
# @ inputs (..., in), summed in float32; nothing while a CUDA graph's capture runs the computation
# eagerly (models/graphs.in_capture_warm_up)
add_weight_gradient = torch.ops.asyncpp.add_weight_gradient.default


class _LinearIntoMainGrad(torch.autograd.Function):
    """``F.linear(x, weight)`` in ``weight``'s dtype (autocast's cast of x, made here), whose
    backward adds the weight's gradient into ``main_grad`` and returns none for ``weight``."""

    @staticmethod
    def forward(ctx, x, weight, main_grad):
        x16 = x.to(weight.dtype)
        ctx.save_for_backward(x16, weight)
        # not a saved tensor: other microbatches' backwards add into it between this forward and
        # this backward (1F1B), which a saved tensor's version check would refuse
        ctx.main_grad = main_grad
        ctx.x_dtype = x.dtype
        return F.linear(x16, weight)

    @staticmethod
    def backward(ctx, grad_output):
        x16, weight = ctx.saved_tensors
        grad_output = grad_output.to(weight.dtype)
        add_weight_gradient(ctx.main_grad, grad_output, x16)
        grad_input = (grad_output @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return grad_input, None, None


def linear_into_main_grad(x: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` whose weight gradient is added into ``main_grad`` (float32, shaped like
    ``weight``) by its backward; ``weight`` gets no ``.grad``."""
    return _LinearIntoMainGrad.apply(x, weight, main_grad)


class MainGradLinear(nn.Linear):
    """A bias-free ``nn.Linear`` (a compute copy's) whose weight gradient goes into ``main_grad``."""

    main_grad: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_into_main_grad(x, self.weight, self.main_grad)


class MainGradProduct(nn.Module):
    """``product(x, weight)`` for a stacked weight (models/llama.STACKED_PRODUCT), its gradient into
    ``main_grad`` (the rows' float32 gradients, side by side)."""

    def __init__(self, main_grad: torch.Tensor):
        super().__init__()
        self.main_grad = main_grad

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear_into_main_grad(x, weight, self.main_grad)


def fusion_available(device) -> str | None:
    """None where the fused product can run on ``device``, else why not (one line). On CUDA it
    makes torch load its cuBLAS (a handle for the device), the library the product must use."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"the fused product has kernels for CPU and CUDA only, not {device.type}"
    if addmm_writes_fp32(device, torch.bfloat16):
        return None
    with torch.cuda.device(device):
        torch.cuda.current_blas_handle()
    library = K.cublas_library()
    return None if library.startswith("libcublas") else library


__all__ = ["MainGradLinear", "MainGradProduct", "add_weight_gradient", "added_into_key", "after_add_into", "fusion_available",
           "linear_into_main_grad"]
