"""Data parallelism across pipeline replicas (PP x DP).

Rank layout: ``rank = replica * stages + stage``. Replica r's pipeline is the ranks
``r*S .. r*S + S-1`` (point-to-point messages use global ranks on the default group, so a
pipeline needs no group of its own); stage s's data-parallel group is the ranks
``s, S + s, 2S + s, ...``. Every replica takes its own share of each global microbatch (rows
``r*B .. (r+1)*B - 1`` of a microbatch of R*B sequences), so the run computes exactly what one
replica computes on the whole global microbatch: the average of the replicas' gradients is the
gradient of the mean loss over all R*B sequences.

Gradient averaging: the stage's gradients live in one flat buffer. During a step's last backward
the buffer is cut into buckets (last parameters first, as backward produces them) and each bucket's
all-reduce starts as soon as its gradients are final, overlapping the rest of that backward; the
optimizer step waits for them and divides by R. Buckets are launched strictly in order so every
rank of a group issues the same collectives in the same order. A frozen parameter
(``requires_grad=False``) has no hook and is not waited for: its slice stays zero.

Right before a bucket's all-reduce starts, its gradients are checked for NaN/Inf into a flag on
the device (torch's own kernels, no host wait, nothing uploaded): once the all-reduce runs, the
buffer holds the other replicas' values too, and whether a non-finite gradient arose on this
replica -- which decides whether its step can be skipped (nonfinite.py) -- can no longer be read
from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .flat_buffers import views_of
from .nonfinite import first_nonfinite_index

DEFAULT_BUCKET_BYTES = 4 << 20


@dataclass(frozen=True)
class Layout:
    """Where each (replica, stage) lives in a world of ``stages * replicas`` ranks."""
    stages: int
    replicas: int

    def __post_init__(self):
        for name in ("stages", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout's {name} must be an integer >= 1, got {value!r}")

    @property
    def world(self) -> int:
        return self.stages * self.replicas

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a global rank."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is not in this layout's world of {self.world} ranks")
        return divmod(rank, self.stages)

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [self.rank(replica, s) for s in range(self.stages)]

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.rank(r, stage) for r in range(self.replicas)]


def create_dp_group(layout: Layout, rank: int):
    """This rank's stage group (None without data parallelism). Collective over the whole world:
    every rank creates every stage's group, in stage order, as torch.distributed requires."""
    if layout.replicas == 1:
        return None
    mine = None
    for stage in range(layout.stages):
        group = dist.new_group(layout.dp_ranks(stage))
        if layout.coords(rank)[1] == stage:
            mine = group
    return mine


def replica_share(microbatch: torch.Tensor, replica: int, replicas: int) -> torch.Tensor:
    """Rows ``replica*B .. (replica+1)*B - 1`` of a global microbatch of R*B rows."""
    rows = microbatch.shape[0]
    if rows % replicas:
        raise ValueError(f"a global microbatch of {rows} sequences cannot be shared equally by {replicas} "
                         f"data-parallel replicas; feed microbatches of a multiple of {replicas} sequences")
    b = rows // replicas
    return microbatch[replica * b:(replica + 1) * b]


def _bucket_ranges(sizes: Sequence[int], bucket_elems: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Contiguous flat ranges, last parameter first, each of at least ``bucket_elems`` elements
    (except the final one); and each parameter's bucket index."""
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n
    ranges, bucket_of = [], [0] * len(sizes)
    hi, count = off, 0
    for i in reversed(range(len(sizes))):
        bucket_of[i] = len(ranges)
        count += sizes[i]
        if count >= bucket_elems or i == 0:
            ranges.append((offsets[i], hi))
            hi, count = offsets[i], 0
    return ranges, bucket_of


class GradientAverager:
    """Averages one stage's flat gradient buffer over its data-parallel group.

    ``replica_params``: the parameter lists of every module replica whose ``.grad`` views
    ``grad_flat`` (2bw keeps two), in flat-buffer order.
    """

    def __init__(self, grad_flat: torch.Tensor, replica_params: Sequence[Sequence[torch.Tensor]], group,
                 replicas: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if replicas < 2:
            raise ValueError(f"a GradientAverager needs >= 2 replicas, got {replicas}")
        self.grad_flat, self.group, self.replicas = grad_flat, group, replicas
        sizes = [p.numel() for p in replica_params[0]] if replica_params else []
        elems = max(1, bucket_bytes // max(1, grad_flat.element_size()))
        self.ranges, self.bucket_of = _bucket_ranges(sizes, elems) if sizes else ([], [])
        self._armed = False
        self._waiting: list[int] = []      # per bucket: parameters not yet final this backward
        self._launched = 0                 # buckets [0, _launched) have their all-reduce started
        self._works: list = []
        self._loss = None                  # (work, tensor) of the last stage's loss all-reduce
        self.hook_launches = 0             # buckets started from inside backward (overlapped)
        # per bucket: its parameters' slices of grad_flat in flat order, the first one's index, and
        # a device flag: whether this replica's own values held NaN/Inf before the all-reduce
        views = views_of(replica_params[0], grad_flat) if replica_params else []
        members = [[i for i, k in enumerate(self.bucket_of) if k == b] for b in range(len(self.ranges))]
        self._first = [m[0] for m in members]
        self._views = [[views[i] for i in m] for m in members]
        self._own_bad = torch.zeros(len(self.ranges), dtype=torch.bool, device=grad_flat.device)
        # a frozen parameter gets no gradient and no hook: its bucket waits for the others only
        self._trainable = [p.requires_grad for p in replica_params[0]] if replica_params else []
        for params in replica_params:
            for i, p in enumerate(params):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: self.grad_final(i))

    def arm(self, local_loss_mean: float | None = None) -> None:
        """Called just before a step's last backward; starts the loss all-reduce (last stage)."""
        self._armed = True
        self._waiting = [0] * len(self.ranges)
        for k, trainable in zip(self.bucket_of, self._trainable):
            self._waiting[k] += trainable
        self._launched, self._works = 0, []
        if local_loss_mean is not None:
            t = torch.tensor([local_loss_mean], dtype=torch.float64)
            self._loss = (dist.all_reduce(t, group=self.group, async_op=True), t)

    def grad_final(self, i: int) -> None:
        """Parameter ``i``'s gradient is complete for this step (autograd's hook on it, or the
        compute copies' for a weight the backward computed on a copy: compute_copies.py)."""
        if not self._armed:
            return
        self._waiting[self.bucket_of[i]] -= 1
        while self._launched < len(self.ranges) and self._waiting[self._launched] == 0:
            self._launch_next()
            self.hook_launches += 1

    def _launch_next(self) -> None:
        k = self._launched
        lo, hi = self.ranges[k]
        torch.logical_not(torch.isfinite(self.grad_flat[lo:hi]).all(), out=self._own_bad[k])  # ours alone
        self._works.append(dist.all_reduce(self.grad_flat[lo:hi], group=self.group, async_op=True))
        self._launched += 1

    def launch_rest(self) -> None:
        """After the last backward: start buckets whose parameters got no gradient this time."""
        while self._launched < len(self.ranges):
            self._launch_next()
        self._armed = False

    def own_first_nonfinite(self) -> int:
        """After ``launch_rest``: -1 when no bucket held NaN/Inf on this replica before its
        all-reduce (one read from the device); else a parameter (its flat-order index) to name: the
        first non-finite one of the first such bucket, found after that bucket's average (a NaN/Inf
        of ours stays one; a parameter only another replica made non-finite may come first)."""
        if self._armed or self._launched < len(self.ranges):
            raise RuntimeError("own_first_nonfinite() reads the checks made as each bucket's all-reduce "
                               "starts: call it after launch_rest()")
        bad = [k for k, b in enumerate(self._own_bad.tolist()) if b]
        if not bad:
            return -1
        k = min(bad, key=lambda b: self.ranges[b][0])  # the first in flat order
        self._works[k].wait()
        return self._first[k] + max(0, first_nonfinite_index(self._views[k]))

    def finish(self) -> float | None:
        """Wait for every all-reduce and divide by R; returns the global mean loss on the last
        stage (None elsewhere)."""
        if self._armed:
            self.launch_rest()
        for work in self._works:
            work.wait()
        self._works = []
        self.grad_flat.div_(self.replicas)
        loss = None
        if self._loss is not None:
            work, t = self._loss
            work.wait()
            loss = float(t.item() / self.replicas)
            self._loss = None
        return loss


__all__ = ["Layout", "create_dp_group", "replica_share", "GradientAverager", "DEFAULT_BUCKET_BYTES"]
