"""Thin calls into the fused kernels (asyncpp_ext._C.optim): tensors go in as DLPack capsules.

On CUDA every call runs with the tensors' device current (the kernels launch on the current
device) on that device's current torch stream."""
from __future__ import annotations

import contextlib

import torch
from torch.utils.dlpack import to_dlpack

from .._ext import C

_K = C.optim
_cuda_usable = None


def capsules(tensors):
    return [to_dlpack(t) for t in tensors]


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device as an integer (0 for CPU tensors)."""
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def _check_cuda_kernels() -> None:
    """Fail with the reason (and the fix) when our CUDA kernels cannot run although torch can."""
    global _cuda_usable
    if _cuda_usable is None:
        _cuda_usable = C.cuda_device_count() > 0
    if not _cuda_usable:
        built = C.build_config()
        raise RuntimeError(
            "asyncpp_ext's CUDA kernels cannot run here: " + (C.cuda_status() or "no CUDA device") +
            f". They were built with nvcc {built['nvcc_version'] or '(none)'} (archs "
            f"{built['cuda_archs'] or 'none'}) while torch uses CUDA {torch.version.cuda}; rebuild "
            "asyncpp_ext with a CUDA toolkit the installed driver supports (pip install . with that nvcc "
            "on PATH), or keep the optimizer on CPU")


def cpu_kernel_isa() -> str:
    """The ISA the CPU kernels run with in this process ("baseline", "avx2", "avx512f"), chosen once
    from $ASYNCPP_CPU_ISA and the CPU; ValueError naming the variable when the setting cannot be
    honoured here."""
    return C.cpu_kernel_isa_check()


def on_device_of(t: torch.Tensor):
    """Make t's CUDA device current for a kernel call (nothing for CPU tensors)."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    _check_cuda_kernels()
    return torch.cuda.device(t.device)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, ef_bufs, steps, ef_first, *, lr, beta1, beta2,
               eps, weight_decay, ef_beta):
    if not params:
        return
    with on_device_of(params[0]):
        _K.adamw_step(capsules(params), capsules(grads), capsules(exp_avgs), capsules(exp_avg_sqs),
                      capsules(ef_bufs), steps, ef_first, lr, beta1, beta2, eps, weight_decay, ef_beta,
                      stream_of(params[0]))


def muon_momentum(grads, bufs, outs, *, momentum, nesterov, sumsq=None):
    if not grads:
        return
    with on_device_of(grads[0]):
        _K.muon_momentum(capsules(grads), capsules(bufs), capsules(outs), momentum, nesterov,
                         None if sumsq is None else to_dlpack(sumsq), stream_of(grads[0]))


def apply_update(params, updates, ef_bufs, update_scales, ef_first, *, lr, weight_decay, ef_beta):
    if not params:
        return
    with on_device_of(params[0]):
        _K.apply_update(capsules(params), capsules(updates), capsules(ef_bufs), update_scales, ef_first,
                        lr, weight_decay, ef_beta, stream_of(params[0]))


def first_nonfinite(tensors) -> int:
    """Index of the first tensor holding NaN/Inf, or -1 (one read pass; syncs on CUDA)."""
    if not tensors:
        return -1
    with on_device_of(tensors[0]):
        return _K.first_nonfinite(capsules(tensors), stream_of(tensors[0]))
