"""Delay study: how much a one-step weight delay (PipeDream-2BW) costs each optimizer, and how much
error feedback (EF) wins back, measured with the project's own delay simulator; optionally also the
per-stage delays of PipeDream (stage s of S computes S-1-s steps behind) at several depths.

Every run is built exactly like ``asyncpp-train --simulate`` builds it (RunConfig, load_tokens,
BatchStream, GPT, the CLI's optimizer factory, DelaySimulator); the runs of one optimizer share
every hyperparameter and, per seed, the initial weights and the batch order, so a gap is a paired
difference. A pipedream step takes one microbatch of m·B sequences: the same windows 2bw and sync
split into m microbatches of B. Sync and 2bw do not depend on the depth, so they run once per seed.
Runs execute in ``--workers`` processes with ``--threads`` intra-op threads each.

    python bench/delay_study.py                      # the study: table on stdout
    python bench/delay_study.py --json               # one JSON object instead
    python bench/delay_study.py --plot docs/delay_study.png
    python bench/delay_study.py --schedules sync,2bw,pipedream --stages 2,4,8 --n-layer 6 \
        --plot docs/depth.png                        # + pipedream depths; the plot: gap vs depth
    python bench/delay_study.py --tune               # sync-only learning-rate sweep

A spot check runs one configuration through ``asyncpp-train`` twice, with real processes
(``--stages 2``) and with ``--simulate``, and compares the per-step losses.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(Path(__file__).resolve().parent) not in sys.path:  # the shared study code next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_command import ArgumentParser  # noqa: E402
from study_runs import (StudyError, build_config, check_configs, check_plot_argument, mean_std,  # noqa: E402
                        plot_curve_panels, progress_reporter, recovered_fraction, run_pool, save_figure,
                        share_text, train_run)

DEFAULT_DATA = "builtin"  # the package's built-in corpus: runs on any machine, no download

# Learning rates chosen by `--tune` (sync runs only, see docs/results.md "Delay study"); the 2bw
# runs reuse them unchanged, as the "same hyperparameters" comparison of docs/design.md §1.12 requires.
DEFAULT_ADAMW_LR = 1e-3
DEFAULT_MUON_LR = 0.04
DEFAULT_MUON_ADAMW_LR = 1e-3

TUNE_ADAMW_LRS = (5e-4, 1e-3, 2e-3, 4e-3)
TUNE_MUON_LRS = (0.01, 0.02, 0.04, 0.08)
TUNE_MUON_ADAMW_LRS = (1e-3, 2e-3)


@dataclass(frozen=True)
class Variant:
    """One optimizer setting of the study (the same for its sync and 2bw runs)."""

    label: str
    optimizer: str
    lr: float
    ef_beta: float = 0.0
    adamw_lr: float | None = None


@dataclass(frozen=True)
class RunSpec:
    """One training run of the study."""

    variant: Variant
    """The optimizer setting."""
    schedule: str
    """"sync", "2bw" or "pipedream"."""
    seed: int
    """Initial weights and batch order."""
    stages: int | None = None
    """Pipeline depth S of a pipedream run (None for sync and 2bw, which do not depend on it)."""


STUDY_SCHEDULES = ("sync", "2bw", "pipedream")


# -- one run (executes in a worker process) ----------------------------------------------------
def variant_overrides(variant: Variant) -> dict:
    """The config fields a variant sets (dotted field -> value)."""
    return {"optim.name": variant.optimizer, "optim.lr": variant.lr, "optim.ef_beta": variant.ef_beta,
            "optim.adamw_lr": variant.adamw_lr}


def run_config(spec: RunSpec, args: dict):
    """The RunConfig ``asyncpp-train`` would build for this run (also used for the spot check)."""
    return build_config(args, spec.schedule, spec.seed, variant_overrides(spec.variant), spec.stages)


def run_one(spec: RunSpec, args: dict) -> dict:
    """Train one configuration in this process; returns its losses and eval curve."""
    run = train_run(run_config(spec, args), args["micro_batch_size"])
    return {"label": spec.variant.label, "optimizer": spec.variant.optimizer,
            "lr": spec.variant.lr, "adamw_lr": spec.variant.adamw_lr,
            "ef_beta": spec.variant.ef_beta, "schedule": spec.schedule, "seed": spec.seed,
            "stages": spec.stages, **run}


def _describe_run(r: dict) -> str:
    sched = r["schedule"] if r.get("stages") is None else f"pd{r['stages']}"
    return f"{r['label']:<14} {sched:<4} seed {r['seed']}"


def run_all(specs: list[RunSpec], args: dict, workers: int, threads: int) -> list[dict]:
    """Every spec, ``workers`` at a time; results in spec order. Prints progress to stderr."""
    return run_pool(run_one, [(spec, args) for spec in specs], workers, threads,
                    progress_reporter(len(specs), _describe_run))


# -- the study's variants and summaries --------------------------------------------------------
def study_variants(a) -> list[Variant]:
    muon = dict(optimizer="muon", lr=a.muon_lr, adamw_lr=a.muon_adamw_lr)
    variants = [Variant("adamw", "adamw", a.adamw_lr)]
    if a.adamw_ef_beta > 0:
        variants.append(Variant(f"adamw+ef{a.adamw_ef_beta:g}", "adamw", a.adamw_lr,
                                ef_beta=a.adamw_ef_beta))
    variants.append(Variant("muon", **muon))
    variants += [Variant(f"muon+ef{b:g}", ef_beta=b, **muon) for b in a.betas]
    return variants


def study_specs(variants: list[Variant], schedules: list[str], depths: list[int],
                seeds: int) -> list[RunSpec]:
    """Every run: sync and 2bw once per (seed, variant), pipedream once per depth as well."""
    specs = []
    for s in range(seeds):
        for v in variants:
            for sched in schedules:
                specs += ([RunSpec(v, sched, s, d) for d in depths] if sched == "pipedream"
                          else [RunSpec(v, sched, s)])
    return specs


def summarize(results: list[dict], variants: list[Variant]) -> dict:
    """Per variant: final eval loss per schedule, the paired async gap, EF's recovered fraction;
    with pipedream runs also ``row["pipedream"][str(S)] = {"eval", "gap"}`` per depth S."""
    final = {(r["label"], r["schedule"], r["seed"], r.get("stages")): r["final_eval_loss"]
             for r in results}
    seeds = sorted({r["seed"] for r in results})
    depths = sorted({r["stages"] for r in results if r.get("stages") is not None})
    has_2bw = any(r["schedule"] == "2bw" for r in results)
    rows = {}
    for v in variants:
        row = {"sync": mean_std([final[(v.label, "sync", s, None)] for s in seeds])}
        if has_2bw:
            row["2bw"] = mean_std([final[(v.label, "2bw", s, None)] for s in seeds])
            row["gap"] = mean_std([final[(v.label, "2bw", s, None)] - final[(v.label, "sync", s, None)]
                                    for s in seeds])
        if depths:
            row["pipedream"] = {str(d): {
                "eval": mean_std([final[(v.label, "pipedream", s, d)] for s in seeds]),
                "gap": mean_std([final[(v.label, "pipedream", s, d)] - final[(v.label, "sync", s, None)]
                                  for s in seeds])} for d in depths}
        rows[v.label] = row
    if not has_2bw:
        return rows
    if "muon" in rows:
        gap_muon = rows["muon"]["gap"][0]
        muon_sync, muon_2bw = rows["muon"]["sync"][0], rows["muon"]["2bw"][0]
        for label, row in rows.items():
            if label.startswith("muon+ef"):
                # As defined by the study: each optimizer's own gap (2bw - its own sync run).
                row["recovered_own_gap"] = recovered_fraction(gap_muon, row["gap"][0])
                # What a user sees: how far 2bw+EF closes the distance to plain sync Muon.
                row["recovered_vs_sync_muon"] = recovered_fraction(muon_2bw - muon_sync,
                                                                   row["2bw"][0] - muon_sync)
    if "adamw" in rows:
        gap_adamw = rows["adamw"]["gap"][0]
        for label, row in rows.items():
            if label.startswith("adamw+ef"):
                row["recovered_own_gap"] = recovered_fraction(gap_adamw, row["gap"][0])
    return rows


def format_table(summary: dict, seeds: int) -> str:
    lines = [f"final eval loss (nats/byte), mean ± std over {seeds} seed(s)"]
    if not all("2bw" in row for row in summary.values()):
        lines += [f"{label:<14} sync {m:.4f} ± {s:.4f}" for label, row in summary.items()
                  for m, s in [row["sync"]]]
        return "\n".join(lines + [format_depth_table(summary)])
    head = (f"{'optimizer':<14} {'sync eval':>17} {'2bw eval':>17} {'gap (2bw-sync)':>17} "
            f"{'EF recovers':>12} {'vs sync muon':>13}")
    lines += [head, "-" * len(head)]
    for label, row in summary.items():
        cells = [f"{m:.4f} ± {s:.4f}" for m, s in (row["sync"], row["2bw"], row["gap"])]
        own = row.get("recovered_own_gap")
        vs = row.get("recovered_vs_sync_muon")
        lines.append(f"{label:<14} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} "
                     f"{'' if own is None else share_text(own):>12} "
                     f"{'' if vs is None else share_text(vs):>13}")
    return "\n".join(lines + [format_depth_table(summary)])


def format_depth_table(summary: dict) -> str:
    """The pipedream rows (optimizer x depth); empty without pipedream runs."""
    if not any("pipedream" in row for row in summary.values()):
        return ""
    head = f"{'optimizer':<14} {'depth':>5} {'pipedream eval':>17} {'gap (pd-sync)':>17} {'2bw gap':>8}"
    lines = ["", "pipedream: stage s of S computes S-1-s steps behind, 1 microbatch of m·B per step",
             head, "-" * len(head)]
    for label, row in summary.items():
        for depth, cell in row["pipedream"].items():
            ev, gap = (f"{m:.4f} ± {s:.4f}" for m, s in (cell["eval"], cell["gap"]))
            two = f"{row['gap'][0]:.4f}" if "gap" in row else ""
            lines.append(f"{label:<14} {depth:>5} {ev:>17} {gap:>17} {two:>8}")
    return "\n".join(lines)


def plot_curves(results: list[dict], variants: list[Variant], path: Path, title: str) -> None:
    """One panel per optimizer: mean eval loss vs step, sync and 2bw, shaded ± std over seeds."""
    panels = [(v.label, [(sched, color, [r["eval_curve"] for r in results
                                         if r["label"] == v.label and r["schedule"] == sched])
                         for sched, color in (("sync", "tab:blue"), ("2bw", "tab:red"))])
              for v in variants]
    plot_curve_panels(panels, path, title, [r["final_eval_loss"] for r in results])


def plot_depth(summary: dict, path: Path, title: str) -> None:
    """Gap to sync vs pipeline depth for pipedream (± std over seeds), one line per optimizer;
    each optimizer's 2bw gap (one-step delay on every stage) as a dashed line of its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (label, row) in enumerate(summary.items()):
        color = f"C{i}"
        depths = [int(d) for d in row["pipedream"]]
        cells = list(row["pipedream"].values())
        ax.errorbar(depths, [c["gap"][0] for c in cells], yerr=[c["gap"][1] for c in cells],
                    color=color, marker="o", capsize=3, label=f"{label} pipedream")
        if "gap" in row:
            ax.axhline(row["gap"][0], color=color, linestyle="--", alpha=0.7, label=f"{label} 2bw")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("pipeline depth S (stage s computes S-1-s steps behind)")
    ax.set_ylabel("final eval loss - sync (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)


# -- spot check: real processes vs the simulator, through the CLI --------------------------------
def spot_check(args: dict, variant: Variant, steps: int) -> dict:
    """``asyncpp-train --stages 2`` vs ``--simulate`` on one 2bw config; compares step losses."""
    common = ["--schedule", "2bw", "--optimizer", variant.optimizer, "--lr", str(variant.lr),
              "--ef-beta", str(variant.ef_beta), "--model", args["model"], "--data", args["data"],
              "--steps", str(steps), "--seed", "0", "--microbatches", str(args["microbatches"]),
              "--micro-batch-size", str(args["micro_batch_size"]), "--eval-batches", "0",
              "--no-checkpoints", "--no-progress", "--stages", "2"]
    if variant.adamw_lr is not None:
        common += ["--adamw-lr", str(variant.adamw_lr)]
    if args.get("n_layer") is not None:
        common += ["--n-layer", str(args["n_layer"])]
    losses = {}
    with tempfile.TemporaryDirectory(prefix="delay-study-spot-") as tmp:
        for mode, extra in (("pipeline", []), ("simulate", ["--simulate"])):
            out = Path(tmp) / mode
            proc = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", *common, *extra,
                                   "--out", str(out)], capture_output=True, text=True)
            if proc.returncode != 0:
                message = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                return {"status": "failed", "mode": mode, "message": message}
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            losses[mode] = [r["loss"] for r in rows]
    if len(losses["pipeline"]) != len(losses["simulate"]):
        return {"status": "failed", "mode": "pipeline", "message": (
            f"{len(losses['pipeline'])} step losses vs {len(losses['simulate'])} simulated")}
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["pipeline"], losses["simulate"]))
    return {"status": "ok" if rel <= 1e-5 else "mismatch", "config": variant.label,
            "steps": steps, "max_rel_diff": rel, "losses": losses}


def describe_spot_check(sc: dict) -> str:
    if sc["status"] == "failed":
        return f"spot check FAILED ({sc['mode']} run): {sc['message']}"
    return (f"spot check {sc['status']}: {sc['config']} 2bw, 2 stages vs --simulate, "
            f"{sc['steps']} steps: max relative loss difference {sc['max_rel_diff']:.2e}")


# -- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="'builtin' (default: the package's built-in corpus) or a UTF-8 text / uint16 .bin file")
    p.add_argument("--model", default="small", choices=("tiny", "small"))
    p.add_argument("--n-layer", type=int, help="override the preset's layer count (the model has "
                   "n_layer + 2 blocks; a pipedream depth needs at least that many)")
    p.add_argument("--schedules", default="sync,2bw",
                   help="comma-separated, from sync,2bw,pipedream; sync is needed for the gaps")
    p.add_argument("--stages", default=None,
                   help="pipedream depths S (simulated: no processes); default 2,4,8 where the model "
                        "has that many blocks (small: 2,4; with --n-layer 6 also 8)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--adamw-lr", type=float, default=DEFAULT_ADAMW_LR)
    p.add_argument("--muon-lr", type=float, default=DEFAULT_MUON_LR)
    p.add_argument("--muon-adamw-lr", type=float, default=DEFAULT_MUON_ADAMW_LR,
                   help="lr of Muon's AdamW part (embeddings, head, norms, biases)")
    p.add_argument("--betas", default="0.25,0.5,1.0", help="EF strengths swept for Muon")
    p.add_argument("--adamw-ef-beta", type=float, default=0.5, help="EF strength for AdamW (0 = skip)")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--tune", action="store_true", help="sync-only lr sweep instead of the study")
    p.add_argument("--spot-check-steps", type=int, default=20, help="0 = no spot check")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write eval-loss curves (sync vs 2bw) here; with "
                   "pipedream, its gap to sync vs depth instead")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.data != DEFAULT_DATA and not Path(a.data).is_file():
        parser.error(f"--data {a.data} does not exist; pass --data PATH to a UTF-8 text file, "
                     "or --data builtin")
    try:
        a.betas = [float(b) for b in a.betas.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--betas {a.betas!r} must be comma-separated numbers, e.g. 0.25,0.5,1.0")
    if any(not 0 < b < math.inf for b in a.betas):
        parser.error(f"--betas {a.betas} must all be positive numbers (beta 0 is the plain 'muon' row)")
    for name in ("steps", "seeds", "workers", "threads", "microbatches", "micro_batch_size",
                 "eval_batches"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("eval_every", "spot_check_steps"):
        if getattr(a, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    for name in ("adamw_lr", "muon_lr", "muon_adamw_lr"):
        if not 0 < getattr(a, name) < math.inf:
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(a, name)}")
    if not 0 <= a.adamw_ef_beta < math.inf:
        parser.error(f"--adamw-ef-beta must be >= 0 (0 = no AdamW+EF row), got {a.adamw_ef_beta}")
    a.schedules = [x.strip() for x in a.schedules.split(",") if x.strip()]
    unknown = [x for x in a.schedules if x not in STUDY_SCHEDULES]
    if unknown or "sync" not in a.schedules or len(set(a.schedules)) != len(a.schedules):
        parser.error(f"--schedules {','.join(a.schedules)} must name each of {', '.join(STUDY_SCHEDULES)} "
                     "at most once, sync included (the gaps are to sync)")
    default_stages = a.stages is None
    try:
        a.stages = sorted({int(x) for x in (a.stages or "2,4,8").split(",") if x.strip()})
    except ValueError:
        parser.error(f"--stages {a.stages!r} must be comma-separated integers, e.g. 2,4,8")
    if a.n_layer is not None and a.n_layer < 1:
        parser.error(f"--n-layer must be >= 1, got {a.n_layer}")
    if "pipedream" in a.schedules:
        from asyncpp_ext.models import preset_config

        blocks = preset_config(a.model, n_layer=a.n_layer).num_blocks
        if default_stages:  # the default depths this model can be split into
            a.stages = [s for s in a.stages if s <= blocks]
        if not a.stages or a.stages[0] < 1:
            parser.error(f"--stages {a.stages} must be pipeline depths >= 1, e.g. 2,4,8")
        if a.stages[-1] > blocks:
            parser.error(f"--stages {','.join(map(str, a.stages))} must lie in 1..{blocks} (the "
                         f"{a.model} model's blocks); lower --stages or raise --n-layer to "
                         f"{a.stages[-1] - 2} or more")
    try:
        check_plot_argument(a.plot)
    except StudyError as exc:
        parser.error(str(exc))
    if a.microbatches < 2 and a.spot_check_steps > 0:
        parser.error("the 2-stage spot check needs --microbatches >= 2 (or --spot-check-steps 0)")
    return a


def _configs_build(specs: list[RunSpec], run_args: dict) -> bool:
    """Whether every run of the study builds (else one line on stderr): checked here, before the
    first run, so that a bad value is not a traceback from each worker."""
    runs = {}  # each run once, in the study's order
    for s in specs:
        if s.seed == 0:
            label = f"{s.variant.label} {s.schedule if s.stages is None else f'pipedream S={s.stages}'}"
            runs[label, s.schedule, tuple(variant_overrides(s.variant).items()), s.stages] = None
    try:
        check_configs(list(runs), run_args)
    except StudyError as exc:
        print(f"delay_study.py: error: {exc}", file=sys.stderr)
        return False
    return True


def main(argv=None) -> int:
    a = parse_args(argv)
    run_args = {k: getattr(a, k) for k in ("model", "n_layer", "data", "steps", "microbatches",
                                           "micro_batch_size", "eval_every", "eval_batches")}
    setup = {**run_args, "seeds": a.seeds, "workers": a.workers, "threads": a.threads,
             "batch": a.microbatches * a.micro_batch_size, "schedules": a.schedules,
             "stages": a.stages if "pipedream" in a.schedules else []}
    import torch

    setup["torch"] = torch.__version__
    setup["cpus"] = os.cpu_count()
    start = time.perf_counter()
    if a.tune:
        variants = [Variant(f"adamw lr{lr:g}", "adamw", lr) for lr in TUNE_ADAMW_LRS]
        variants += [Variant(f"muon lr{lr:g} a{alr:g}", "muon", lr, adamw_lr=alr)
                     for lr in TUNE_MUON_LRS for alr in TUNE_MUON_ADAMW_LRS]
        specs = [RunSpec(v, "sync", s) for v in variants for s in range(a.seeds)]
        if not _configs_build(specs, run_args):
            return 2
        results = run_all(specs, run_args, a.workers, a.threads)
        tuned = {}
        for v in variants:
            tuned[v.label] = mean_std([r["final_eval_loss"] for r in results
                                        if r["label"] == v.label])
        out = {"setup": setup, "tune": tuned, "seconds": round(time.perf_counter() - start, 1)}
        if a.json:
            print(json.dumps(out))
        else:
            print(f"sync-only lr sweep, final eval loss over {a.seeds} seed(s)")
            for label, (m, s) in tuned.items():
                print(f"{label:<24} {m:.4f} ± {s:.4f}")
            print(f"({out['seconds']:.0f} s)")
        return 0

    variants = study_variants(a)
    depths = a.stages if "pipedream" in a.schedules else []
    specs = study_specs(variants, [x for x in STUDY_SCHEDULES if x in a.schedules], depths, a.seeds)
    if not _configs_build(specs, run_args):
        return 2
    results = run_all(specs, run_args, a.workers, a.threads)
    summary = summarize(results, variants)
    study_seconds = round(time.perf_counter() - start, 1)
    sc = None
    if a.spot_check_steps > 0:
        spot_variant = next((v for v in variants if v.label.startswith("muon+ef")), variants[0])
        sc = spot_check(run_args, spot_variant, a.spot_check_steps)
    if a.plot:
        layers = "" if a.n_layer is None else f" ({a.n_layer} layers)"
        title = f"{a.model} GPT{layers}, batch {setup['batch']}, {a.steps} steps, {a.seeds} seeds"
        if depths:
            plot_depth(summary, Path(a.plot), title)
        else:
            plot_curves(results, variants, Path(a.plot), title)
    if a.json:
        print(json.dumps({"setup": setup, "summary": summary, "runs": results,
                          "spot_check": sc, "study_seconds": study_seconds}))
    else:
        print(format_table(summary, a.seeds))
        print(f"study: {len(specs)} runs in {study_seconds:.0f} s ({a.workers} workers x "
              f"{a.threads} thread(s), torch {setup['torch']})")
        if sc is not None:
            print(describe_spot_check(sc))
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
