"""Which device each rank trains on and which transport carries its pipeline messages.

The rules are pure functions of their arguments (no CUDA call), so they are unit-tested on
machines without a GPU with made-up GPU counts; callers pass ``torch.cuda.device_count()``.
``to_device`` moves a step's batch onto the device a stage computes on.

Transports (``transport=`` / ``--transport``):

- ``nccl``: the C++ NCCL transport (pipeline/nccl.py); CUDA only, one GPU per rank.
- ``torch``: torch.distributed ``isend``/``irecv`` on process groups of its own, one per link
  and message kind (transport.TorchTransport): NCCL groups on CUDA (one GPU per rank), gloo
  groups on CPU.
- ``gloo``: torch.distributed ``isend``/``irecv`` over gloo on the default group. On CUDA the
  tensors are staged through host memory, so several ranks may share one GPU.
- ``ipc``: stages on one host hand tensors over through shared memory (pipeline/ipc.py): CUDA
  IPC on a GPU, so several ranks may share one GPU without host copies; POSIX shared memory on
  CPU. Small notices travel over gloo on the default group.
- ``auto``: ``nccl`` on CUDA, ``socket`` on CPU.
"""
from __future__ import annotations

import os

import torch

TRANSPORTS = ("auto", "nccl", "torch", "gloo", "socket", "ipc")
LAUNCHERS = ("spawn", "torchrun")


MAX_RANKS_PER_CORE = 8
"""A local launch of more ranks than this per core is refused: each rank is a process with torch
loaded (hundreds of MB), and beyond a few per core the ranks only wait on each other; a typo such
as ``--stages 500`` would otherwise start hundreds of interpreters and look hung."""


class DeviceError(ValueError):
    """A device or transport request this machine or this combination cannot run."""


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else every CPU)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_spawned_ranks(ranks: int, cores: int, what: str = "--stages x --dp",
                        fewer: str = "lower --stages or --dp") -> None:
    """Refuse a local launch of ``ranks`` processes that this machine's ``cores`` cannot hold;
    the message calls the count ``what`` and advises ``fewer``."""
    if ranks > MAX_RANKS_PER_CORE * cores:
        raise DeviceError(f"{what} is {ranks} ranks to start on this machine, more than "
                          f"{MAX_RANKS_PER_CORE} per core for its {cores} core{'s' if cores != 1 else ''} "
                          f"(at most {MAX_RANKS_PER_CORE * cores}); {fewer}, or spread the "
                          "ranks over machines with torchrun")


def _device_type(device) -> str:
    return torch.device(device).type


def choose_transport(requested: str, device) -> str:
    """The transport a rank on ``device`` uses for ``requested`` (one of TRANSPORTS)."""
    if requested not in TRANSPORTS:
        raise DeviceError(f"unknown transport {requested!r}; choose one of {', '.join(TRANSPORTS)}")
    kind = _device_type(device)
    if requested == "auto":
        return "nccl" if kind == "cuda" else "socket"
    if requested == "socket" and kind != "cpu":
        raise DeviceError(f"transport 'socket' moves CPU tensors but device is {str(device)!r}; use transport "
                          "'nccl' (one GPU per rank), or 'ipc' or 'gloo' (ranks may share a GPU) on CUDA")
    if requested == "nccl" and kind != "cuda":
        raise DeviceError(f"transport 'nccl' moves CUDA tensors but device is {str(device)!r}; pass "
                          "device='cuda:<index>' (--device cuda) or use transport 'gloo' or 'torch' on CPU")
    return requested


def needs_own_gpu(transport: str) -> bool:
    """NCCL (ours or torch's) refuses two ranks on one GPU; gloo stages through the host, ipc maps
    the peer's device memory."""
    return transport in ("nccl", "torch")


def local_ranks_from_env(environ) -> int:
    """Ranks on this machine as a launcher's environment says: LOCAL_WORLD_SIZE (torchrun), else
    WORLD_SIZE (a local spawn sets it for its ranks), else 1."""
    return int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1")))


def local_world_size(launcher: str, ranks: int, environ) -> int:
    """Ranks on this machine: all ``ranks`` of a run spawned here; under torchrun its
    LOCAL_WORLD_SIZE (or WORLD_SIZE) from ``environ``."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "spawn":
        return ranks
    return local_ranks_from_env(environ)


def check_local_world(local_world: int, visible_gpus: int, transport: str, launcher: str = "spawn") -> None:
    """Refuse a CUDA run whose ranks on this machine cannot each get what ``transport`` needs."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    transport = choose_transport(transport, "cuda")
    if visible_gpus < 1:
        raise DeviceError("--device cuda but torch sees no CUDA GPU (a CPU build of torch, or "
                          "CUDA_VISIBLE_DEVICES is empty); use --device cpu")
    if needs_own_gpu(transport) and local_world > visible_gpus:
        fewer = ("start at most that many processes per machine (--nproc-per-node)" if launcher == "torchrun"
                 else "lower --stages x --dp")
        raise DeviceError(f"{local_world} ranks on this machine but {visible_gpus} GPU"
                          f"{'s' if visible_gpus != 1 else ''} visible; transport {transport!r} needs one "
                          f"GPU per rank: {fewer}, or use --transport ipc (or gloo) to share GPUs")


def rank_device(device: str, local_rank: int, local_world: int, visible_gpus: int, transport: str,
                launcher: str = "spawn") -> str:
    """The device string of the rank with index ``local_rank`` among ``local_world`` on this machine.

    ``device`` is "cpu" or "cuda" (``--device``); ``transport`` one of TRANSPORTS.
    CPU ranks train on "cpu". On CUDA a rank takes ``cuda:<local_rank>`` (torchrun's LOCAL_RANK,
    or the spawn index); with the ipc and gloo transports ranks may share GPUs: ``cuda:<local_rank %
    visible_gpus>``. Refusals raise DeviceError (see check_local_world)."""
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local_rank must be in [0, {local_world}), got {local_rank}")
    if device == "cpu":
        return "cpu"
    check_local_world(local_world, visible_gpus, transport, launcher)
    return f"cuda:{local_rank % visible_gpus}"


def process_group_backend(transport: str, device) -> str:
    """Backend of the default process group: it always carries CPU tensors (the start-up
    handshake, evaluation, checkpoint barriers); with the torch transport on CUDA it also needs
    NCCL, for the CUDA tensors of the data-parallel groups created from it."""
    if transport == "torch" and _device_type(device) == "cuda":
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def check_device(device) -> torch.device:
    """``Pipeline(device=...)`` as a torch.device (None: the CPU), or ValueError naming it: a name
    torch does not know, a kind the pipeline does not run on (it runs on "cpu" and "cuda"; "meta"
    would train nothing), a GPU that is not there (before the transport would blame NCCL)."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a string or torch.device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device name torch knows; use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}: the pipeline runs on 'cpu' or 'cuda'")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} but torch sees no CUDA device; use device='cpu'")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(device)!r} but torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return device


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A batch tensor on its compute device without making the host wait: to a GPU from pinned
    memory, asynchronously. A pageable source would make the copy wait for everything queued on
    the device before it (the previous step's optimizer, say), emptying the GPU's queue at every
    step start while the host then launches the next kernels one by one."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["TRANSPORTS", "LAUNCHERS", "DeviceError", "check_device", "choose_transport", "needs_own_gpu", "local_world_size",
           "check_local_world", "check_spawned_ranks", "usable_cores", "MAX_RANKS_PER_CORE",
           "rank_device", "process_group_backend", "to_device"]
