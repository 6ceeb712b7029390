"""``asyncpp-compare RUN [RUN ...]``: runs side by side from their metrics -- what the package is for,
the loss a schedule reaches and the time it takes -- without loading a model.

One line per run: how it trained (schedule, stages x replicas, optimizer and mitigation; a
``--simulate`` run's time is one process's, not a pipeline's), steps and tokens, its train loss (the
mean of its last ``--last`` steps' losses: one step's loss is noisy), its last eval loss, its steady
tokens/s (over the rows after the first, whose time holds the first compile), its training time
(metrics.jsonl's ``elapsed_s``: the steps' own), and against the first run: the eval loss's change
and the tokens/s ratio. Then the time each run took to reach a target eval loss (``--target``, by
default the least loss every run reached: the largest of the runs' best eval losses), with its ratio
to the first run's: "the same loss in less time" as one number; and each named held-out set's last
loss (``--eval-data``, a mixture's sources) and each ``--eval-choices`` task's last accuracy_norm
per run. ``--plot FILE`` draws the train and
eval losses against tokens and against training time; ``--json FILE`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

from ..command_line import OneLineParser, UsageError, check_json_path, run_command
from .config import ConfigError, RunConfig
from .run_files import METRICS_NAME, RunDirError, read_metrics, write_text_atomic

PROG = "asyncpp-compare"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Runs side by side from their metrics: loss, speed, and "
                                             "the time each took to reach one eval loss.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (asyncpp-train --out); the first is "
                                                          "the baseline the ratios are against")
    p.add_argument("--target", type=float, metavar="LOSS",
                   help="the eval loss to time each run to (default: the largest of the runs' best eval losses, "
                        "which every run reached)")
    p.add_argument("--last", type=int, default=10, metavar="N",
                   help="train loss: the mean of each run's last N steps' losses (default 10)")
    p.add_argument("--plot", metavar="FILE", help="draw the losses against tokens and against training time")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    return p


def _read_run(path: str) -> tuple[RunConfig, list]:
    run = Path(path)
    if not (run / "config.json").is_file():
        raise UsageError(f"{path} is not a run directory (no config.json); pass asyncpp-train's --out directories")
    try:
        cfg = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    except (json.JSONDecodeError, ConfigError, TypeError) as exc:
        raise UsageError(f"{path}/config.json is not a run's config ({' '.join(str(exc).split())})") from None
    rows = read_metrics(run)
    if not rows:
        raise UsageError(f"{path} has no {METRICS_NAME} rows yet; compare runs that trained at least one step")
    return cfg, rows


def how_trained(cfg: RunConfig) -> str:
    """schedule, stages x replicas, optimizer(+mitigation), and "simulated" for a --simulate run."""
    p, o = cfg.pipeline, cfg.optim
    layout = f"{p.stages}st" + (f"x{p.dp}" if p.dp > 1 else "")
    optimizer = o.name + (f"+{o.mitigation}" if o.mitigation not in (None, "none") else "")
    return f"{p.schedule} {layout} {optimizer}" + (" simulated" if cfg.train.simulate else "")


def run_figures(path: str, cfg: RunConfig, rows: list, last: int) -> dict:
    """One run's line of the table (module docstring), before the comparisons."""
    from .run import steady_tokens_per_s

    trained = [r["loss"] for r in rows if r.get("loss") is not None][-last:]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    scored = [r["choices"] for r in rows if r.get("choices")]
    sets = [r["eval_losses"] for r in rows if r.get("eval_losses")]
    return {"run": path, "how": how_trained(cfg), "steps": rows[-1]["step"], "tokens": rows[-1].get("tokens"),
            "train_loss": sum(trained) / len(trained) if trained else None,
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "best_eval_loss": min(r["eval_loss"] for r in evals) if evals else None,
            "tokens_per_s": steady_tokens_per_s(rows), "elapsed_s": rows[-1]["elapsed_s"],
            "choices": scored[-1] if scored else {},  # the last --eval-choices scores, by task
            "eval_losses": sets[-1] if sets else {},  # the last losses of --eval-data and mixture sets
            "evals": [(r["step"], r["elapsed_s"], r["eval_loss"], r.get("tokens")) for r in evals]}


def reached(figures: dict, target: float) -> Optional[tuple]:
    """(step, elapsed_s) of the run's first evaluation at or below ``target``, or None."""
    return next(((step, t) for step, t, loss, _ in figures["evals"] if loss <= target), None)


def compare(runs: list, target: Optional[float], last: int) -> tuple[list, Optional[float]]:
    """The table's rows (run_figures, then ``vs_first``: eval loss change, tokens/s ratio, and the
    time to ``target``, default the least loss every run reached) and the target used."""
    rows = [run_figures(path, cfg, metrics, last) for path, (cfg, metrics) in runs]
    bests = [r["best_eval_loss"] for r in rows]
    if target is None and all(b is not None for b in bests):
        target = max(bests)
    base = rows[0]
    for r in rows:
        r["target"] = target
        hit = reached(r, target) if target is not None else None
        r["target_step"], r["target_elapsed_s"] = hit if hit else (None, None)
        r["eval_loss_change"] = _change(r["eval_loss"], base["eval_loss"])
        r["tokens_per_s_ratio"] = _ratio(r["tokens_per_s"], base["tokens_per_s"])
        r["target_time_ratio"] = _ratio(r["target_elapsed_s"], base["target_elapsed_s"])
    return rows, target


def _ratio(a, b):
    return a / b if a is not None and b else None


def _change(a, b):
    return (a - b) / abs(b) if a is not None and b else None


def _text(value, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def print_table(rows: list, target: Optional[float], last: int) -> None:
    name = max(len(r["run"]) for r in rows)
    how = max(len(r["how"]) for r in rows)
    print(f"{'run':<{name}}  {'how':<{how}}  {'steps':>6} {'tokens':>12} {f'loss(last {last})':>14} "
          f"{'eval_loss':>9} {'vs 1st':>7} {'tokens/s':>10} {'vs 1st':>6} {'time s':>8}")
    for r in rows:
        print(f"{r['run']:<{name}}  {r['how']:<{how}}  {r['steps']:>6} {_text(r['tokens'], ',d'):>12} "
              f"{_text(r['train_loss'], '.4f'):>14} {_text(r['eval_loss'], '.4f'):>9} "
              f"{_text(r['eval_loss_change'], '+.2%'):>7} {_text(r['tokens_per_s'], ',.0f'):>10} "
              f"{_text(r['tokens_per_s_ratio'], '.2f') + ('x' if r['tokens_per_s_ratio'] else ''):>6} "
              f"{r['elapsed_s']:>8.1f}")
    for name in sorted({n for r in rows for n in r["eval_losses"]}):
        each = ", ".join(f"{r['run']} " + _text(r["eval_losses"].get(name), ".4f", "none") for r in rows)
        print(f"eval_loss {name} (the last): {each}")
    for task in sorted({name for r in rows for name in r["choices"]}):
        each = ", ".join(f"{r['run']} " + _text((r["choices"].get(task) or {}).get("accuracy_norm"), ".4f", "none")
                         for r in rows)
        print(f"{task} accuracy_norm (the last --eval-choices): {each}")
    if target is None:
        print("time to an eval loss: a run without evaluations has none (--eval-every)")
        return
    each = "; ".join(f"{r['run']} " + (f"step {r['target_step']} at {r['target_elapsed_s']:.1f} s"
                                       + (f" ({r['target_time_ratio']:.2f}x)" if r is not rows[0] and
                                          r['target_time_ratio'] else "")
                                       if r["target_step"] is not None else "not reached")
                     for r in rows)
    print(f"time to eval loss {target:.4f}: {each}")


def plot(rows: list, runs: list, path: str) -> str:
    """Train (thin) and eval (dots) losses of every run against tokens trained (runs of other
    batch sizes side by side) and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..figures import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, (_, (_, metrics)) in zip(rows, runs):
        trained = [m for m in metrics if m.get("loss") is not None]
        for ax, key, at in zip(axes, ("tokens", "elapsed_s"), (3, 1)):
            line, = ax.plot([m[key] for m in trained], [m["loss"] for m in trained], linewidth=0.8, alpha=0.6,
                            label=f"{r['run']} ({r['how']})")
            if r["evals"]:
                ax.plot([e[at] for e in r["evals"]], [e[2] for e in r["evals"]], "o-",
                        color=line.get_color(), markersize=3)
    for ax, label in zip(axes, ("tokens", "training time (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    if rows[0]["target"] is not None:
        for ax in axes:
            ax.axhline(rows[0]["target"], color="grey", linestyle=":", linewidth=1)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def run(args) -> list:
    if args.last < 1:
        raise UsageError(f"--last {args.last}: give a number of steps >= 1")
    if args.target is not None and not math.isfinite(args.target):
        raise UsageError(f"--target {args.target}: give a finite eval loss")
    if len(set(args.runs)) != len(args.runs):
        raise UsageError("a run is named twice; name each once")
    check_json_path(args.json)
    if args.plot is not None:
        from ..figures import check_figure_path
        try:
            check_figure_path(args.plot, "compare.png")
        except ValueError as exc:
            raise UsageError(f"--plot {exc}") from None
    runs = [(path, _read_run(path)) for path in args.runs]  # every run read before anything is written
    rows, target = compare(runs, args.target, args.last)
    print_table(rows, target, args.last)
    if args.plot is not None:
        print(f"plot: {plot(rows, runs, args.plot)}")
    if args.json is not None:
        shown = [{k: v for k, v in r.items() if k != "evals"} for r in rows]
        write_text_atomic(Path(args.json), json.dumps(shown, indent=1) + "\n")
    return rows


def main(argv: Optional[list] = None) -> int:
    return run_command(PROG, lambda: run(build_parser().parse_args(argv)), (UsageError, RunDirError))


__all__ = ["main", "compare", "run_figures", "reached", "how_trained"]
