"""``asyncpp-schedule``: simulate a pipeline schedule and report its bubble, memory and timeline.

    asyncpp-schedule --schedule 2bw --stages 4 --microbatches 8 --steps 10 [--fwd 1 --bwd 2]
                     [--p2p 0] [--opt 0] [--json] [--plot timeline.png]
    asyncpp-schedule --schedule pipedream --stages 4 --microbatches 1 --steps 16 --json

Also runs as ``python -m asyncpp_ext.schedule``. Bad input prints one line starting with
``asyncpp-schedule: error:`` on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .._ext import MAX_COUNT, without_source_location
from .table import schedule_names

PROG = "asyncpp-schedule"
SCHEDULE_CHOICES = schedule_names(pipeline_only=True)  # the pipeline rows of the schedule table


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage block before its message; the contract here is one line.
    def error(self, message):
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Simulate a pipeline schedule "
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


def _run(args) -> str:
    from . import engine as sc

    for name in ("fwd", "bwd", "p2p", "opt"):
        value = getattr(args, name)
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"--{name} must be a finite cost >= 0 (got {value})")
    for name in ("stages", "microbatches", "steps"):  # the C++ core counts in 32-bit integers
        if getattr(args, name) > MAX_COUNT:
            raise ValueError(f"--{name} {getattr(args, name)} is more than {MAX_COUNT}; pass a smaller count")
    if args.timeline and not args.json:
        raise ValueError("--timeline adds the timeline to the JSON output; add --json (or use --plot PATH "
                         "for a picture)")
    res = sc.simulate(args.schedule, stages=args.stages, microbatches=args.microbatches,
                      steps=args.steps, fwd=args.fwd, bwd=args.bwd, p2p=args.p2p, opt=args.opt)
    if args.plot:  # before printing, so a bad path leaves no half-finished output behind
        try:
            sc.plot_timeline(res, args.plot)
        except OSError as e:
            raise ValueError(f"cannot write plot to {args.plot!r}: {e.strerror or e}; "
                             "choose a writable path") from None
        except ValueError as e:  # e.g. an extension matplotlib cannot write
            raise ValueError(f"cannot write plot to {args.plot!r}: {e}") from None
    if args.json:
        d = res.to_dict(include_timeline=args.timeline)
        if args.plot:
            d["plot"] = args.plot
        return json.dumps(d)
    out = _table(res)
    if args.plot:
        out += f"\ntimeline written to {args.plot}"
    return out


def main(argv: Optional[List[str]] = None) -> int:
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as e:  # --help / --version: argparse already printed
            return int(e.code or 0)
        out = _run(args)
    except (_UsageError, ValueError, TypeError) as e:
        print(f"{PROG}: error: {without_source_location(e)}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
