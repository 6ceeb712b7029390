"""Thin calls into the fused kernels (asyncpp_ext._C.optim): tensors go in as DLPack capsules."""
from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from .._ext import C

_K = C.optim


def capsules(tensors):
    return [to_dlpack(t) for t in tensors]


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device as an integer (0 for CPU tensors)."""
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, ef_bufs, steps, ef_first, *, lr, beta1, beta2,
               eps, weight_decay, ef_beta):
    if not params:
        return
    _K.adamw_step(capsules(params), capsules(grads), capsules(exp_avgs), capsules(exp_avg_sqs),
                  capsules(ef_bufs), steps, ef_first, lr, beta1, beta2, eps, weight_decay, ef_beta,
                  stream_of(params[0]))


def muon_momentum(grads, bufs, outs, *, momentum, nesterov, sumsq=None):
    if not grads:
        return
    _K.muon_momentum(capsules(grads), capsules(bufs), capsules(outs), momentum, nesterov,
                     None if sumsq is None else to_dlpack(sumsq), stream_of(grads[0]))


def apply_update(params, updates, ef_bufs, update_scales, ef_first, *, lr, weight_decay, ef_beta):
    if not params:
        return
    _K.apply_update(capsules(params), capsules(updates), capsules(ef_bufs), update_scales, ef_first,
                    lr, weight_decay, ef_beta, stream_of(params[0]))


def first_nonfinite(tensors) -> int:
    """Index of the first tensor holding NaN/Inf, or -1 (one read pass; syncs on CUDA)."""
    if not tensors:
        return -1
    return _K.first_nonfinite(capsules(tensors), stream_of(tensors[0]))
