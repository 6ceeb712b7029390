"""What the bench studies (bench/delay_study.py, bench/paper_study.py) share: one simulated training
run built the way ``asyncpp-train --simulate`` builds it, a worker pool that runs many such runs,
paired-seed statistics, and eval-curve plots.

A run is a RunConfig made from the study's common arguments (``RUN_ARGS``: model, data, steps,
batch layout, evaluation) plus *overrides*: dotted config fields and their values
(``{"optim.name": "muon", "optim.ef_beta": 0.5}``). Any field of ``RunConfig`` can be overridden,
so a new config field (an optimizer, a mitigation) needs no change here. The seed fixes both the
initial weights and the batch order, so two runs of one seed that differ only in their overrides
or schedule form a paired comparison.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import fields
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from asyncpp_ext.figures import check_figure_path, save_figure

RUN_ARGS = ("model", "n_layer", "data", "steps", "microbatches", "micro_batch_size", "eval_every",
            "eval_batches")
"""The keys of the ``args`` dict every run takes (n_layer may be None: the preset's own)."""


class StudyError(ValueError):
    """A study setting that cannot run; the message is one line saying what to change."""


def check_plot_argument(path: str | None, example: str = "curves.png") -> None:
    """StudyError unless ``--plot`` (when given) names a figure file that can be written: checked
    before the runs, which take minutes to hours, rather than when the figure is drawn."""
    if path is not None:
        try:
            check_figure_path(path, example)
        except ValueError as exc:
            raise StudyError(f"--plot {exc}") from None


# -- configuration --------------------------------------------------------------------------------
def parse_value(text: str):
    """A ``--set`` value: JSON when it parses (0.5, 3, true, null, "x"), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def set_field(cfg, dotted: str, value) -> None:
    """Set ``section.field`` of a RunConfig; a name that is not a config field raises StudyError."""
    section_name, _, name = dotted.partition(".")
    section = getattr(cfg, section_name, None) if section_name in {f.name for f in fields(cfg)} else None
    if section is None or name not in {f.name for f in fields(section)}:
        raise StudyError(f"{dotted!r} is not a config field of this asyncpp_ext (section.field, e.g. "
                         "optim.lr); check the name or update asyncpp_ext")
    setattr(section, name, value)


def build_config(args: dict, schedule: str, seed: int, overrides: Mapping[str, object] = (),
                 stages: int | None = None):
    """The RunConfig ``asyncpp-train --simulate`` would run: ``args`` (see RUN_ARGS), the schedule
    and seed, then ``overrides`` (dotted field -> value) on top; validated (ConfigError if not).

    A pipedream run takes one microbatch of m·B sequences per step on ``stages`` stages: the same
    windows a sync or 2bw step splits into m microbatches of B."""
    from asyncpp_ext.models.registry import model_config
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig()
    cfg.model = model_config(args["model"], n_layer=args.get("n_layer"))
    cfg.data.source = args["data"]
    cfg.data.eval_batches = args["eval_batches"]
    cfg.pipeline.schedule = schedule
    cfg.pipeline.microbatches = args["microbatches"]
    cfg.pipeline.micro_batch_size = args["micro_batch_size"]
    if schedule == "pipedream":
        cfg.pipeline.microbatches, cfg.pipeline.stages = 1, stages
        cfg.pipeline.micro_batch_size = args["microbatches"] * args["micro_batch_size"]
    cfg.train.steps = args["steps"]
    cfg.train.seed = seed
    cfg.train.eval_every = args["eval_every"]
    cfg.train.simulate = True
    # Paired runs differ only in schedule and overrides: CUDA graphs' auto choice (on for sync
    # alone, with its chunked head kernel) would set the sync reference apart from the rest.
    cfg.train.cuda_graphs = False
    for dotted, value in dict(overrides).items():
        set_field(cfg, dotted, value)
    cfg.validate()
    return cfg


def check_configs(runs: Iterable[tuple], args: dict) -> None:
    """Build each run's config, model, optimizer and simulator once, for ``runs`` of ``(label,
    schedule, overrides, stages)``, and its data once per distinct shape, so a bad field or value,
    data that cannot feed the model, or an option this asyncpp_ext cannot run stops the study with
    one line (StudyError naming the run) before its first run."""
    data_checked = set()
    for label, schedule, overrides, stages in runs:
        try:
            cfg = build_config(args, schedule, 0, overrides, stages)
            shape = (cfg.data.source, cfg.model.vocab_size, cfg.model.seq_len, cfg.pipeline.microbatches,
                     cfg.pipeline.micro_batch_size, cfg.data.eval_fraction, cfg.data.eval_batches)
            if shape not in data_checked:
                run_data(cfg, args["micro_batch_size"])
                data_checked.add(shape)
            build_engine(cfg)
        except (ValueError, TypeError) as exc:
            raise StudyError(f"{label}: {' '.join(str(exc).split())}") from None


# -- one run (executes in a worker process) -------------------------------------------------------
def build_engine(cfg):
    """The model (initialised from the run's seed), its optimizer, and the DelaySimulator that
    trains them under the run's schedule: what ``asyncpp-train --simulate`` builds
    (asyncpp_ext.training.build)."""
    from asyncpp_ext.training.build import build_simulator

    return build_simulator(cfg)


def run_data(cfg, eval_micro_batch_size: int) -> tuple:
    """The run's training BatchStream and its evaluation batches (DataError, a ValueError, when
    the data cannot feed the model)."""
    from asyncpp_ext.data import BatchStream, eval_batches, load_tokens, split_tokens

    p = cfg.pipeline
    tokens = load_tokens(cfg.data.source, cfg.model.vocab_size)
    train_tokens, eval_tokens = split_tokens(tokens, cfg.data.eval_fraction, eval_micro_batch_size,
                                             cfg.model.seq_len, source=cfg.data.source)
    stream = BatchStream(train_tokens, p.microbatches, p.micro_batch_size, cfg.model.seq_len,
                         seed=cfg.data_seed(), sampling=cfg.data.sampling)
    eval_set = eval_batches(eval_tokens, eval_micro_batch_size, cfg.model.seq_len, cfg.data.eval_batches)
    return stream, eval_set


def train_run(cfg, eval_micro_batch_size: int) -> dict:
    """Train ``cfg`` in this process with the DelaySimulator and the CLI's optimizer factory.

    Returns ``final_eval_loss`` (NaN when the run diverged), ``eval_curve`` ([(step, loss)], from
    step 0), ``train_losses`` and ``seconds``. The token split and the eval windows are cut by
    ``eval_micro_batch_size`` for every schedule, so every run of a study is evaluated on the same
    windows."""
    stream, eval_set = run_data(cfg, eval_micro_batch_size)
    engine = build_engine(cfg)
    start = time.perf_counter()
    losses, curve = [], [(0, engine.eval_loss(eval_set))]
    every = cfg.train.eval_every or cfg.train.steps
    for loss in engine.train_steps(stream, cfg.train.steps):
        losses.append(loss)
        step = len(losses)
        if not math.isfinite(loss):
            break  # diverged: report it rather than train on NaNs
        if step % every == 0 or step == cfg.train.steps:
            curve.append((step, engine.eval_loss(eval_set)))
    final = curve[-1][1] if len(losses) == cfg.train.steps else float("nan")
    return {"final_eval_loss": final, "eval_curve": curve, "train_losses": losses,
            "seconds": round(time.perf_counter() - start, 2)}


def run_overrides(args: dict, schedule: str, seed: int, overrides: Mapping[str, object],
                  stages: int | None = None, tag: Mapping[str, object] | None = None) -> dict:
    """``train_run`` of ``build_config(args, schedule, seed, overrides, stages)``, its result
    preceded by the ``tag`` items (what the caller needs to recognise the run)."""
    cfg = build_config(args, schedule, seed, overrides, stages)
    return {**(tag or {}), **train_run(cfg, args["micro_batch_size"])}


# -- the worker pool ------------------------------------------------------------------------------
def init_worker(threads: int) -> None:
    """Give this process ``threads`` intra-op torch threads."""
    import torch

    torch.set_num_threads(threads)


def run_pool(fn: Callable, jobs: Sequence[tuple], workers: int, threads: int,
             report: Callable[[int, object], None] | None = None) -> list:
    """``fn(*job)`` for every job, ``workers`` at a time; the results in job order.

    ``report(done, result)`` is called in this process as each job finishes. With one worker the
    jobs run here (no worker pays for importing torch). Otherwise ``fn`` must be importable by
    name in a fresh process (spawned: module-level, its script's folder on sys.path)."""
    results = [None] * len(jobs)
    if workers == 1:
        init_worker(threads)
        for i, job in enumerate(jobs):
            results[i] = fn(*job)
            if report is not None:
                report(i + 1, results[i])
        return results
    # A pool that fails loudly: a worker that dies (killed, or unable to import fn) ends the study
    # with BrokenProcessPool instead of a wait for a replacement.
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=init_worker,
                               initargs=(threads,))
    try:
        futures = [pool.submit(_run_indexed, (i, fn, job)) for i, job in enumerate(jobs)]
        for done, future in enumerate(as_completed(futures), 1):
            i, result = future.result()
            results[i] = result
            if report is not None:
                report(done, result)
    except BaseException:  # an interrupted study must not leave workers training on
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _run_indexed(job: tuple) -> tuple:
    i, fn, args = job
    return i, fn(*args)


def progress_reporter(total: int, describe: Callable[[dict], str]) -> Callable[[int, dict], None]:
    """A ``report`` for run_pool printing ``[done/total elapsed] <describe(result)>: eval L (s)``
    to stderr."""
    start = time.perf_counter()

    def report(done: int, r: dict) -> None:
        print(f"[{done}/{total} {time.perf_counter() - start:6.0f} s] {describe(r)}: eval "
              f"{r['final_eval_loss']:.4f} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)

    return report


# -- statistics -----------------------------------------------------------------------------------
def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value, NaN for none). A NaN or infinite value
    (a diverged run) makes the mean NaN or infinite and the deviation NaN, not an error."""
    values = list(values)
    if not values:
        return float("nan"), float("nan")
    if not all(math.isfinite(v) for v in values):
        return statistics.fmean(values), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_differences(a: Mapping[int, float], b: Mapping[int, float]) -> list[float]:
    """``a[seed] - b[seed]`` for every seed of ``a``, in seed order (``b`` must hold each one)."""
    return [a[s] - b[s] for s in sorted(a)]


def recovered_fraction(gap_without: float, gap_with: float) -> float:
    """``(without - with) / without``: the share of the gap a mitigation wins back (1 = all of
    it, 0 = none, < 0 = worse); NaN where there is no gap to win back (a run too short for the
    delay to show)."""
    return (gap_without - gap_with) / gap_without if gap_without != 0 else float("nan")


def recovered_fractions(gap_without: Sequence[float], gap_with: Sequence[float]) -> list[float]:
    """``recovered_fraction`` per seed."""
    return [recovered_fraction(g0, g1) for g0, g1 in zip(gap_without, gap_with)]


def share_text(share: float) -> str:
    """A recovered share as a table shows it: "37%", or "n/a" where it is undefined (NaN: no gap
    to recover, in a run too short for the delay to show, or a diverged run)."""
    return f"{share:.0%}" if math.isfinite(share) else "n/a"


# -- plots ----------------------------------------------------------------------------------------
def mean_band(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list, list, list]:
    """Steps, mean and std over seeds of eval curves that share their steps (a shorter, diverged
    curve counts where it has values)."""
    steps = [s for s, _ in curves[0]]
    per_step = [[c[i][1] for c in curves if i < len(c)] for i in range(len(steps))]
    mean = [statistics.fmean(x) for x in per_step]
    std = [statistics.stdev(x) if len(x) > 1 else 0.0 for x in per_step]
    return steps, mean, std


def plot_curve_panels(panels: Sequence[tuple[str, Sequence[tuple[str, str | None, list]]]],
                      path: Path, title: str, finals: Iterable[float], xlabel: str = "step") -> None:
    """One panel per ``(panel title, lines)``; each line ``(label, color, curves)`` is the mean
    eval loss over its curves (one per seed), shaded ± std. Lines without curves are left out; the
    shared y axis zooms on the range of the ``finals`` (final eval losses) where gaps show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), sharey=True, squeeze=False)
    for ax, (panel_title, lines) in zip(axes.flat, panels):
        for label, color, curves in lines:
            if not curves:
                continue
            steps, mean, std = mean_band(curves)
            ax.plot(steps, mean, color=color, label=label)
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], color=color, alpha=0.2)
        ax.set_title(panel_title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        crowded = len(lines) > 4  # many lines: a smaller two-column legend leaves the curves visible
        ax.legend(**(dict(fontsize=6, ncol=2) if crowded else {}))
    for ax in axes[:, 0]:
        ax.set_ylabel("eval loss")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    finals = [f for f in finals if math.isfinite(f)]
    if finals:
        axes[0, 0].set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)


__all__ = ["RUN_ARGS", "StudyError", "parse_value", "set_field", "build_config",
           "build_engine", "train_run", "run_overrides", "init_worker", "run_pool", "progress_reporter", "mean_std",
           "paired_differences", "recovered_fractions", "mean_band", "plot_curve_panels"]
