"""``Pipeline``'s argument checks, each error naming the argument and the fix (the C++ core would
answer with a binding's signature, or a rank would fail later), and the minibatch split."""
from __future__ import annotations

import torch

from ..optim.lr_schedule import check_lr_schedule


def split_minibatch(batch, microbatches: int) -> tuple[list, list]:
    """(inputs, targets) of leading size m*B -> m microbatches each; a list of m pairs is kept."""
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(b, (list, tuple)) and len(b) == 2
                                                          for b in batch):
        if len(batch) != microbatches:
            raise ValueError(f"a minibatch of {len(batch)} (inputs, targets) microbatches, but the pipeline "
                             f"runs microbatches={microbatches} per step; build both with the same count")
        return [b[0] for b in batch], [b[1] for b in batch]
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch)):
        raise ValueError(f"a minibatch must be (inputs, targets) tensors or a list of {microbatches} such "
                         f"pairs, got {type(batch).__name__}"
                         + (f" of {len(batch)}" if isinstance(batch, (list, tuple)) else ""))
    x, y = batch
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(f"a minibatch's inputs {tuple(x.shape)} and targets {tuple(y.shape)} must have one "
                         "leading size (the sequences)")
    if x.shape[0] % microbatches:
        raise ValueError(f"a minibatch of {x.shape[0]} sequences cannot be split into {microbatches} "
                         "equal microbatches")
    return list(x.chunk(microbatches)), list(y.chunk(microbatches))


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_COUNT = 2**31 - 1
"""The largest microbatches / stages / recv_ahead: the C++ core counts them in 32-bit integers."""


def check_arguments(*, optimizer, loss_fn, microbatches, stages, recv_ahead, lr_schedule, flags) -> None:
    """TypeError / ValueError naming the argument, before anything is built (the C++ core would
    answer with a binding's signature, or a rank would fail later)."""
    if isinstance(optimizer, (torch.optim.Optimizer, type)) or not callable(optimizer):
        what = (f"the class {optimizer.__name__}" if isinstance(optimizer, type) else
                f"an optimizer instance ({type(optimizer).__name__})" if isinstance(optimizer, torch.optim.Optimizer)
                else repr(optimizer)[:60])
        raise TypeError(f"optimizer must be a factory, module -> torch.optim.Optimizer (each stage builds its own "
                        f"over its parameters), got {what}; pass e.g. lambda m: build_optimizer(m, 'adamw')")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, (outputs, targets) -> loss, got {type(loss_fn).__name__}")
    for name, value in (("microbatches", microbatches), ("recv_ahead", recv_ahead)) + \
            ((("stages", stages),) if stages is not None else ()):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if value > MAX_COUNT:
            raise ValueError(f"{name} must be at most {MAX_COUNT}, got {value}")
    for name, value in flags.items():  # "no" or 0.5 would be truthy: a switch turned on by mistake
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    check_lr_schedule(lr_schedule)


__all__ = ["MAX_COUNT", "check_arguments", "is_int", "split_minibatch"]
