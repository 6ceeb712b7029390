"""The paper's comparison tables: what a one-step weight delay (PipeDream-2BW) costs each setting,
and how much of that cost a mitigation wins back, one command per table.

    python bench/paper_study.py optimizers    # 7 optimizers x {sync, 2bw, 2bw+EF at its auto beta}
    python bench/paper_study.py ef            # muon x EF beta {0.25,0.5,0.75,1} x source {buffer,weights}
    python bench/paper_study.py mitigations   # muon, adamw x 2bw + {none, ef, predict, dc, lr-rescale}
    python bench/paper_study.py momentum      # muon momentum 0.9/0.95/0.98: sync, 2bw, 2bw+EF
    python bench/paper_study.py sensitivity   # each optimizer's default lr x {0.5, 1, 2}: sync, 2bw
    python bench/paper_study.py ef --json     # one JSON object: settings, runs (losses, curves), summary
    python bench/paper_study.py momentum --plot momentum.png
    python bench/paper_study.py ef --scale cpu-long  # 1200 steps: does EF's share grow with length?
    python bench/paper_study.py ef --scale gpu --plot ef.png   # a 56M Llama on one GPU, loss vs tokens

``--scale`` (bench/study_scales.py) sets the size of every run: ``cpu`` (the default, below),
``cpu-long`` (the ef table, 10x the steps) and ``gpu`` (the optimizers, ef and mitigations tables
on a Llama-family model over a BPE corpus of the machine's own text, bench/study_corpus.py, with
warmup + cosine, epoch sampling and bf16, on CUDA only). Besides the final table, every run prints
the sync curve's flattening and the trend: gap and recovered share at every evaluation point.

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
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the shared study code next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_runs import (StudyError, build_config, check_configs, check_plot_argument, parse_value,  # noqa: E402
                        progress_reporter, run_overrides, run_pool)
from study_report import (_duration, check_settings, format_flattening, format_table, format_trend,  # noqa: E402
                          plot_table, summarize, summarize_trend, sync_flattening)
from study_scales import GPU_VOCAB, SCALES  # noqa: E402

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
ARCH_NAMES = {"gpt": "GPT", "llama": "Llama", "hf": "Hugging Face"}
"""How the header names each model family."""

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


def table_settings(table: str, optimizers: tuple[str, ...], full: bool,
                   ef_rows: tuple[tuple[float, str], ...] | None = None) -> list[Setting]:
    """Every row of ``table`` for ``optimizers``; the ef table's (beta, source) rows are
    ``ef_rows`` when given (a scale's), else every beta x source."""
    ef_rows = ef_rows or tuple((b, src) for src in EF_SOURCES for b in EF_BETAS)
    rows = []
    for opt in optimizers:
        auto_ef = f"ef{auto_ef_beta(opt):g}"  # the rows leave ef_beta None: the optimizer's auto beta
        if table == "optimizers":
            rows += _rows(opt, opt, {}, {f"2bw+{auto_ef}": {}})
        elif table == "ef":
            rows += _rows(opt, opt, {}, {f"2bw+ef{b:g} {src}": {"optim.ef_beta": b, "optim.ef_source": src}
                                         for b, src in ef_rows})
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


# -- command line ---------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, through main's StudyError handling
        raise StudyError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=tuple(TABLES), help="which table to run")
    p.add_argument("--scale", choices=tuple(SCALES), default="cpu",
                   help="run size (bench/study_scales.py): cpu (default), cpu-long (ef only), gpu (CUDA)")
    p.add_argument("--full", action="store_true", help="the longer setting: TABLES[table].full_steps steps "
                   "and the extra rows (adamw in ef, momentum 0.8); --scale cpu only")
    p.add_argument("--steps", type=int, help="override the table's steps")
    p.add_argument("--seeds", type=int, help="paired seeds 0..N-1 (default: the scale's, 3 on cpu)")
    p.add_argument("--model", help="override the table's model preset (tiny, small, llama-tiny, ...)")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--data", help="'builtin' (the package's built-in corpus; the cpu default), 'corpus' "
                   "(the gpu default: build or reuse a BPE corpus of the text on this machine, "
                   "bench/study_corpus.py) or a UTF-8 text / .bin file")
    p.add_argument("--corpus-dir", default="runs/study_corpus",
                   help="where --data corpus is built and found again (default runs/study_corpus)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where runs train (default: the scale's); cpu with --scale gpu is for tests only")
    p.add_argument("--optimizers", help="comma-separated, replacing the table's optimizers")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config override for every run, e.g. optim.weight_decay=0.1 (repeatable)")
    p.add_argument("--delay-only", choices=("matrices", "others"),
                   help="attribution: the 2bw rows delay only the matrices Muon updates, or only the other "
                        "parameters (pipeline.delay_only); the sync rows are unchanged")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: the scale's, 2 on cpu)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per microbatch (the scale's, 8 on cpu)")
    p.add_argument("--eval-every", type=int, help="default: the scale's, else steps // 5")
    p.add_argument("--eval-batches", type=int, help="batches per evaluation (the scale's, 8 on cpu)")
    p.add_argument("--workers", type=int, help="runs at once, in worker processes (the scale's, 2)")
    p.add_argument("--threads", type=int, help="torch threads per worker (the scale's, 1 on cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write eval-loss curves, one panel per group")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and checked arguments, the scale's values filled in; StudyError names a bad one."""
    a = build_parser().parse_args(argv)
    plan, scale = TABLES[a.table], SCALES[a.scale]
    if a.table not in scale.tables:
        raise StudyError(f"--scale {a.scale} defines the {', '.join(scale.tables)} table(s), not {a.table}; "
                         "use --scale cpu, or --steps/--full for a longer cpu run")
    if a.full and a.scale != "cpu":
        raise StudyError(f"--full is the longer cpu setting; --scale {a.scale} sets its own length (use --steps)")
    a.model = a.model or scale.model or plan.model
    a.steps = a.steps if a.steps is not None else (
        plan.full_steps if a.full else scale.steps.get(a.table, plan.steps))
    device_given = a.device is not None
    for name in ("seeds", "microbatches", "micro_batch_size", "eval_batches", "workers", "threads", "data",
                 "device"):  # what the command line left unset comes from the scale
        if getattr(a, name) is None:
            setattr(a, name, getattr(scale, name))
    a.eval_every = a.eval_every if a.eval_every is not None else min(a.steps, scale.eval_every or max(1, a.steps // 5))
    for name in ("steps", "seeds", "workers", "threads", "microbatches", "micro_batch_size", "eval_batches",
                 "eval_every"):
        if getattr(a, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = "--device cuda" if device_given else f"--scale {a.scale}"
            instead = "--device cpu" if device_given else "--scale cpu / cpu-long"
            raise StudyError(f"{why} trains on a CUDA GPU and torch.cuda.is_available() is False here; "
                             f"run it on a GPU machine, or use {instead}")
    check_plot_argument(a.plot)
    if a.data not in ("builtin", "corpus") and not Path(a.data).is_file():
        raise StudyError(f"--data {a.data} does not exist; pass a UTF-8 text or .bin file, --data builtin "
                         "or --data corpus")
    if a.optimizers is not None:
        a.optimizers = tuple(x.strip() for x in a.optimizers.split(",") if x.strip())
        if not a.optimizers:
            raise StudyError("--optimizers is empty; name at least one, e.g. --optimizers adamw,muon")
    else:
        a.optimizers = (plan.full_optimizers or plan.optimizers) if a.full else scale.optimizers.get(
            a.table, plan.optimizers)
    if a.table == "momentum" and not set(a.optimizers) <= set(MOMENTUM_OPTIMIZERS):
        raise StudyError(f"--optimizers {','.join(a.optimizers)}: the momentum table sweeps "
                         f"optim.muon_momentum, used by {' and '.join(MOMENTUM_OPTIMIZERS)} only")
    a.ef_rows = scale.ef_rows
    a.overrides = dict(scale.overrides)
    if scale.warmup_share:
        a.overrides["optim.warmup_steps"] = max(1, round(a.steps * scale.warmup_share))
    if a.device != "cpu":
        a.overrides["train.device"] = a.device
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
    settings = table_settings(a.table, a.optimizers, a.full, a.ef_rows)
    check_settings(settings)
    check_extras(dict(s.overrides)["optim.name"] for s in settings)
    corpus = None
    if a.data == "corpus":  # after the cheap checks: building it takes minutes the first time
        from study_corpus import ensure_corpus

        corpus = ensure_corpus(Path(a.corpus_dir), int(a.overrides.get("model.vocab_size", GPU_VOCAB)))
        a.data = corpus["path"]
    args = {"model": a.model, "n_layer": a.n_layer, "data": a.data, "steps": a.steps,
            "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size,
            "eval_every": a.eval_every, "eval_batches": a.eval_batches}
    if a.delay_only:
        settings = [replace(s, overrides=s.overrides + (("pipeline.delay_only", a.delay_only),))
                    if s.schedule == "2bw" else s for s in settings]
    check_configs([(s.label, s.schedule, {**a.overrides, **dict(s.overrides)}, None) for s in settings], args)
    import torch

    cfg = build_config(args, "sync", 0, {**a.overrides, **dict(settings[0].overrides)})
    tokens_per_step = a.microbatches * a.micro_batch_size * cfg.model.seq_len
    runs = len(settings) * a.seeds
    estimate = estimate_seconds(settings, a.seeds, a.steps, a.model, a.workers)
    setup = {"table": a.table, "title": TABLES[a.table].title, "scale": a.scale, "full": a.full, **args,
             "seeds": a.seeds, "batch": a.microbatches * a.micro_batch_size, "seq_len": cfg.model.seq_len,
             "tokens_per_step": tokens_per_step, "tokens_per_run": tokens_per_step * a.steps,
             "model_parameters": count_parameters(cfg), "arch": cfg.model.arch, "device": cfg.train.device,
             "lr_schedule": cfg.optim.lr_schedule, "warmup_steps": cfg.optim.warmup_steps,
             "corpus": corpus, "optimizers": list(a.optimizers), "delay_only": a.delay_only,
             "overrides": a.overrides, "workers": a.workers, "threads": a.threads, "runs": runs,
             "estimated_seconds": None if estimate is None else round(estimate),
             "torch": torch.__version__, "cpus": os.cpu_count()}
    print(f"{a.table}: {runs} runs, estimated {'?' if estimate is None else _duration(estimate)} on "
          f"{a.workers} worker(s)", file=sys.stderr, flush=True)
    # Seed-major order: every row of a seed finishes close together, so a stopped study has whole seeds.
    jobs = [(args, s.schedule, seed, run_fields(a, s), None,
             {"label": s.label, "group": s.group, "schedule": s.schedule, "seed": seed})
            for seed in range(a.seeds) for s in settings]
    start = time.perf_counter()
    results = run_pool(run_overrides, jobs, a.workers, a.threads,
                       progress_reporter(len(jobs), lambda r: f"{r['label']} seed {r['seed']}"))
    return {"setup": setup, "settings": [s.as_dict() for s in settings], "runs": results,
            "summary": summarize(results, settings), "trend": summarize_trend(results, settings),
            "flattening": sync_flattening(results, settings),
            "seconds": round(time.perf_counter() - start, 1)}, settings


def run_fields(a: argparse.Namespace, s: Setting) -> dict:
    """The config fields of one row's runs: the scale's and --set's, then the row's own."""
    return {**a.overrides, **dict(s.overrides)}


def count_parameters(cfg) -> int:
    """Trainable parameters of the run's model (a tied matrix counted once)."""
    from asyncpp_ext.models.registry import build_model

    return sum(p.numel() for p in build_model(cfg.model).parameters())


def header_lines(out: dict) -> list[str]:
    """The table's header: what it compares, the run setup, and its budget."""
    s = out["setup"]
    layers = "" if s["n_layer"] is None else f" ({s['n_layer']} layers)"
    estimate = "?" if s["estimated_seconds"] is None else _duration(s["estimated_seconds"])
    schedule = "" if s["lr_schedule"] == "constant" else f", lr {s['lr_schedule']} after {s['warmup_steps']} warmup"
    corpus = "" if not s["corpus"] else (f" ({s['corpus']['train_tokens']:,} training tokens; a run sees "
                                         f"{s['tokens_per_run']:,})")
    return [f"{s['table']}: {s['title']}",
            f"{s['model']} {ARCH_NAMES.get(s['arch'], s['arch'])}{layers} ({s['model_parameters']:,} parameters) on {s['device']}, batch "
            f"{s['batch']} ({s['microbatches']} x {s['micro_batch_size']}) x {s['seq_len']} tokens, "
            f"{s['steps']} steps{' (--full)' if s['full'] else ''}{schedule}, {s['seeds']} seeds, "
            f"data {s['data']}{corpus}; scale {s['scale']}; budget {s['runs']} runs, estimated {estimate}, "
            f"took {_duration(out['seconds'])} ({s['workers']} worker(s) x {s['threads']} thread(s), "
            f"torch {s['torch']})"]


def report(out: dict) -> str:
    """The text the script prints: the table, the sync curves' flattening, and the trend."""
    s = out["setup"]
    parts = [format_table(out["summary"], header_lines(out), s["seeds"]), format_flattening(out["flattening"])]
    if len(out["trend"]) > 1:
        parts.append(format_trend(out["trend"], s["tokens_per_step"]))
    return "\n\n".join(parts)


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
        per_token = s["scale"] == "gpu"  # the paper-scale plots: loss vs tokens seen
        plot_table(out["runs"], settings, Path(a.plot),
                   f"{a.table}: {s['model']} ({s['model_parameters'] / 1e6:.3g}M), batch {s['batch']} x "
                   f"{s['seq_len']}, {s['steps']} steps, {s['seeds']} seeds",
                   s["tokens_per_step"] if per_token else None)
    print(json.dumps(out) if a.json else report(out))
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
