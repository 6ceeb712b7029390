"""Pipeline schedules: the C++ engine's builders, validator and simulator (``engine``), the
``asyncpp-schedule`` command (``cli``) and the timeline plot (``plot``)."""
from .engine import (SCHEDULES, Instruction, Op, Schedule, ScheduleError, ScheduleKind, SimResult,
                     TimelineEntry, build, plot_timeline, simulate, validate)

__all__ = ["SCHEDULES", "Instruction", "Op", "Schedule", "ScheduleError", "ScheduleKind", "SimResult",
           "TimelineEntry", "build", "plot_timeline", "simulate", "validate"]
