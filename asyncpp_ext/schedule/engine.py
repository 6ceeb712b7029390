"""Pipeline schedules: build, validate, simulate and plot (the Python face of the C++ engine).

A schedule covers ``steps`` (K) minibatches of ``microbatches`` (m) microbatches on ``stages`` (S)
pipeline stages; ``sched.programs[s]`` is the instruction stream stage ``s`` executes. Kinds:

* ``gpipe``: all forwards, all backwards, flush, optimizer step (weights version t in step t).
* ``1f1b``: PipeDream-Flush; stage s runs S-s-1 warm-up forwards, then one forward / one backward,
  then drains; flush and optimizer step at the end of each step (version t in step t).
* ``2bw``: PipeDream-2BW; the same 1F1B pattern runs continuously over all K*m microbatches
  without a flush. Step t uses weight version max(t-1, 0); each stage applies step t's optimizer
  step right after its own last backward of step t. Needs m >= S.
* ``pipedream``: the original PipeDream (weight stashing): the 2bw stream with one microbatch per
  step (needs m = 1). Stage s runs step t's forward and backward on version max(t - (S-1-s), 0),
  so each forward uses the newest weights and its backward the stashed copy; the optimizer step
  of step t follows the stage's backward of step t and creates version t+1. Stage s holds at
  most S-s versions; it reaches them once K >= 2(S-1-s), so ``max_versions`` is
  [S, S-1, ..., 1] for K >= 2(S-1).

Bubble fraction of the continuous streams (2bw, pipedream) with uniform per-stage costs and no
message latency: with N = K*m microbatches, forward f, backward b and optimizer step o, stage 0
finishes last, at makespan (S-1)(f+b) + N(f+b) + K*o, so::

    bubble = (S-1)(f+b) / ((S-1)(f+b) + N(f+b) + K*o)      = (S-1)/(N+S-1) when o = 0

(for pipedream N = K: (S-1)/(K+S-1)).

Example::

    from asyncpp_ext import schedule
    res = schedule.simulate("2bw", stages=4, microbatches=8, steps=10, fwd=1.0, bwd=2.0)
    print(res.bubble_fraction)          # (S-1)/(K*m+S-1) = 3/83
    schedule.plot_timeline(res, "timeline.png")
"""
from __future__ import annotations

import dataclasses
import json
import numbers
from typing import List, NamedTuple, Optional, Sequence, Union

from .._ext import MAX_COUNT, C, without_source_location
from .table import schedule_names, schedule_spec

Schedule = C.Schedule
Instruction = C.Instruction
Op = C.Op
ScheduleKind = C.ScheduleKind

SCHEDULES = schedule_names(pipeline_only=True)
"""The schedules the engine builds (the table's pipeline rows: schedule/table.py)."""


class ScheduleError(ValueError):
    """A schedule failed validation. ``problems`` holds one line per problem found."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid schedule:\n  " + "\n  ".join(self.problems))


def _check_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer (got {value!r} of type {type(value).__name__})")
    if value > MAX_COUNT:
        raise ValueError(f"{name}={value} is more than the core takes ({MAX_COUNT}); give a smaller count")
    return int(value)


def _check_kind(schedule) -> str:
    """The C++ kind a pipeline schedule's name builds with (ValueError for other names)."""
    if schedule not in schedule_names(pipeline_only=True):
        raise ValueError(f"unknown schedule {schedule!r}: choose one of "
                         f"{', '.join(schedule_names(pipeline_only=True))}")
    return schedule_spec(schedule).core


def build(schedule: str, stages: int, microbatches: int, steps: int = 1) -> Schedule:
    """Build the instruction streams of ``schedule`` ('gpipe', '1f1b', '2bw' or 'pipedream').

    Raises ValueError (naming the fix) for stages, microbatches or steps < 1, for 2bw with
    fewer microbatches than stages, and for pipedream with microbatches other than 1.
    """
    args = (_check_kind(schedule), _check_int(stages, "stages"), _check_int(microbatches, "microbatches"),
            _check_int(steps, "steps"))
    try:
        return C.build_schedule(*args)
    except ValueError as exc:  # the core's size checks: their message, without its source location
        raise ValueError(without_source_location(exc)) from None


def validate(sched: Schedule, *, raise_on_error: bool = True) -> List[str]:
    """Check a schedule; see ``csrc/core/validator.h`` for what is checked.

    With ``raise_on_error=True`` (the default) an invalid schedule raises :class:`ScheduleError`
    whose message lists every problem; a valid one returns ``[]``. With ``raise_on_error=False``
    the list of problems is returned (empty when valid). Each problem names the stage, the
    instruction (op and index in the program) and the microbatch, e.g.
    ``"stage 2, instruction #17 send_act (step 0, mb 3): no matching recv_act on stage 3"``.
    """
    if not isinstance(sched, Schedule):
        raise TypeError(f"validate() needs a Schedule (from schedule.build), got {type(sched).__name__}")
    problems = list(C.validate_schedule(sched))
    if problems and raise_on_error:
        raise ScheduleError(problems)
    return problems


class TimelineEntry(NamedTuple):
    """One compute instruction (forward, backward or optimizer_step) as simulated."""

    stage: int
    op: str
    step: int
    microbatch: int  # -1 for optimizer_step
    version: int  # weights used (forward/backward) or created (optimizer_step)
    start: float
    end: float


@dataclasses.dataclass
class SimResult:
    """Outcome of :func:`simulate`. Lists are per stage; times are in the units of the costs."""

    schedule: str
    stages: int
    microbatches: int
    steps: int
    fwd: List[float]
    bwd: List[float]
    p2p: float
    opt: List[float]
    makespan: float
    busy: List[float]
    idle: List[float]
    bubble_fraction: float  # 1 - sum(busy) / (stages * makespan)
    peak_inflight: List[int]  # most microbatches forwarded but not yet backwarded
    max_versions: List[int]  # most weight versions alive at once (pipedream: S-s on stage s)
    timeline: List[TimelineEntry]

    def to_dict(self, include_timeline: bool = True) -> dict:
        d = dataclasses.asdict(self)
        if include_timeline:
            d["timeline"] = [e._asdict() for e in self.timeline]
        else:
            del d["timeline"]
        return d

    def to_json(self, include_timeline: bool = True, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(include_timeline), indent=indent)


def _per_stage(value, stages: int, name: str) -> List[float]:
    """A scalar cost broadcast to every stage, or a per-stage sequence of length ``stages``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        values = [float(value)] * stages
    else:
        try:
            if isinstance(value, (str, bytes)) or any(isinstance(v, (bool, str, bytes)) for v in value):
                raise TypeError  # "12" would be the costs 1 and 2
            values = [float(v) for v in value]
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a number or a sequence of {stages} numbers "
                            f"(got {value!r})") from None
        if len(values) != stages:
            raise ValueError(f"{name} has {len(values)} values but the schedule has {stages} "
                             f"stages: pass a scalar or one value per stage")
    for s, v in enumerate(values):
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"{name} cost of stage {s} is {v}: costs must be finite and >= 0")
    return values


def simulate(sched_or_name: Union[Schedule, str], stages: Optional[int] = None,
             microbatches: Optional[int] = None, steps: Optional[int] = None, *, fwd=1.0, bwd=2.0,
             p2p: float = 0.0, opt=0.0) -> SimResult:
    """Simulate a schedule (or build one by name first) with the given compute costs.

    ``fwd``, ``bwd`` and ``opt`` (optimizer step) are per-stage costs: a scalar applies to every
    stage. ``p2p`` is the latency added to every message. Sends never block; a stage waits only
    when a forward/backward needs data that has not arrived. An invalid schedule raises
    ValueError listing its problems.
    """
    if isinstance(sched_or_name, str):
        if stages is None or microbatches is None:
            raise ValueError("simulate(name, ...) needs stages= and microbatches= "
                             "(or pass a Schedule from schedule.build)")
        sched = build(sched_or_name, stages, microbatches, 1 if steps is None else steps)
    elif isinstance(sched_or_name, Schedule):
        sched = sched_or_name
        for given, actual, name in ((stages, sched.stages, "stages"),
                                    (microbatches, sched.microbatches, "microbatches"),
                                    (steps, sched.steps, "steps")):
            if given is not None and given != actual:
                raise ValueError(f"{name}={given} contradicts the schedule's {name}={actual}: "
                                 f"leave it out when passing a Schedule")
    else:
        raise TypeError(f"simulate() needs a schedule name ({', '.join(SCHEDULES)}) or a "
                        f"Schedule, got {type(sched_or_name).__name__}")
    S = sched.stages
    fwd_l, bwd_l, opt_l = (_per_stage(fwd, S, "fwd"), _per_stage(bwd, S, "bwd"),
                           _per_stage(opt, S, "opt"))
    if isinstance(p2p, bool) or not isinstance(p2p, numbers.Real):
        raise TypeError(f"p2p must be a number (the latency added to every message), got {p2p!r}")
    p2p = float(p2p)
    if not p2p >= 0 or p2p == float("inf"):
        raise ValueError(f"p2p latency is {p2p}: it must be finite and >= 0")
    raw = C.simulate_schedule(sched, fwd_l, bwd_l, opt_l, p2p)
    return SimResult(schedule=sched.kind_name, stages=S, microbatches=sched.microbatches,
                     steps=sched.steps, fwd=fwd_l, bwd=bwd_l, p2p=p2p, opt=opt_l,
                     makespan=raw["makespan"], busy=list(raw["busy"]), idle=list(raw["idle"]),
                     bubble_fraction=raw["bubble_fraction"],
                     peak_inflight=list(raw["peak_inflight"]),
                     max_versions=list(raw["max_versions"]),
                     timeline=[TimelineEntry(*e) for e in raw["timeline"]])


def plot_timeline(result: SimResult, path, *, title: Optional[str] = None) -> str:
    """Draw the simulated timeline to ``path`` (PNG, SVG, PDF... by extension; ``.png`` is added
    to a name without one) and return the name of the file written.

    One row per stage (stage 0 on top). Boxes are coloured by microbatch, forwards light and
    backwards dark, labelled with the microbatch and the weight version (``3|v1``); with one
    microbatch per step (pipedream) boxes are coloured and labelled by step instead (``5|v2``:
    step 5 on version 2). Odd steps are hatched so step boundaries show, and each optimizer step
    is a black bar labelled with the version it creates.
    """
    from .plot import draw_timeline

    return draw_timeline(result, path, title=title)


__all__ = ["SCHEDULES", "Instruction", "Op", "Schedule", "ScheduleError", "ScheduleKind",
           "SimResult", "TimelineEntry", "build", "plot_timeline", "simulate", "validate"]
