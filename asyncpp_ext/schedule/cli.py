"""``asyncpp-schedule``: simulate a pipeline schedule and report its bubble, memory and timeline.

    asyncpp-schedule --schedule 2bw --stages 4 --microbatches 8 --steps 10 [--fwd 1 --bwd 2]
                     [--p2p 0] [--opt 0] [--json] [--plot timeline.png]
    asyncpp-schedule --schedule pipedream --stages 4 --microbatches 1 --steps 16 --json

Also runs as ``python -m asyncpp_ext.schedule``. Bad input prints one line starting with
``asyncpp-schedule: error:`` on stderr and exits with status 2; Ctrl-C, SIGTERM and SIGHUP print
one line and exit 128 + the signal's number, leaving no plot behind.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from typing import List, Optional

from .._ext import MAX_COUNT, C, without_source_location
from ..command_line import OneLineParser, UsageError
from ..stop_signals import stop_signals_raise
from .table import schedule_names

PROG = "asyncpp-schedule"
SCHEDULE_CHOICES = schedule_names(pipeline_only=True)  # the pipeline rows of the schedule table
_COUNTS = {"stages": ("--stages/-S", "use at least one stage"),
           "microbatches": ("--microbatches/-m", "split each minibatch into at least one microbatch"),
           "steps": ("--steps/-K", "schedule at least one step")}


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Simulate a pipeline schedule "
                f"({', '.join(SCHEDULE_CHOICES)}) and report per-stage busy/idle time, peak "
                "in-flight microbatches, weight versions and the bubble fraction.")
    p.add_argument("--schedule", required=True, choices=SCHEDULE_CHOICES)
    p.add_argument("--stages", "-S", type=int, required=True, help="pipeline stages S (>= 1)")
    p.add_argument("--microbatches", "-m", type=int, required=True,
                   help="microbatches per step m (>= 1; 2bw needs m >= S, pipedream m = 1)")
    p.add_argument("--steps", "-K", type=int, default=1, help="optimizer steps K (default 1)")
    p.add_argument("--fwd", type=float, default=1.0, help="forward cost per stage (default 1.0)")
    p.add_argument("--bwd", type=float, default=2.0, help="backward cost per stage (default 2.0)")
    p.add_argument("--p2p", type=float, default=0.0, help="latency of each message (default 0)")
    p.add_argument("--opt", type=float, default=0.0, help="optimizer-step cost (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--timeline", action="store_true",
                   help="with --json, include the full timeline of compute instructions")
    p.add_argument("--plot", metavar="PATH", help="write the timeline picture (e.g. timeline.png)")
    return p


def _table(res) -> str:
    head = f"{'stage':>5}  {'busy':>10}  {'idle':>10}  {'peak in-flight':>14}  {'max versions':>12}"
    lines = [f"schedule {res.schedule}: S={res.stages} m={res.microbatches} K={res.steps} "
             f"(fwd={res.fwd[0]:g} bwd={res.bwd[0]:g} p2p={res.p2p:g} opt={res.opt[0]:g})",
             head, "-" * len(head)]
    for s in range(res.stages):
        lines.append(f"{s:>5}  {res.busy[s]:>10g}  {res.idle[s]:>10g}  "
                     f"{res.peak_inflight[s]:>14d}  {res.max_versions[s]:>12d}")
    lines.append(f"makespan {res.makespan:g}   bubble fraction {res.bubble_fraction:.6f}")
    return "\n".join(lines)


def _check_counts(args) -> None:
    # Checked here rather than left to the core, whose messages cannot name the flags.
    for name, (flag, fix) in _COUNTS.items():
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"{flag} must be >= 1 (got {value}); {fix}")
        if value > MAX_COUNT:  # the C++ core counts in 32-bit integers
            raise ValueError(f"{flag} {value} is more than {MAX_COUNT}; pass a smaller count")
    if args.stages * args.microbatches * args.steps > C.MAX_SCHEDULE_WORK:
        raise ValueError(f"the schedule is too large: --stages x --microbatches x --steps = {args.stages} x "
                         f"{args.microbatches} x {args.steps} is more than {C.MAX_SCHEDULE_WORK}; "
                         "lower any of the three")


def _run(args) -> str:
    from . import engine as sc
    from . import plot

    _check_counts(args)
    for name in ("fwd", "bwd", "p2p", "opt"):
        value = getattr(args, name)
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"--{name} must be a finite cost >= 0 (got {value})")
    if args.timeline and not args.json:
        raise ValueError("--timeline adds the timeline to the JSON output; add --json (or use --plot PATH "
                         "for a picture)")
    if args.plot is not None:  # before simulating: a refused plot should not cost the simulation's time
        try:
            plot.check_plot_path(args.plot)
        except ValueError as e:
            raise ValueError(f"--plot {e}") from None
        boxes = plot.plot_boxes(args.stages, args.microbatches, args.steps)
        if boxes > plot.MAX_PLOT_BOXES:
            raise ValueError(f"--plot would draw {boxes} boxes, more than {plot.MAX_PLOT_BOXES}; lower "
                             "--stages, --microbatches or --steps, or leave out --plot")
    res = sc.simulate(args.schedule, stages=args.stages, microbatches=args.microbatches,
                      steps=args.steps, fwd=args.fwd, bwd=args.bwd, p2p=args.p2p, opt=args.opt)
    # The bubble fraction divides by stages x makespan: past a float's range it reads 1 or nan.
    if not math.isfinite(res.stages * res.makespan):
        raise ValueError(f"the costs overflow (makespan x stages = {res.makespan:g} x {res.stages} is more "
                         "than a float holds); use smaller --fwd/--bwd/--p2p/--opt")
    written = None
    if args.plot is not None:  # before printing, so a bad path leaves no half-finished output behind
        try:
            written = sc.plot_timeline(res, args.plot)
        except OSError as e:
            raise ValueError(f"cannot write plot to {args.plot!r}: {e.strerror or e}; "
                             "choose a writable path") from None
    if args.json:
        d = res.to_dict(include_timeline=args.timeline)
        if written:
            d["plot"] = written
        return json.dumps(d)
    return _table(res) + (f"\ntimeline written to {written}" if written else "")


def _print(text: str) -> int:
    """``text`` on stdout: 0, or 1 with one line when stdout cannot take it (a full disk), or
    128 + SIGPIPE when its reader went away, as for any command a pipe's reader stops
    reading (``| head``): the shell's ``pipefail`` can then tell the output was cut short."""
    try:
        print(text, flush=True)
    except OSError as e:
        # what stays in stdout's buffer would fail again at the interpreter's flush on exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if isinstance(e, BrokenPipeError):
            return 128 + signal.SIGPIPE
        print(f"{PROG}: error: could not write the output ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    try:
        with stop_signals_raise():
            try:
                args = _parser().parse_args(argv)
            except SystemExit as e:  # --help / --version: argparse already printed
                return int(e.code or 0)
            return _print(_run(args))
    except (UsageError, ValueError, TypeError) as e:
        print(f"{PROG}: error: {without_source_location(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP raised as Stopped
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{PROG}: {'interrupted' if signum == signal.SIGINT else e}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
