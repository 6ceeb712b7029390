"""What stages exchange around their optimizer steps, without waiting on each other's progress:
the gradients and new values of tied weights (ties.py, docs/design.md §1.13) and the per-parameter
norms for clipping by the previous step's norm (clipping.py, §1.14).

Timing (the reason nothing stalls). A mirror's stage (e.g. the last, holding the tied head) sends
its gradient of step t at its own optimizer step, which comes before the owner's (the first stage
finishes a step last). The owner adds it, steps, and sends the new values; the mirror installs them
right before the first forward on that version (in 2bw: version t+1, first used by step t+2, long
after the owner's step t; in a flushing schedule the owner's step precedes every forward of step
t+1 anyway). The clipping norms of step t are all-gathered at each stage's step t and first needed
at step t+1. Messages travel over gloo groups of their own (through host memory on CUDA), so they
never queue behind the pipeline's activations.
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .clipping import block_norms, block_of, clip_coefficient, keep_norm, norm_terms, total_norm
from .partition import GlobalView
from .ties import Tie, block_prefixes, mirror_names
from .transport import TransportError, peer_failure


def norm_term_blocks(model, blocks: Sequence, partition: Sequence[Sequence[int]], ties: Sequence[Tie]) -> list:
    """Per stage, the block (its name in the model) of each of the stage's clipping-norm terms: its
    parameters but tied mirrors, in the order ``StepExchange.before_step`` measures them (the
    stage's parameters by global name, ``partition.GlobalView``)."""
    mirrors = set(mirror_names(ties))
    out = []
    for indices in partition:
        prefixes = block_prefixes(model, blocks, indices)
        view = GlobalView([blocks[i] for i in indices], prefixes)
        out.append([block_of(name, prefixes) for name, _ in view.named_parameters() if name not in mirrors])
    return out


def _pairs_across_stages(ties: Sequence[Tie], stage_of_block: dict) -> list[tuple[int, int]]:
    pairs = set()
    for tie in ties:
        a = stage_of_block[tie.owner.block]
        for use in tie.mirrors:
            b = stage_of_block[use.block]
            if a != b:
                pairs.add((min(a, b), max(a, b)))
    return sorted(pairs)


class StepExchange:
    """One stage's part of the tied-weight and clipping exchanges (created on every rank: group
    creation is collective over the whole world)."""

    def __init__(self, *, stage: int, replica: int, layout, partition: Sequence[Sequence[int]],
                 ties: Sequence[Tie], names: Sequence[str], sizes: Sequence[int],
                 norm_terms_per_stage: Sequence[int], clip_grad_norm: Optional[float], timeout_s: float,
                 term_blocks: Optional[Sequence[Sequence[str]]] = None):
        """``term_blocks`` (--log-block-grad-norms): per stage, the block of each of its norm terms
        (``norm_term_blocks``); each gathered step's norms are then also summed per block."""
        self.stage, self.stages = stage, len(partition)
        self.timeout = datetime.timedelta(seconds=2 * timeout_s)  # the watchdog reports first
        self.peer_wait = lambda what: contextlib.nullcontext()  # the watchdog's, set by the stage host
        stage_of_block = {b: s for s, blocks in enumerate(partition) for b in blocks}
        offsets, offset = {}, 0
        for name, n in zip(names, sizes):
            offsets[name] = (offset, n)
            offset += n
        self.offsets = offsets
        # Owned here: per tie, the mirrors in block order, each ("local", name) or ("remote", stage).
        self.owned = []
        self.mirrored = []  # (mirror name, owner stage): local mirrors of remote owners
        for tie in ties:
            owner_stage = stage_of_block[tie.owner.block]
            if owner_stage == stage:
                uses = [("local", u.name) if stage_of_block[u.block] == stage else ("remote", stage_of_block[u.block])
                        for u in tie.mirrors]
                self.owned.append((tie.owner.name, uses))
            else:
                for u in tie.mirrors:
                    if stage_of_block[u.block] == stage:
                        self.mirrored.append((u.name, owner_stage))
        self.mirror_names = {u.name for tie in ties for u in tie.mirrors if stage_of_block[u.block] == stage}
        self.groups = {}
        pairs = _pairs_across_stages(ties, stage_of_block)
        for r in range(layout.replicas):
            for a, b in pairs:  # every rank creates every group, in the same order
                group = dist.new_group([layout.rank(r, a), layout.rank(r, b)], timeout=self.timeout, backend="gloo")
                if r == replica and stage in (a, b):
                    self.groups[b if stage == a else a] = group
        self.peer_rank = {s: layout.rank(replica, s) for s in range(self.stages)}
        self.clip_max = clip_grad_norm
        self.clip_group = None
        if clip_grad_norm is not None and self.stages > 1:
            for r in range(layout.replicas):
                group = dist.new_group(layout.pipeline_ranks(r), timeout=self.timeout, backend="gloo")
                if r == replica:
                    self.clip_group = group
        self.pad = max(norm_terms_per_stage)  # every stage's norms fill a gather slot of this length
        self.previous_norm: Optional[float] = None
        self.norms: dict[int, float] = {}  # step index -> its global norm, as each gather completes
        self.term_blocks = term_blocks
        self.block_norms: dict[int, dict] = {}  # step index -> {block: norm}, with term_blocks
        self._gather = None        # (step, work, outputs) of the norms all-gather in flight
        self._grad_recvs = {}      # step -> [(work, buffer)] posted for the owned remote mirrors
        self._weight_recvs = {}    # version -> [(work, buffer, mirror name)]
        self._sends = []           # (work, buffer) in flight
        self._last_step = -1

    @property
    def active(self) -> bool:
        return bool(self.owned or self.mirrored or self.clip_max is not None)

    # ---- helpers ---------------------------------------------------------------------------
    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        offset, n = self.offsets[name]
        return flat[offset:offset + n]

    def _wait(self, work, what: str, peer: int) -> None:
        try:
            with self.peer_wait(f"waiting for {what}" + (f" with stage {peer}" if peer >= 0 else "")):
                work.wait(self.timeout)
        except RuntimeError as e:
            raise TransportError(f"stage {self.stage}: {what} with stage {peer} failed -- {peer_failure(e)}") from None

    def _send(self, tensor: torch.Tensor, peer: int) -> None:
        buf = tensor.detach().to("cpu", copy=True)
        self._sends.append((dist.isend(buf, dst=self.peer_rank[peer], group=self.groups[peer]), buf, peer))

    def _recv(self, numel: int, peer: int):
        buf = torch.empty(numel, dtype=torch.float32)
        return dist.irecv(buf, src=self.peer_rank[peer], group=self.groups[peer]), buf

    def _post_grad_recvs(self, step: int) -> None:
        if step > self._last_step or step in self._grad_recvs:
            return
        posted = []
        for owner, uses in self.owned:
            for kind, where in uses:
                if kind == "remote":
                    posted.append((*self._recv(self.offsets[owner][1], where), where))
        if posted:
            self._grad_recvs[step] = posted

    # ---- segment boundaries ------------------------------------------------------------------
    def begin_segment(self, first_step: int, steps: int) -> None:
        self._last_step = first_step + steps - 1
        self._post_grad_recvs(first_step)

    def end_segment(self, buffer_for) -> None:
        """Drain: install every received weight (``buffer_for(version)``: the flat buffer holding
        it), finish sends and the last norms gather."""
        for version in sorted(self._weight_recvs):
            self.install(version, buffer_for(version))
        for work, _, peer in self._sends:
            self._wait(work, "sending tied weights/gradients", peer)
        self._sends.clear()
        self._finish_gather()

    # ---- the optimizer step ------------------------------------------------------------------
    @torch.no_grad()
    def before_step(self, step: int, grad_flat: torch.Tensor, skip: bool) -> None:
        """Tied gradients summed into their owners; the gradient clipped by c(step)."""
        for name, owner_stage in self.mirrored:
            self._send(self._view(grad_flat, name), owner_stage)
        received = iter(self._grad_recvs.pop(step, []))
        for owner, uses in self.owned:
            target = self._view(grad_flat, owner)
            for kind, where in uses:
                if kind == "local":
                    target.add_(self._view(grad_flat, where))
                else:
                    work, buf, peer = next(received)
                    self._wait(work, f"receiving the tied gradient of step {step}", peer)
                    target.add_(buf.to(target.device))
        self._post_grad_recvs(step + 1)
        if self.clip_max is None:
            return
        coefficient = clip_coefficient(self.clip_max, self._finish_gather())
        if not skip:
            terms = norm_terms(self._view(grad_flat, n) for n in self.offsets if n not in self.mirror_names)
            self._start_gather(step, terms)
            if coefficient < 1.0:
                grad_flat.mul_(coefficient)

    def after_step(self, step: int, new_flat: torch.Tensor) -> None:
        """The owners' new values to their mirrors (local: copied; remote: sent). A stage with
        remote-owned mirrors posts the receive of version step+1."""
        for owner, uses in self.owned:
            value = self._view(new_flat, owner)
            for kind, where in uses:
                if kind == "local":
                    self._view(new_flat, where).copy_(value)
                else:
                    self._send(value, where)
        if self.mirrored:
            self._weight_recvs[step + 1] = [(*self._recv(self.offsets[name][1], owner_stage), owner_stage, name)
                                            for name, owner_stage in self.mirrored]
        self._sends = [s for s in self._sends if not s[0].is_completed()]

    @torch.no_grad()
    def install(self, version: int, flat: torch.Tensor) -> None:
        """Before version ``version`` is used here: copy in its tied values from their owners."""
        for work, buf, peer, name in self._weight_recvs.pop(version, []):
            self._wait(work, f"receiving the tied weights of version {version}", peer)
            self._view(flat, name).copy_(buf)

    # ---- clipping norms ------------------------------------------------------------------------
    def _start_gather(self, step: int, terms: list) -> None:
        values = torch.zeros(self.pad, dtype=torch.float64)
        values[:len(terms)] = torch.tensor(terms, dtype=torch.float64)
        if self.clip_group is None:
            self._gather = (step, None, [values])
            return
        outputs = [torch.empty_like(values) for _ in range(self.stages)]
        work = dist.all_gather(outputs, values, group=self.clip_group, async_op=True)
        self._gather = (step, work, outputs)

    def _finish_gather(self) -> Optional[float]:
        """The previous step's global norm (waiting for its gather if still in flight)."""
        if self._gather is not None:
            step, work, outputs = self._gather
            if work is not None:
                self._wait(work, f"gathering the gradient norms of step {step}", -1)
            # Stage order, parameter order; zero padding adds nothing, so the sum is the simulator's.
            terms = [out.tolist() for out in outputs]
            self.previous_norm = total_norm(v for stage_terms in terms for v in stage_terms)
            keep_norm(self.norms, step, self.previous_norm)
            if self.term_blocks is not None:
                keep_norm(self.block_norms, step, block_norms(
                    (v for stage_terms, labels in zip(terms, self.term_blocks) for v in stage_terms[:len(labels)]),
                    (label for labels in self.term_blocks for label in labels)))
            self._gather = None
        return self.previous_norm

    def state_dict(self) -> dict:
        return {"previous_norm": self._finish_gather()}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.previous_norm = None if not state else state.get("previous_norm")


__all__ = ["StepExchange", "norm_term_blocks"]
