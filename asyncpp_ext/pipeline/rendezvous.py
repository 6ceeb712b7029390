"""What the transports that rendezvous through the default group's key-value store share: the run
id that names a pipeline's keys (equal on every rank), its check, and the store itself."""
from __future__ import annotations

import itertools

import torch.distributed as dist

# Every rank creates its pipelines in the same order, so the n-th pipeline of each process gets
# the same id without a message.
_run_ids = itertools.count()


def next_run_id() -> str:
    """A run id for a pipeline created without one: ``run<k>`` for this process's k-th request."""
    return f"run{next(_run_ids)}"


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not run_id or "/" in run_id:
        raise ValueError(f"run_id must be a non-empty string without '/', got {run_id!r}")
    return run_id


def default_store():
    """The key-value store of the default torch.distributed process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: launch with torchrun or "
                           "asyncpp_ext.pipeline.spawn, or pass a store (e.g. torch.distributed.TCPStore)")
    return dist.distributed_c10d._get_default_store()


__all__ = ["next_run_id", "check_run_id", "default_store"]
