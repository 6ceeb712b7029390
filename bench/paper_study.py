"""The paper's comparison tables: what a one-step weight delay (PipeDream-2BW) costs each setting,
and how much of that cost a mitigation wins back, one command per table.

    python bench/paper_study.py optimizers    # 7 optimizers x {sync, 2bw, 2bw+EF at its auto beta}
    python bench/paper_study.py ef            # muon x EF beta {0.25,0.5,0.75,1} x source {buffer,weights}
    python bench/paper_study.py mitigations   # muon, adamw x 2bw + {none, ef, predict, dc, lr-rescale}
    python bench/paper_study.py momentum      # muon momentum 0.9/0.95/0.98: sync, 2bw, 2bw+EF
    python bench/paper_study.py sensitivity   # each optimizer's default lr x {0.5, 1, 2}: sync, 2bw
    python bench/paper_study.py ef --json     # one JSON object: settings, runs (losses, curves), summary
    python bench/paper_study.py momentum --plot momentum.png

Every run is built like ``asyncpp-train --simulate`` (bench/study_runs.py, shared with
bench/delay_study.py): a RunConfig with the table's config overrides, the package's built-in corpus
unless ``--data`` names a file, and the DelaySimulator. A setting is a set of dotted config fields
(``optim.name``, ``optim.ef_beta``, ``optim.mitigation``...), so a new optimizer or mitigation that
the config knows runs without changes here. Each optimizer runs at its package default learning
rate (``LR_AUTO``); "sync" and plain "2bw" rows turn error feedback off (``optim.ef_beta`` 0), the
"+ef" rows leave it at the optimizer's default strength unless the table sweeps it. The
sensitivity table scales ``optim.lr`` only (the AdamW part of muon and normuon keeps its default).

Rows of one *group* (an optimizer, or an optimizer at one momentum or lr) share a sync run and a
plain 2bw run per seed; a seed fixes the initial weights and the batch order, so each gap is paired:
gap = delayed - sync and recovered = (gap of plain 2bw - gap) / gap of plain 2bw, per seed, then
mean ± std over the seeds.

Sizes (3 seeds, batch 16 = 2 x 8, 2 workers x 1 thread). The estimate uses ``SECONDS_PER_STEP``,
measured on a 2-core CPU: the small GPT took 0.17-0.21 CPU seconds per step (eval included), the
tiny one 0.015-0.024, SOAP about 1.6x AdamW. Each default is sized to stay under 10 minutes there;
"measured" is the wall time of one default run on that machine while it was shared with other
jobs (load average in brackets) and the CPU time it used (half of it is the wall time on two idle
cores). ``--full`` is the longer setting: more steps and the extra rows (adamw in ``ef``, momentum
0.8 in ``momentum``); its estimate is printed before the runs start.

    table        model steps runs estimate  measured: wall (load)  CPU    --full: steps runs estimate
    optimizers   small    60   63    7 min            9.0 min (3-8)  655 s            300   63   34 min
    ef           small   120   30    6 min            6.5 min (2)    762 s            400   60   40 min
    mitigations  small   100   36    6 min             19 min (5-11) 619 s            400   36   24 min
    momentum     small   150   27    7 min            6.4 min (2)    733 s            400   36   24 min
    sensitivity  tiny    200  126    6 min            4.8 min (2-3)  380 s           1000  126   27 min
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the shared study code next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_runs import (StudyError, build_config, build_engine, mean_std, paired_differences,  # noqa: E402
                        parse_value, plot_curve_panels, progress_reporter, recovered_fractions,
                        run_overrides, run_pool)

PAPER_OPTIMIZERS = ("adamw", "muon", "normuon", "adan", "soap", "lion", "mars")
"""The optimizers of the ``optimizers`` and ``sensitivity`` tables."""
LIBRARY_OPTIMIZERS = ("lion", "adan", "soap", "mars")
"""Optimizers from the optional pytorch-optimizer package (asyncpp_ext.optim.library names them
when it exists; this list is the fallback)."""
INSTALL_HINT = "pip install 'asyncpp_ext[study]'"
EF_BETAS = (0.25, 0.5, 0.75, 1.0)
EF_SOURCES = ("buffer", "weights")
MITIGATIONS = ("none", "ef", "predict", "dc", "lr-rescale")
MOMENTA, FULL_MOMENTA = (0.9, 0.95, 0.98), (0.8, 0.9, 0.95, 0.98)
LR_SCALES = (0.5, 1.0, 2.0)
MOMENTUM_OPTIMIZERS = ("muon", "normuon")
"""The optimizers whose matrices use ``optim.muon_momentum``."""
ROLES = ("sync", "delayed", "mitigated")

SECONDS_PER_STEP = {"tiny": 0.024, "small": 0.2}
"""Measured seconds per training step (eval included) of one worker while two run at once on the
2-core study machine; budget estimates only."""
OPTIMIZER_COST = {"soap": 1.6}
"""Step-time factor of optimizers much slower than AdamW (SOAP's eigendecompositions)."""


@dataclass(frozen=True)
class TablePlan:
    """The default size and meaning of one table."""

    title: str
    """What the table compares (its header line)."""
    model: str
    """GPT preset of the default run."""
    steps: int
    """Steps of the default run (sized to about 10 minutes on the 2-core machine)."""
    full_steps: int
    """Steps with ``--full``."""
    optimizers: tuple[str, ...]
    """Optimizers of the default run (``--optimizers`` replaces them)."""
    full_optimizers: tuple[str, ...] | None = None
    """Optimizers with ``--full`` (None: the same)."""


TABLES = {
    "optimizers": TablePlan("each optimizer under a one-step delay: sync vs 2bw vs 2bw+EF (its auto beta)",
                            "small", 60, 300, PAPER_OPTIMIZERS),
    "ef": TablePlan("error feedback: strength beta x source of the previous update (buffer | weights)",
                    "small", 120, 400, ("muon",), ("muon", "adamw")),
    "mitigations": TablePlan("staleness mitigations on 2bw: none, ef, predict, dc, lr-rescale",
                             "small", 100, 400, ("muon", "adamw")),
    "momentum": TablePlan("Muon momentum: does more momentum absorb more staleness?",
                          "small", 150, 400, ("muon",)),
    "sensitivity": TablePlan("learning-rate sensitivity: each optimizer's default lr x 0.5, 1, 2",
                             "tiny", 200, 1000, PAPER_OPTIMIZERS),
}
"""Every table by name."""


@dataclass(frozen=True)
class Setting:
    """One row of a table: a schedule and the config overrides its runs use."""

    group: str
    """The rows compared with one another: one sync row, at most one plain delayed row."""
    variant: str
    """The row within its group ("sync", "2bw", "2bw+ef0.5 weights"...)."""
    schedule: str
    """"sync" or "2bw"."""
    role: str
    """"sync" (the group's reference), "delayed" (plain 2bw, the gap to recover) or "mitigated"."""
    overrides: tuple[tuple[str, object], ...]
    """Dotted config field -> value, as pairs (hashable)."""

    @property
    def label(self) -> str:
        """The row's name: group and variant."""
        return f"{self.group} {self.variant}"

    def as_dict(self) -> dict:
        """JSON form."""
        return {"label": self.label, "group": self.group, "variant": self.variant,
                "schedule": self.schedule, "role": self.role, "overrides": dict(self.overrides)}


def _rows(group: str, optimizer: str, fields: dict, mitigated: dict[str, dict]) -> list[Setting]:
    """A group's sync and plain 2bw rows (EF off), then one 2bw row per mitigated variant."""
    base = {"optim.name": optimizer, **fields}
    plain = tuple({**base, "optim.ef_beta": 0.0}.items())
    rows = [Setting(group, "sync", "sync", "sync", plain), Setting(group, "2bw", "2bw", "delayed", plain)]
    rows += [Setting(group, variant, "2bw", "mitigated", tuple({**base, **extra}.items()))
             for variant, extra in mitigated.items()]
    return rows


def default_lr(optimizer: str) -> float:
    """The package's default learning rate of ``optimizer`` (``OptimConfig.lr`` None)."""
    from asyncpp_ext.training.config import OptimConfig

    try:
        return OptimConfig(name=optimizer).effective_lr()
    except KeyError:
        raise StudyError(f"optimizer {optimizer!r} has no default learning rate in this asyncpp_ext "
                         "(training/config.py LR_AUTO); pass --optimizers with known names") from None


def auto_ef_beta(optimizer: str) -> float:
    """The EF strength ``optimizer`` runs with when ``optim.ef_beta`` is left None (auto)."""
    from asyncpp_ext.training.config import OptimConfig

    return OptimConfig(name=optimizer).effective_ef_beta()


def table_settings(table: str, optimizers: tuple[str, ...], full: bool) -> list[Setting]:
    """Every row of ``table`` for ``optimizers``."""
    rows = []
    for opt in optimizers:
        auto_ef = f"ef{auto_ef_beta(opt):g}"  # the rows leave ef_beta None: the optimizer's auto beta
        if table == "optimizers":
            rows += _rows(opt, opt, {}, {f"2bw+{auto_ef}": {}})
        elif table == "ef":
            rows += _rows(opt, opt, {}, {f"2bw+ef{b:g} {src}": {"optim.ef_beta": b, "optim.ef_source": src}
                                         for src in EF_SOURCES for b in EF_BETAS})
        elif table == "mitigations":
            rows += _rows(opt, opt, {}, {
                f"2bw {auto_ef if m == 'ef' else m}":
                    {"optim.mitigation": m} if m == "ef" else {"optim.ef_beta": 0.0, "optim.mitigation": m}
                for m in MITIGATIONS if m != "none"})
        elif table == "momentum":
            for m in FULL_MOMENTA if full else MOMENTA:
                rows += _rows(f"{opt} m{m:g}", opt, {"optim.muon_momentum": m}, {f"2bw+{auto_ef}": {}})
        elif table == "sensitivity":
            lr = default_lr(opt)
            for scale in LR_SCALES:
                rows += _rows(f"{opt} lr{lr * scale:g} (x{scale:g})", opt, {"optim.lr": lr * scale}, {})
        else:
            raise StudyError(f"unknown table {table!r}; choose one of {', '.join(TABLES)}")
    return rows


def check_settings(settings: list[Setting]) -> None:
    """Each group has one sync row, and one plain delayed row when it has mitigated rows."""
    groups: dict[str, list[str]] = {}
    for s in settings:
        groups.setdefault(s.group, []).append(s.role)
    for group, roles in groups.items():
        if roles.count("sync") != 1 or roles.count("delayed") > 1 or (
                "mitigated" in roles and roles.count("delayed") != 1):
            raise StudyError(f"group {group!r} has rows {roles}; it needs one sync row, and one plain "
                             "delayed row when any row is mitigated")


# -- checks before any run ------------------------------------------------------------------------
def check_extras(optimizers) -> None:
    """Raise StudyError (one line naming ``pip install 'asyncpp_ext[study]'``) if an optimizer
    needs the optional pytorch-optimizer package and it is not installed."""
    try:
        from asyncpp_ext.optim.library import check_available
    except ImportError:  # an asyncpp_ext without library optimizers: only the package can be checked
        def check_available(name):
            if name in LIBRARY_OPTIMIZERS and importlib.util.find_spec("pytorch_optimizer") is None:
                raise StudyError(f"optimizer {name!r} needs the pytorch-optimizer package, which is not "
                                 f"installed; install it with: {INSTALL_HINT}")
    for name in sorted(set(optimizers)):
        try:
            check_available(name)
        except ValueError as exc:
            message = " ".join(str(exc).split())
            raise StudyError(message if INSTALL_HINT in message else f"{message} ({INSTALL_HINT})") from None


def check_configs(settings: list[Setting], args: dict, extra: dict) -> None:
    """Build every row's config, model, optimizer and simulator once, so a bad field or value, or
    an option this asyncpp_ext cannot run, stops the study before its first run."""
    for s in settings:
        try:
            build_engine(build_config(args, s.schedule, 0, {**extra, **dict(s.overrides)}))
        except (ValueError, TypeError) as exc:
            raise StudyError(f"{s.label}: {' '.join(str(exc).split())}") from None


# -- summary --------------------------------------------------------------------------------------
def summarize(results: list[dict], settings: list[Setting]) -> dict:
    """Per row (by label): final eval loss, gap to its group's sync run and, for mitigated rows,
    the recovered share of the plain 2bw gap; each as [mean, std] over the seeds, computed per seed
    (paired), with the per-seed values under ``per_seed``."""
    check_settings(settings)
    final = {(r["label"], r["seed"]): r["final_eval_loss"] for r in results}
    seeds = sorted({r["seed"] for r in results})
    evals = {s.label: {seed: final[(s.label, seed)] for seed in seeds} for s in settings}
    sync = {s.group: evals[s.label] for s in settings if s.role == "sync"}
    plain = {s.group: evals[s.label] for s in settings if s.role == "delayed"}
    summary = {}
    for s in settings:
        per_seed = {"eval": [evals[s.label][seed] for seed in seeds]}
        row = {"group": s.group, "variant": s.variant, "schedule": s.schedule, "role": s.role,
               "eval": list(mean_std(per_seed["eval"])), "gap": None, "recovered": None}
        if s.role != "sync":
            per_seed["gap"] = paired_differences(evals[s.label], sync[s.group])
            row["gap"] = list(mean_std(per_seed["gap"]))
        if s.role == "mitigated":
            per_seed["recovered"] = recovered_fractions(paired_differences(plain[s.group], sync[s.group]),
                                                        per_seed["gap"])
            row["recovered"] = list(mean_std(per_seed["recovered"]))
        row["per_seed"] = per_seed
        summary[s.label] = row
    return summary


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def format_table(summary: dict, header: list[str], seeds: int) -> str:
    """The table: one row per setting; eval, gap to sync, recovered share (mean ± std)."""
    width = max(len(label) for label in summary) + 2
    lines = header + [f"final eval loss (nats/token), mean ± std over {seeds} paired seed(s); gap = "
                      "delayed - sync; recovered = (plain 2bw gap - gap) / plain 2bw gap, per seed"]
    head = f"{'setting':<{width}}{'eval':>17} {'gap to sync':>17} {'recovered':>13}"
    lines += [head, "-" * len(head)]
    for label, row in summary.items():
        cells = [f"{row['eval'][0]:.4f} ± {row['eval'][1]:.4f}",
                 "" if row["gap"] is None else f"{row['gap'][0]:+.4f} ± {row['gap'][1]:.4f}",
                 "" if row["recovered"] is None else f"{row['recovered'][0]:.0%} ± {row['recovered'][1]:.0%}"]
        lines.append(f"{label:<{width}}{cells[0]:>17} {cells[1]:>17} {cells[2]:>13}")
    return "\n".join(lines)


MITIGATED_COLORS = ("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                    "tab:cyan", "tab:gray")


def plot_table(results: list[dict], settings: list[Setting], path: Path, title: str) -> None:
    """One panel per group: mean eval loss vs step of each row, shaded ± std over seeds."""
    panels = {}
    for s in settings:
        lines = panels.setdefault(s.group, [])
        color = {"sync": "tab:blue", "delayed": "tab:red"}.get(
            s.role, MITIGATED_COLORS[sum(1 for *_, role in lines if role == "mitigated") % len(MITIGATED_COLORS)])
        lines.append((s.variant, color, [r["eval_curve"] for r in results if r["label"] == s.label], s.role))
    plot_curve_panels([(group, [line[:3] for line in lines]) for group, lines in panels.items()], path, title,
                      [r["final_eval_loss"] for r in results])


# -- command line ---------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, through main's StudyError handling
        raise StudyError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=tuple(TABLES), help="which table to run")
    p.add_argument("--full", action="store_true", help="the longer setting: TABLES[table].full_steps steps "
                   "and the extra rows (adamw in ef, momentum 0.8)")
    p.add_argument("--steps", type=int, help="override the table's steps")
    p.add_argument("--seeds", type=int, default=3, help="paired seeds 0..N-1 (default 3)")
    p.add_argument("--model", choices=("tiny", "small"), help="override the table's GPT preset")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--data", default="builtin",
                   help="'builtin' (default: the package's built-in corpus) or a UTF-8 text / .bin file")
    p.add_argument("--optimizers", help="comma-separated, replacing the table's optimizers")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every run, e.g. optim.weight_decay=0.1 (repeatable)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--eval-every", type=int, help="default: steps // 5")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write eval-loss curves, one panel per group")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked arguments; StudyError names a bad one."""
    a = build_parser().parse_args(argv)
    plan = TABLES[a.table]
    a.model = a.model or plan.model
    a.steps = a.steps if a.steps is not None else (plan.full_steps if a.full else plan.steps)
    a.eval_every = a.eval_every if a.eval_every is not None else max(1, a.steps // 5)
    for name in ("steps", "seeds", "workers", "threads", "microbatches", "micro_batch_size", "eval_batches"):
        if getattr(a, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.data != "builtin" and not Path(a.data).is_file():
        raise StudyError(f"--data {a.data} does not exist; pass a UTF-8 text or .bin file, or --data builtin")
    if a.optimizers is not None:
        a.optimizers = tuple(x.strip() for x in a.optimizers.split(",") if x.strip())
        if not a.optimizers:
            raise StudyError("--optimizers is empty; name at least one, e.g. --optimizers adamw,muon")
    else:
        a.optimizers = (plan.full_optimizers or plan.optimizers) if a.full else plan.optimizers
    if a.table == "momentum" and not set(a.optimizers) <= set(MOMENTUM_OPTIMIZERS):
        raise StudyError(f"--optimizers {','.join(a.optimizers)}: the momentum table sweeps "
                         f"optim.muon_momentum, used by {' and '.join(MOMENTUM_OPTIMIZERS)} only")
    a.overrides = {}
    for item in a.set:
        field, sep, value = item.partition("=")
        if not sep or "." not in field:
            raise StudyError(f"--set {item!r} must be FIELD=VALUE with a dotted field, e.g. optim.weight_decay=0.1")
        a.overrides[field.strip()] = parse_value(value.strip())
    return a


def estimate_seconds(settings: list[Setting], seeds: int, steps: int, model: str, workers: int) -> float | None:
    """Expected wall time from SECONDS_PER_STEP (None for a model without a measurement)."""
    if model not in SECONDS_PER_STEP:
        return None
    work = sum(OPTIMIZER_COST.get(dict(s.overrides).get("optim.name"), 1.0) for s in settings)
    return work * seeds * steps * SECONDS_PER_STEP[model] / min(workers, len(settings) * seeds)


def run_study(a: argparse.Namespace) -> tuple[dict, list[Setting]]:
    """Check everything, run every row x seed; the JSON object the script prints, and the rows."""
    settings = table_settings(a.table, a.optimizers, a.full)
    check_settings(settings)
    check_extras(dict(s.overrides)["optim.name"] for s in settings)
    args = {"model": a.model, "n_layer": a.n_layer, "data": a.data, "steps": a.steps,
            "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size,
            "eval_every": a.eval_every, "eval_batches": a.eval_batches}
    check_configs(settings, args, a.overrides)
    import torch

    runs = len(settings) * a.seeds
    estimate = estimate_seconds(settings, a.seeds, a.steps, a.model, a.workers)
    setup = {"table": a.table, "title": TABLES[a.table].title, "full": a.full, **args, "seeds": a.seeds,
             "batch": a.microbatches * a.micro_batch_size, "optimizers": list(a.optimizers),
             "overrides": a.overrides, "workers": a.workers, "threads": a.threads, "runs": runs,
             "estimated_seconds": None if estimate is None else round(estimate),
             "torch": torch.__version__, "cpus": os.cpu_count()}
    print(f"{a.table}: {runs} runs, estimated {'?' if estimate is None else _duration(estimate)} on "
          f"{a.workers} worker(s)", file=sys.stderr, flush=True)
    # Seed-major order: every row of a seed finishes close together, so a stopped study has whole seeds.
    jobs = [(args, s.schedule, seed, {**a.overrides, **dict(s.overrides)}, None,
             {"label": s.label, "group": s.group, "schedule": s.schedule, "seed": seed})
            for seed in range(a.seeds) for s in settings]
    start = time.perf_counter()
    results = run_pool(run_overrides, jobs, a.workers, a.threads,
                       progress_reporter(len(jobs), lambda r: f"{r['label']} seed {r['seed']}"))
    return {"setup": setup, "settings": [s.as_dict() for s in settings], "runs": results,
            "summary": summarize(results, settings), "seconds": round(time.perf_counter() - start, 1)}, settings


def header_lines(out: dict) -> list[str]:
    """The table's header: what it compares, the run setup, and its budget."""
    s = out["setup"]
    layers = "" if s["n_layer"] is None else f" ({s['n_layer']} layers)"
    estimate = "?" if s["estimated_seconds"] is None else _duration(s["estimated_seconds"])
    return [f"{s['table']}: {s['title']}",
            f"{s['model']} GPT{layers}, batch {s['batch']} ({s['microbatches']} x {s['micro_batch_size']}), "
            f"{s['steps']} steps{' (--full)' if s['full'] else ''}, {s['seeds']} seeds, data {s['data']}; "
            f"budget {s['runs']} runs, estimated {estimate}, took {_duration(out['seconds'])} "
            f"({s['workers']} worker(s) x {s['threads']} thread(s), torch {s['torch']})"]


def main(argv=None) -> int:
    """Run one table; 0 on success, 2 (one line on stderr) on a bad argument or a missing extra."""
    try:
        a = parse_args(argv)
        out, settings = run_study(a)
    except StudyError as exc:
        print(f"paper_study: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if a.plot:
        s = out["setup"]
        plot_table(out["runs"], settings, Path(a.plot),
                   f"{a.table}: {s['model']} GPT, batch {s['batch']}, {s['steps']} steps, {s['seeds']} seeds")
    if a.json:
        print(json.dumps(out))
    else:
        print(format_table(out["summary"], header_lines(out), a.seeds))
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_pool, which stops its workers


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    raise SystemExit(main())
