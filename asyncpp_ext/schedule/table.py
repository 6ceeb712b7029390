"""The schedule table: every schedule a run can name, and what each one means for a stage.

The C++ core (``csrc/core/schedule.cpp``) owns the facts: each schedule kind's instruction
generator, how many steps each stage lags behind the newest weights, how many weight versions it
keeps, and which (stages, microbatches) it accepts. This module is their one Python face; the run
config, the pipeline stage, the delay simulator, ``asyncpp-schedule`` and the table in
``docs/design.md`` all read it, and nothing else restates a lag or a microbatch rule.

A row whose ``core`` is another name reuses that kind's generator and rules under a second
spelling: ``sync`` is the synchronous rule as a one-process run names it (no pipeline, so no
GPipe/1F1B distinction). Adding a schedule = its C++ generator and a row in ``schedule_table()``
there; it appears here by itself (see docs/design.md, "Where a new schedule goes").
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .._ext import C, without_source_location


@dataclass(frozen=True)
class StageLag:
    """What one stage of a schedule does with weight versions."""

    lag: int
    """Steps this stage computes behind the newest weights (0: every computation on the newest)."""
    versions: int
    """Weight versions the stage keeps alive at once (its ring of flat buffers)."""


@dataclass(frozen=True)
class ScheduleSpec:
    """One row of the table."""

    name: str
    """What ``--schedule`` / ``PipelineConfig.schedule`` / ``Pipeline(schedule=)`` take."""
    core: str
    """The C++ schedule kind whose generator, lags and shape rule this row uses."""
    summary: str
    """One line for --help and the docs' table."""
    pipeline: bool = True
    """Runs over real stage processes; False: only as one process (the simulator)."""

    @property
    def kind(self):
        return C.parse_schedule_kind(self.core)

    def check(self, stages: int, microbatches: int) -> None:
        """ValueError naming the fix when (stages, microbatches) cannot run this schedule."""
        try:
            C.check_schedule_shape(self.kind, stages, microbatches)
        except ValueError as exc:
            raise ValueError(without_source_location(exc)) from None

    def stage_lags(self, stages: int) -> tuple[StageLag, ...]:
        """Per stage of ``stages``: its lag and the versions it keeps (from the C++ core)."""
        return _core_lags(self.core, stages)

    def delayed(self, stages: int = 2) -> bool:
        """Some stage computes on weights older than the newest (2bw, pipedream)."""
        return any(s.lag for s in self.stage_lags(stages))

    @property
    def lag_per_stage(self) -> bool:
        """Stages lag by different amounts (pipedream): a stage's delay depends on where a block
        sits, so tied weights must share a stage, a global gradient norm would stall the stages,
        and a checkpoint resumes only at the same depth."""
        return any(len({s.lag for s in self.stage_lags(n)}) > 1 for n in (2, 3, 4))

    def uniform_lag(self) -> int:
        """The lag of every stage, for a schedule whose lag does not depend on the stage."""
        return self.stage_lags(1)[0].lag


@lru_cache(maxsize=None)
def _core_lags(core: str, stages: int) -> tuple[StageLag, ...]:
    # The one place Python asks the core for lags and version counts.
    kind = C.parse_schedule_kind(core)
    return tuple(StageLag(C.stage_lag(kind, s, stages), C.versions_alive_limit(kind, s, stages))
                 for s in range(stages))


def _core_rows() -> dict[str, ScheduleSpec]:
    rows = {"sync": ScheduleSpec("sync", "gpipe", "the synchronous rule in one process (--simulate, or "
                                 "--stages 1 --dp 1): no weight delay", pipeline=False)}
    for _kind, name, summary in C.schedule_table():
        rows[name] = ScheduleSpec(name, name, summary)
    return rows


SCHEDULES: dict[str, ScheduleSpec] = _core_rows()
"""Every schedule by name, in the order --help lists them. Tests may add a row (monkeypatch)."""


def schedule_names(pipeline_only: bool = False) -> tuple[str, ...]:
    return tuple(n for n, s in SCHEDULES.items() if s.pipeline or not pipeline_only)


def schedule_spec(name: str) -> ScheduleSpec:
    """The row of ``name``; ValueError listing the valid names otherwise."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return spec


def markdown_table(stages: int = 4) -> str:
    """The docs' schedule table (docs/design.md §2.1 holds this text; a test keeps them equal)."""
    lines = [f"| schedule | runs as | lag per stage (S={stages}) | versions kept | what it is |",
             "|---|---|---|---|---|"]
    for spec in SCHEDULES.values():
        lags = spec.stage_lags(stages)
        lines.append(f"| `{spec.name}` | {'pipeline' if spec.pipeline else 'one process'} | "
                     f"{', '.join(str(s.lag) for s in lags)} | {', '.join(str(s.versions) for s in lags)} | "
                     f"{spec.summary} |")
    return "\n".join(lines)


__all__ = ["SCHEDULES", "ScheduleSpec", "StageLag", "schedule_names", "schedule_spec", "markdown_table"]
