"""What bench/paper_study.py prints from its runs: per row the final eval loss, the paired gap to
its group's sync run and the recovered share of the plain 2bw gap (mean ± std over seeds, with the
per-seed values); the same at every evaluation point (the trend over training length); the table
text and the eval-curve plots.

A *row* is any object with ``label``, ``group``, ``variant``, ``schedule`` and ``role`` ("sync",
"delayed": plain 2bw, "mitigated"); a *run* is a dict with ``label``, ``seed``,
``final_eval_loss`` and ``eval_curve`` ([(step, loss)]).
"""
from __future__ import annotations

import math
from pathlib import Path

from study_runs import (StudyError, mean_std, paired_differences, plot_curve_panels, recovered_fractions,
                        share_text)


def check_settings(settings: list) -> None:
    """Each group has one sync row, and one plain delayed row when it has mitigated rows."""
    groups: dict[str, list[str]] = {}
    for s in settings:
        groups.setdefault(s.group, []).append(s.role)
    for group, roles in groups.items():
        if roles.count("sync") != 1 or roles.count("delayed") > 1 or (
                "mitigated" in roles and roles.count("delayed") != 1):
            raise StudyError(f"group {group!r} has rows {roles}; it needs one sync row, and one plain "
                             "delayed row when any row is mitigated")


# -- summary --------------------------------------------------------------------------------------
def summarize(results: list[dict], settings: list) -> dict:
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
                 "" if row["recovered"] is None else (f"{row['recovered'][0]:.0%} ± {row['recovered'][1]:.0%}"
                                                      if math.isfinite(row["recovered"][0]) else share_text(math.nan))]
        lines.append(f"{label:<{width}}{cells[0]:>17} {cells[1]:>17} {cells[2]:>13}")
    return "\n".join(lines)


MITIGATED_COLORS = ("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                    "tab:cyan", "tab:gray")


def plot_table(results: list[dict], settings: list, path: Path, title: str, tokens_per_step: int | None = None) -> None:
    """One panel per group: mean eval loss vs step (vs tokens seen, given ``tokens_per_step``) of
    each row, shaded ± std over seeds."""
    scale = tokens_per_step or 1
    panels = {}
    for s in settings:
        lines = panels.setdefault(s.group, [])
        color = {"sync": "tab:blue", "delayed": "tab:red"}.get(
            s.role, MITIGATED_COLORS[sum(1 for *_, role in lines if role == "mitigated") % len(MITIGATED_COLORS)])
        curves = [[(step * scale, loss) for step, loss in r["eval_curve"]] for r in results if r["label"] == s.label]
        lines.append((s.variant, color, curves, s.role))
    plot_curve_panels([(group, [line[:3] for line in lines]) for group, lines in panels.items()], path, title,
                      [r["final_eval_loss"] for r in results], xlabel="tokens" if tokens_per_step else "step")


# -- the trend over training length ---------------------------------------------------------------
def summarize_trend(results: list[dict], settings: list) -> list[dict]:
    """The summary's gap and recovered share at every evaluation point the runs share: one entry
    ``{"step", "rows": {label: {"gap", "recovered", "per_seed"}}}`` per step after step 0, for the
    delayed and mitigated rows. With a constant learning rate the state at step k of a run is the
    state a k-step run ends in (same seed, same batches), so this is the table at each shorter
    length; under a decaying schedule it is the run's own mid-training state."""
    check_settings(settings)
    curves = {(r["label"], r["seed"]): dict(r["eval_curve"]) for r in results}
    seeds = sorted({r["seed"] for r in results})
    steps = sorted(set.intersection(*(set(c) for c in curves.values())) - {0}) if curves else []
    sync = {s.group: s.label for s in settings if s.role == "sync"}
    plain = {s.group: s.label for s in settings if s.role == "delayed"}
    trend = []
    for step in steps:
        at = {label: {seed: curves[label, seed][step] for seed in seeds} for label, _ in curves}
        rows = {}
        for s in settings:
            if s.role == "sync":
                continue
            gap = paired_differences(at[s.label], at[sync[s.group]])
            row = {"gap": list(mean_std(gap)), "recovered": None, "per_seed": {"gap": gap}}
            if s.role == "mitigated":
                rec = recovered_fractions(paired_differences(at[plain[s.group]], at[sync[s.group]]), gap)
                row["recovered"], row["per_seed"]["recovered"] = list(mean_std(rec)), rec
            rows[s.label] = row
        group = next(iter(sync))  # the first group's sync loss, for scale
        trend.append({"step": step, "sync_group": group, "sync_eval": list(mean_std(at[sync[group]].values())),
                      "rows": rows})
    return trend


def format_trend(trend: list[dict], tokens_per_step: int) -> str:
    """One line per evaluation point: the first group's sync eval loss, each delayed row's gap and
    each mitigated row's recovered share (mean, then the seeds in brackets)."""
    if not trend:
        return ""
    labels = list(trend[0]["rows"])
    lines = ["trend over training length (eval loss at each evaluation point; recovered per seed in brackets)"]
    lines[0] += f"; sync eval: {trend[0]['sync_group']}"
    head = f"{'step':>6} {'tokens':>9} {'sync eval':>10}  " + "  ".join(f"{label:>24}" for label in labels)
    lines += [head, "-" * len(head)]
    for point in trend:
        cells = []
        for label in labels:
            row = point["rows"][label]
            if row["recovered"] is None:
                cells.append(f"gap {row['gap'][0]:+.4f}")
            else:
                seeds = ",".join(share_text(v) for v in row["per_seed"]["recovered"])
                cells.append(f"{share_text(row['recovered'][0])} ({seeds})")
        lines.append(f"{point['step']:>6} {point['step'] * tokens_per_step:>9} {point['sync_eval'][0]:>10.4f}  "
                     + "  ".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


# -- has the sync curve flattened? ----------------------------------------------------------------
FLAT_SHARE = 0.10
"""A sync run counts as flattened when its last quarter of steps gave less than this share of the
run's whole fall in eval loss (step 0 to the end)."""


def sync_flattening(results: list[dict], settings: list) -> dict:
    """Per group: the share of each seed's sync eval-loss fall that came in the last quarter of the
    steps (from the eval point nearest 3/4 of the run to the end), and whether every seed is below
    FLAT_SHARE."""
    out = {}
    for s in settings:
        if s.role != "sync":
            continue
        shares, slopes = [], []
        for r in sorted((r for r in results if r["label"] == s.label), key=lambda r: r["seed"]):
            steps = [step for step, _ in r["eval_curve"]]
            curve = dict(r["eval_curve"])
            quarter = min(steps, key=lambda step: abs(step - 0.75 * steps[-1]))
            total, last = curve[steps[0]] - curve[steps[-1]], curve[quarter] - curve[steps[-1]]
            shares.append(last / total if total > 0 else float("nan"))
            slopes.append(100 * last / (steps[-1] - quarter) if steps[-1] > quarter else float("nan"))
        out[s.group] = {"last_quarter_share": shares, "fall_per_100_steps": slopes,
                        "flattened": all(x < FLAT_SHARE for x in shares)}
    return out


def format_flattening(flattening: dict) -> str:
    """One line per group: the sync curve's last-quarter share of its fall, per seed."""
    lines = [f"sync curve flattening: share of the eval-loss fall in the last quarter of the steps "
             f"(flattened: < {FLAT_SHARE:.0%} for every seed)"]
    for group, f in flattening.items():
        shares = ", ".join(f"{x:.1%}" for x in f["last_quarter_share"])
        slopes = ", ".join(f"{x:.4f}" for x in f["fall_per_100_steps"])
        lines.append(f"  {group}: {shares} -> {'flattened' if f['flattened'] else 'still falling'}; "
                     f"the last quarter's fall per 100 steps: {slopes} nats")
    return "\n".join(lines)


__all__ = ["FLAT_SHARE", "sync_flattening", "format_flattening", "check_settings", "_duration", "summarize", "format_table", "plot_table", "summarize_trend", "format_trend"]
