"""The start-up agreement of a pipeline's stages, and the blocking messages outside the executor.

At a pipeline's first ``train`` call the stages agree, in a chain from stage 0 to S-1, on the
run's settings (schedule, microbatches, stages), on the split of the model's blocks, and on the
shape and dtype of every boundary tensor: each stage receives its input's signature from the
stage before, runs its blocks once on zeros of that signature to learn its output's, and sends
that on. Any disagreement stops the run at start-up, naming both stages; later microbatches are
checked against the agreement locally (no extra messages).
"""
from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist

from .._ext import C
from .stage import Signature, StageError, StageHost
from .peer_errors import peer_failure
from .transport import TransportError

# The boundary dtypes a signature can carry, by index in the message.
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
# One int64 message: [schedule, microbatches, stages, dtype, ndim, shape..., partition CRC, tokens].
MESSAGE_LEN = 16


def p2p(op, tensor: torch.Tensor, *, stage: int, stage_ranks: list, peer: int, what: str, tag: int = 0) -> None:
    """A blocking send/recv with stage ``peer`` outside the executor, failing with the peer named."""
    try:
        if op is dist.recv:
            op(tensor, src=stage_ranks[peer], tag=tag)
        else:
            op(tensor, dst=stage_ranks[peer], tag=tag)
    except RuntimeError as e:
        raise TransportError(f"stage {stage}: {what} with stage {peer} (rank {stage_ranks[peer]}) failed -- "
                             f"{peer_failure(e)}") from None


def partition_text(partition) -> str:
    return " | ".join(",".join(map(str, blocks)) for blocks in partition)


def partition_checksum(partition) -> int:
    """The block split every rank must share (a rank with other split_points would leave a block
    to no stage, or to two), as one number for the message."""
    return zlib.crc32(partition_text(partition).encode())


def _eagerly():
    """Compiled code run as plain eager code inside (``torch.compiler.set_stance``, torch >= 2.6;
    a no-op before)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def agree(host: StageHost, *, stage: int, stages: int, stage_ranks: list, core_schedule: str, microbatches: int,
          partition, device: torch.device, first_input: torch.Tensor | None) -> int:
    """Run this stage's part of the chain: sets ``host.in_sig`` and ``host.out_sig``; returns the
    tokens per microbatch (stage 0 counts them in ``first_input``, the others are told)."""
    settings = [int(C.parse_schedule_kind(core_schedule)), microbatches, stages]
    checksum = partition_checksum(partition)

    def message(op, msg):
        p2p(op, msg, stage=stage, stage_ranks=stage_ranks, peer=stage - 1 if op is dist.recv else stage + 1,
            what="start-up handshake")

    if host.is_first:
        host.in_sig = Signature(tuple(first_input.shape), first_input.dtype)
        tokens_per_microbatch = first_input.numel()
    else:
        msg = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
        message(dist.recv, msg)
        got = msg[:3].tolist()
        if got != settings:
            kinds = {int(kind): name for kind, name, _ in C.schedule_table()}  # the wire's numbers by name

            def shown(values):
                return [kinds.get(values[0], values[0]), *values[1:]]
            names = ("schedule", "microbatches", "stages")
            diffs = [f"{n} {a} vs {b}" for n, a, b in zip(names, shown(got), shown(settings)) if a != b]
            raise StageError(f"stage {stage} and stage {stage - 1} disagree on {', '.join(diffs)}: "
                             "launch every rank with the same settings")
        if int(msg[-2]) != checksum:
            raise StageError(f"stage {stage} and stage {stage - 1} split the model's blocks differently (this "
                             f"stage's split: {partition_text(partition)}); pass every rank the same split_points "
                             "and the same model")
        tokens_per_microbatch = int(msg[-1])
        ndim = int(msg[4])
        host.in_sig = Signature(tuple(msg[5:5 + ndim].tolist()), DTYPES[int(msg[3])])
    if host.is_last:
        return tokens_per_microbatch
    # eagerly even where the blocks are compiled: the probe wants a shape and a dtype, and a
    # compiled no-grad graph for it would cost a compile of seconds (a minute on a CPU) that
    # training uses only with --recompute (made here, outside the try: its failure is no
    # disagreement about the model)
    eagerly = _eagerly()
    try:
        with torch.no_grad(), host.autocast(), eagerly:
            probe = host.compute_module(host.newest_version())(
                torch.zeros(host.in_sig.shape, dtype=host.in_sig.dtype, device=device))
    except Exception as e:  # the blocks cannot consume what the previous stage sends
        raise StageError(f"stage {stage} cannot run its blocks on input {host.in_sig.describe()}: "
                         f"{str(e).splitlines()[0]}; the stages disagree about the model") from None
    host.out_sig = Signature(tuple(probe.shape), probe.dtype)
    msg = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
    msg[:3] = torch.tensor(settings)
    msg[3] = DTYPES.index(probe.dtype)
    msg[4] = probe.dim()
    msg[5:5 + probe.dim()] = torch.tensor(probe.shape)
    msg[-2] = checksum
    msg[-1] = tokens_per_microbatch
    message(dist.send, msg)
    return tokens_per_microbatch
