"""Timeline drawing for :func:`asyncpp_ext.schedule.plot_timeline` (matplotlib, Agg backend)."""
from __future__ import annotations

import os
from typing import Optional

from ..figures import check_figure_path, save_figure

_ROW_HEIGHT = 0.8
_MAX_WIDTH_IN = 40.0  # beyond this the picture is unreadable anyway; labels are dropped instead

MAX_PLOT_BOXES = 10_000
"""The most boxes ``asyncpp-schedule --plot`` draws. Matplotlib takes about 2 s plus 2 ms a box:
10,020 boxes (1f1b, S=20 m=250) took 18 s and 410 MB on two cores, 40,020 took 85 s and 730 MB;
far fewer than that already make a picture too dense to read."""


def plot_boxes(stages: int, microbatches: int, steps: int) -> int:
    """Boxes in a timeline: per stage and step, a forward and a backward per microbatch and one
    optimizer step -- known before simulating, so a plot too large to draw is refused at once."""
    return stages * steps * (2 * microbatches + 1)


def check_plot_path(path: str) -> None:
    """ValueError (one line, starting with the path) unless ``path`` names a file matplotlib
    writes, in a directory that exists or can be made (``figures.check_figure_path``)."""
    check_figure_path(path, example="timeline.png")


def _microbatch_colors(m: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if m <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(m)]


def _lighten(rgba, amount: float):
    r, g, b, _ = rgba
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount, 1.0)


def _darken(rgba, factor: float):
    r, g, b, _ = rgba
    return (r * factor, g * factor, b * factor, 1.0)


def draw_timeline(result, path, *, title: Optional[str] = None) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe to call before pyplot is imported
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    path = os.fspath(path)
    S, m = result.stages, result.microbatches
    # With one microbatch per step (pipedream, or m = 1) the microbatch says nothing: boxes are
    # coloured and labelled by step instead, so each step's stale version can be read off.
    by_step = m == 1
    colors = _microbatch_colors(min(result.steps, 10) if by_step else m)
    makespan = result.makespan if result.makespan > 0 else 1.0
    computes = [e for e in result.timeline if e.op != "optimizer_step"]
    shortest = min((e.end - e.start for e in computes if e.end > e.start), default=makespan)
    # Wide enough that the shortest box is about 0.35 in, so its label fits.
    width = min(_MAX_WIDTH_IN, max(8.0, 0.35 * makespan / shortest + 2.0))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.75 * S + 1.2))
    inch_per_unit = (width - 2.0) / makespan
    font = max(4.0, min(8.0, (shortest * inch_per_unit) * 22))
    show_labels = shortest * inch_per_unit >= 0.22

    for e in result.timeline:
        y = S - 1 - e.stage
        if e.op == "optimizer_step":
            # Zero-cost optimizer steps still show as a bar at the step boundary.
            ax.add_patch(Rectangle((e.start, y - 0.5), max(e.end - e.start, 0.0), 1.0,
                                   facecolor="black", edgecolor="black", linewidth=2.5, zorder=3))
            ax.text((e.start + e.end) / 2, y + 0.5, f"v{e.version}", ha="center", va="center",
                    fontsize=font, fontweight="bold", zorder=5,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="black"))
            continue
        name = e.step if by_step else e.microbatch
        base = colors[name % len(colors)]
        face = _lighten(base, 0.55) if e.op == "forward" else _darken(base, 0.8)
        ax.add_patch(Rectangle((e.start, y - _ROW_HEIGHT / 2), e.end - e.start, _ROW_HEIGHT,
                               facecolor=face, edgecolor="0.25", linewidth=0.6,
                               hatch="///" if e.step % 2 else None, zorder=2))
        if show_labels:
            ax.text((e.start + e.end) / 2, y, f"{name}|v{e.version}", ha="center",
                    va="center", fontsize=font, zorder=4,
                    color="black" if e.op == "forward" else "white",
                    bbox=dict(boxstyle="square,pad=0.05", facecolor=face, edgecolor="none")
                    if e.step % 2 else None)

    ax.set_xlim(0, makespan * 1.015)  # room for the final optimizer bar
    ax.set_ylim(-0.6, S - 0.25)
    ax.set_yticks(range(S))
    ax.set_yticklabels([f"stage {S - 1 - y}" for y in range(S)])
    ax.set_xlabel("time (cost units)")
    ax.grid(axis="x", color="0.9", zorder=0)
    ax.set_title(title or (f"{result.schedule}   S={S}  m={m}  K={result.steps}   "
                           f"bubble fraction {result.bubble_fraction:.3f}   "
                           f"makespan {result.makespan:g}"))

    handles = [Patch(facecolor="0.85", edgecolor="0.25", label="forward (light)"),
               Patch(facecolor="0.35", edgecolor="0.25", label="backward (dark)"),
               Patch(facecolor="white", edgecolor="0.25", hatch="///", label="odd step (hatched)"),
               Line2D([], [], color="black", linewidth=3, label="optimizer step (creates vN)")]
    if by_step:  # colours repeat every len(colors) steps
        cycle = len(colors)
        handles += [Patch(facecolor=colors[i], label=f"step {i}" if result.steps <= cycle
                          else f"step {i} mod {cycle}") for i in range(cycle)]
    else:
        handles += [Patch(facecolor=colors[i], label=f"mb {i}") for i in range(min(m, 20))]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.32 if S < 3 else -0.18),
              ncol=min(len(handles), 12), fontsize=8, frameon=False,
              title=f"box label: {'step' if by_step else 'microbatch'}|weight version",
              title_fontsize=8)
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
