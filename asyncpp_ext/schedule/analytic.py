"""Closed-form bubble and memory of pipeline schedules: ours and the synchronous peers.

Two ways to state a bubble, both used below:

* ``fraction`` = idle / (stages x makespan): the share of every stage's wall time spent idle. This is
  what the C++ simulator reports (``simulate(...).bubble_fraction``); 1 - fraction is the fraction
  of the bubble-free ideal a schedule reaches.
* ``rate`` = idle / busy: the bubble as a multiple of the useful compute, the zero-bubble paper's
  "bubble rate" ((p-1)/m for 1F1B). ``fraction = rate / (1 + rate)``.

Costs are per stage (all its chunks together): ``fwd`` forward, ``bwd`` the whole backward
(``bwd_input + bwd_weight`` where a schedule splits it), ``opt`` one optimizer step. A step is m
microbatches; K steps run as one stream.

Our schedules (exact for uniform stages and no message latency; ``tests/test_schedule_analytic.py``
checks them against ``simulate``):

==========  =====================================================  ===========================
schedule    makespan of K steps                                    steady bubble fraction (o=0)
==========  =====================================================  ===========================
gpipe       K((m+S-1)(f+b) + o)                                    (S-1)/(m+S-1)
1f1b        K((m+S-1)(f+b) + o)                                    (S-1)/(m+S-1)
2bw         (S-1)(f+b) + Km(f+b) + Ko   (one fill and drain)       0   ((S-1)/(Km+S-1) for K steps)
pipedream   (S-1)(f+b) + K(f+b+o)       (m = 1 per step)           0
==========  =====================================================  ===========================

The peers (torch.distributed.pipelining), as published, with p = S stages, v chunks per rank and
F, B, W the forward, input-gradient and weight-gradient time of a rank's whole stage:

* GPipe, 1F1B: idle (p-1)(F+B+W) per step, rate (p-1)/m [Huang et al. 2019; Narayanan et al. 2021].
* Interleaved 1F1B with v chunks: rate (p-1)/(v m) [Narayanan et al. 2021, arXiv:2104.04473 §2.2.2].
* ZB-H1 (1F1B order, W deferred): rate (p-1)/(3m) when F = B = W; ZB-H2 and ZB-V: 0 when F = B = W
  (ZB-V with two chunks per rank in a V) [Qi et al. 2024, arXiv:2401.10241; the authors' comparison
  table: activation memory 1x / 1x / 2x / 1x of 1F1B's and pipeline traffic 1x / 1x / 1x / 2x for
  1F1B / ZB-H1 / ZB-H2 / ZB-V]. The general forms ``zb_h1``: (p-1)(F+B-W), ``zb_h2``: (p-1)(F+B-2W)
  (not below 0) reduce to these.

torch's own action orders differ in details from the papers' (torch's InterleavedZeroBubble is an
interleaved ZB-H1 with two chunks, DualPipeV has no closed form here): :func:`simulate_actions`
runs any per-rank order of F / B / I / W actions with given costs, and is checked against the C++
simulator on our own programs. ``bench/peer_schedules.py`` applies it to torch's orders.

Memory per stage (docs/design.md §3): weight versions x P, the gradient buffer P, optimizer state,
and activations in flight x A (A = what one microbatch saves on the whole stage).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

from .table import schedule_spec

OURS = ("gpipe", "1f1b", "2bw", "pipedream")
"""Schedules our engine builds; their formulas below are exact against ``simulate``."""


def _check(schedule: str, stages: int, microbatches: int, steps: int) -> None:
    if schedule not in OURS:
        raise ValueError(f"no closed form for {schedule!r}: one of {', '.join(OURS)}")
    if stages < 1 or microbatches < 1 or steps < 1:
        raise ValueError("stages, microbatches and steps must be >= 1")
    schedule_spec(schedule).check(stages, microbatches)


def makespan(schedule: str, stages: int, microbatches: int, steps: int = 1, *, fwd: float = 1.0,
             bwd: float = 2.0, opt: float = 0.0) -> float:
    """Wall time of ``steps`` steps of ``schedule`` with uniform per-stage costs, no latency."""
    _check(schedule, stages, microbatches, steps)
    S, m, K, c = stages, microbatches, steps, fwd + bwd
    if schedule in ("gpipe", "1f1b"):  # every step fills and drains, then steps the optimizer
        return K * ((m + S - 1) * c + opt)
    # one continuous stream: stage 0 starts first and ends last, busy all the time in between
    # except for the (S-1) round trips of the fill and drain
    return (S - 1) * c + K * m * c + K * opt


def busy_per_stage(schedule: str, stages: int, microbatches: int, steps: int = 1, *, fwd: float = 1.0,
                   bwd: float = 2.0, opt: float = 0.0) -> float:
    _check(schedule, stages, microbatches, steps)
    return steps * (microbatches * (fwd + bwd) + opt)


def bubble_fraction(schedule: str, stages: int, microbatches: int, steps: int = 1, *, fwd: float = 1.0,
                    bwd: float = 2.0, opt: float = 0.0) -> float:
    """idle / (stages x makespan): equals ``simulate(...).bubble_fraction``."""
    span = makespan(schedule, stages, microbatches, steps, fwd=fwd, bwd=bwd, opt=opt)
    if span == 0:  # nothing to run (every cost zero): no idle time either, as simulate() says
        return 0.0
    return 1.0 - busy_per_stage(schedule, stages, microbatches, steps, fwd=fwd, bwd=bwd, opt=opt) / span


def bubble_rate(schedule: str, stages: int, microbatches: int, steps: int = 1, *, fwd: float = 1.0,
                bwd: float = 2.0, opt: float = 0.0) -> float:
    """idle / busy (the zero-bubble paper's bubble rate): (S-1)/m for gpipe and 1f1b with o = 0."""
    frac = bubble_fraction(schedule, stages, microbatches, steps, fwd=fwd, bwd=bwd, opt=opt)
    return frac / (1.0 - frac)


def steady_bubble_fraction(schedule: str, stages: int, microbatches: int) -> float:
    """The bubble of a long run (K -> infinity, o = 0): (S-1)/(m+S-1) for a flushing schedule, 0 for
    a continuous stream."""
    _check(schedule, stages, microbatches, 1)
    return (stages - 1) / (microbatches + stages - 1) if schedule in ("gpipe", "1f1b") else 0.0


# ---- the peers, as published ----------------------------------------------------------------

@dataclass(frozen=True)
class PeerFormula:
    name: str
    chunks: int
    source: str

    def rate(self, stages: int, microbatches: int, F: float = 1.0, B: float = 1.0, W: float = 1.0) -> float:
        """Published bubble rate (idle / compute) for per-rank costs F, B (input grad), W (weight grad)."""
        p, m, total = stages, microbatches, F + B + W
        idle = {"gpipe": (p - 1) * total,
                "1f1b": (p - 1) * total,
                "interleaved-1f1b": (p - 1) * total / self.chunks,
                "zb-h1": (p - 1) * (F + B - W),
                "zb-h2": (p - 1) * max(F + B - 2 * W, 0.0),
                "zbv": 0.0}[self.name]
        return max(idle, 0.0) / (m * total) if total > 0 else 0.0  # no compute: no bubble

    def fraction(self, stages: int, microbatches: int, F: float = 1.0, B: float = 1.0, W: float = 1.0) -> float:
        r = self.rate(stages, microbatches, F, B, W)
        return r / (1.0 + r)


PEER_FORMULAS: Dict[str, PeerFormula] = {f.name: f for f in (
    PeerFormula("gpipe", 1, "GPipe, Huang et al. 2019: rate (p-1)/m"),
    PeerFormula("1f1b", 1, "1F1B, Narayanan et al. 2021: rate (p-1)/m"),
    PeerFormula("interleaved-1f1b", 2, "Narayanan et al. 2021 (arXiv:2104.04473) 2.2.2: rate (p-1)/(v m)"),
    PeerFormula("zb-h1", 1, "Qi et al. 2024 (arXiv:2401.10241): idle (p-1)(F+B-W); (p-1)/(3m) at F=B=W"),
    PeerFormula("zb-h2", 1, "Qi et al. 2024: idle (p-1)(F+B-2W), 0 at F=B=W, 2x 1F1B's activations"),
    PeerFormula("zbv", 2, "Qi et al. 2024 section 6: 0 at F=B=W, 1F1B's activations, 2x its traffic"),
)}


# ---- memory per stage ----------------------------------------------------------------------

def activations_in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Most microbatches whose activations a stage holds at once in the steady state (units of A,
    the stage's activation bytes for one microbatch; docs/design.md §3; a first step may hold
    fewer). Peers: as published (zb-h1 = 1F1B's,
    zb-h2 = 2p - 1 on the first stage, zbv = p on every rank in units of a whole rank's A)."""
    S, m, s = stages, microbatches, stage
    if not 0 <= s < S:
        raise ValueError(f"stage {s} outside 0..{S - 1}")
    table = {"gpipe": m, "1f1b": min(S - s, m), "2bw": min(S - s, m), "pipedream": S - s,
             "zb-h1": min(S - s, m), "zb-h2": min(2 * (S - s) - 1, m), "zbv": min(S, m)}
    if schedule not in table:
        raise ValueError(f"no closed form for {schedule!r}: one of {', '.join(table)}")
    return table[schedule]


def weight_versions(schedule: str, stage: int, stages: int) -> int:
    """Weight copies a stage keeps: ours from the C++ table (2bw 2, pipedream S-s, else 1); every
    synchronous peer keeps 1."""
    if schedule in OURS:
        return schedule_spec(schedule).stage_lags(stages)[stage].versions
    if schedule not in PEER_FORMULAS:
        raise ValueError(f"unknown schedule {schedule!r}: one of {', '.join(OURS + tuple(PEER_FORMULAS))}")
    return 1


def memory_per_stage(schedule: str, stage: int, stages: int, microbatches: int, *, params: float,
                     activation: float, optimizer_factor: float = 2.0) -> dict:
    """Predicted bytes (docs/design.md §3): weights = versions x P, grads = P, optimizer state =
    ``optimizer_factor`` x P (AdamW 2), activations = in-flight x A."""
    versions = weight_versions(schedule, stage, stages)
    inflight = activations_in_flight(schedule, stage, stages, microbatches)
    out = {"weights": versions * params, "grads": params, "optimizer_state": optimizer_factor * params,
           "activations": inflight * activation, "weight_versions": versions, "in_flight": inflight}
    out["total"] = out["weights"] + out["grads"] + out["optimizer_state"] + out["activations"]
    return out


# ---- any order of actions -------------------------------------------------------------------

Action = Tuple[str, int, int]
"""(kind, stage, microbatch): kind F (forward), B (whole backward), I (input gradient), W (weight
gradient) or O (optimizer step, no dependencies; stage and microbatch ignored)."""


@dataclass
class ActionSimResult:
    makespan: float
    busy: List[float]
    bubble_fraction: float
    peak_inflight: List[float]
    """Per rank: most (stage, microbatch) pairs forwarded and not yet fully backwarded (W or B
    done), counted as 1/chunks each, i.e. in units of a rank's whole activation per microbatch."""


def simulate_actions(orders: Mapping[int, Sequence[Action]], stage_to_rank: Mapping[int, int],
                     costs: Mapping[str, float] | Mapping[Tuple[str, int], float], *,
                     chunks: int = 1) -> ActionSimResult:
    """Run per-rank action orders with no message latency: each rank runs its actions in order,
    an action starts when its rank is free and its inputs exist. F(s, i) needs F(s-1, i); B or
    I(s, i) needs B or I(s+1, i) (the last stage: its own F(s, i)); W(s, i) needs I(s, i). ``costs``
    maps a kind (or (kind, stage)) to its time. Raises ValueError on a deadlock."""
    num_stages = max(stage_to_rank) + 1
    last = num_stages - 1

    def cost(kind: str, stage: int) -> float:
        if (kind, stage) in costs:
            return float(costs[(kind, stage)])  # type: ignore[index]
        return float(costs[kind])  # type: ignore[index]

    done: Dict[Tuple[str, int, int], float] = {}
    pos = {r: 0 for r in orders}
    free = {r: 0.0 for r in orders}
    busy = defaultdict(float)
    events: Dict[int, List[Tuple[float, float]]] = defaultdict(list)  # (time, +-1/chunks)

    def ready(kind: str, stage: int, mb: int):
        """End time of the input this action waits for, or None if it does not exist yet."""
        if kind == "O":
            return 0.0
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
        if kind in ("B", "I"):
            if stage == last:
                return done.get(("F", stage, mb))
            return done.get(("B", stage + 1, mb), done.get(("I", stage + 1, mb)))
        if kind == "W":
            return done.get(("I", stage, mb))
        raise ValueError(f"unknown action kind {kind!r}")

    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            while pos[r] < len(order):
                kind, stage, mb = order[pos[r]]
                t_in = ready(kind, stage, mb)
                if t_in is None:
                    break
                start = max(free[r], t_in)
                end = start + cost(kind, stage)
                free[r] = end
                busy[r] += end - start
                done[(kind, stage, mb)] = end
                if kind == "F":
                    events[r].append((start, 1.0 / chunks))
                elif kind in ("B", "W"):
                    events[r].append((end, -1.0 / chunks))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])}
            raise ValueError(f"the orders deadlock; next actions: {stuck}")
    span = max(free.values())
    ranks = sorted(orders)
    peak = []
    for r in ranks:
        level, top = 0.0, 0.0
        for _, delta in sorted(events[r], key=lambda e: (e[0], e[1])):  # frees before allocs at a tie
            level += delta
            top = max(top, level)
        peak.append(top)
    total_busy = sum(busy[r] for r in ranks)
    return ActionSimResult(makespan=span, busy=[busy[r] for r in ranks],
                           bubble_fraction=1.0 - total_busy / (len(ranks) * span) if span else 0.0,
                           peak_inflight=peak)


def orders_of_program(sched) -> Dict[int, List[Action]]:
    """Our C++ schedule's compute instructions as action orders (one stage per rank; microbatches
    numbered across steps, so a K-step stream is one order)."""
    m = sched.microbatches
    kinds = {"forward": "F", "backward": "B", "optimizer_step": "O"}
    out: Dict[int, List[Action]] = {}
    for s, program in enumerate(sched.programs):
        acts = []
        for ins in program:
            op = str(ins.op).rsplit(".", 1)[-1]
            if op in kinds:
                acts.append((kinds[op], s, ins.step * m + max(ins.microbatch, 0)))
        out[s] = acts
    return out


def ideal_fraction(fraction: float) -> float:
    """The fraction of the bubble-free ideal a schedule with this bubble fraction reaches."""
    return 1.0 - fraction


__all__ = ["OURS", "PEER_FORMULAS", "PeerFormula", "ActionSimResult", "activations_in_flight",
           "bubble_fraction", "bubble_rate", "busy_per_stage", "ideal_fraction", "makespan",
           "memory_per_stage", "orders_of_program", "simulate_actions", "steady_bubble_fraction",
           "weight_versions"]
