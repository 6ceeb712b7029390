"""Against the best synchronous schedules: our gpipe/1f1b/2bw/pipedream vs torch's GPipe, 1F1B,
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, side by side.

    python bench/peer_schedules.py                     # S = 2, 4, 8 x m = S, 2S, 4S, best of 2 (~6 min on 2 cores)
    python bench/peer_schedules.py --stages 4 --microbatches 8
    python bench/peer_schedules.py --quick             # the smoke test's setting (S=2, m=2,4; seconds)
    python bench/peer_schedules.py --json | --plot docs/peer_schedules.png

**The model.** Every rank holds the same compute: two MLP blocks (Linear(64, 256), GELU,
Linear(256, 64); micro-batches of 32 rows; mse loss on the last block; the project's fused
AdamW), so the model has 2S blocks and every schedule runs the same split of the same model with
the same total compute per step. Our schedules and torch's GPipe/1F1B put blocks 2r, 2r+1 on rank
r as one stage. torch's multi-chunk schedules run **two chunks (one block each) per rank**: the
looped ones (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) put stages r and r+S on rank r, the
V-shaped ones (ZBVZeroBubble, DualPipeV) stages r and 2S-1-r.

**Emulated compute (why 8 ranks on 2 cores are fair).** The blocks are real modules: real
autograd, real activations saved (which is what the memory columns measure), and a real split of
the backward into input- and weight-gradient parts for the zero-bubble schedules (torch computes
them with separate autograd calls). But their arithmetic is tiny and each block *holds* for a
fixed time in three places, as a GPU kernel looks to the host (the approach of
bench/schedule_efficiency.py): its forward (``--fwd-ms``/2 per block), the gradient for its input
(``--bwd-input-ms``/2, on the activation path only) and the gradient for its weights
(``--bwd-weight-ms``/2, on the weight path only). A full backward pays both; torch's I and W
actions pay one each. The holds sleep (spinning only the last 0.5 ms, and not at all when the
ranks outnumber the cores), so eight ranks on two cores wait in parallel as eight accelerators
would, and the CPU only carries the runtimes' host work. Defaults: F = B = W = 4 ms per rank, the
zero-bubble paper's equal-cost assumption (backward = 2 x forward, as usual).

**Columns.** steps/s in steady state (the median step-to-step interval inside one timed stream,
the slowest rank's; a continuous stream's drain left out; the JSON's ``stream_steps_per_s``
includes it); ach/ideal = the bubble-free ideal step (m x the slowest rank's calibrated
per-microbatch compute + one optimizer step, measured alone in one process, the fastest of 30)
over the measured step; model = the same ratio predicted by the analytical model (asyncpp_ext.schedule.analytic: closed forms for ours; for torch's, its own
action order simulated with these costs); memory per rank in KiB, measured: weights (every version
kept) + gradients + optimizer state + peak activations saved by autograd (one ActivationMeter for
every runtime); loss gap: what the weight delay costs in final eval loss (nats/byte, gap to sync,
mean over 3 seeds) from docs/results.md "Constant vs variable delay" (6-layer small GPT, 200
steps): cited, not rerun. 2bw's delay is one step at every depth, so its gap does not depend on S;
pipedream's grows with S; every synchronous schedule pays none.

A torch schedule that cannot run a setting (not in this torch, or its shape rule) prints a one-line
reason instead of a row. ``--model-only`` prints the analytical model's table without processes;
all three costs 0 measure each runtime's own host work. Results and discussion: docs/results.md,
"Against the best synchronous schedules".
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncpp_ext.figures import check_figure_path, save_figure  # noqa: E402
from asyncpp_ext.pipeline import spawn  # noqa: E402
from asyncpp_ext.schedule import analytic  # noqa: E402
from bench_command import ArgumentParser  # noqa: E402
from gpt_workload import cpu_model  # noqa: E402
from peer_runs import (BLOCKS_PER_RANK, HIDDEN, MICRO_BATCH, OURS, PEERS, WIDTH, adamw, make_blocks,  # noqa: E402
                       spin_for, torch_orders, torch_refusal, worker)

DELAY_STUDY = "docs/results.md, Constant vs variable delay (6-layer small GPT, 200 steps, 3 seeds)"
# Final eval loss gap to sync (nats/byte, mean over 3 seeds) from DELAY_STUDY; tests/test_peer_schedules.py
# checks the numbers still stand in docs/results.md.
LOSS_GAP = {"muon": {"2bw": 0.214, "pipedream": {2: 0.151, 4: 0.363, 8: 0.488}},
            "adamw": {"2bw": 0.768, "pipedream": {2: 0.324, 4: 0.812, 8: 0.893}}}


# ---- calibration and the model -------------------------------------------------------------

def calibrate(stages: int, costs_ms: dict, repeats: int = 30) -> dict:
    """Per-microbatch compute of one rank's two blocks alone in this process (the fastest of
    ``repeats``: on a shared machine outside load only adds time, and the holds end by the same
    sleep as in the runs): forward, full backward (inner rank, and the rank with the loss), the
    split backward as torch's zero-bubble schedules run it (input part, weight part), and one
    AdamW step."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spin_s = spin_for(stages)
        module = nn.Sequential(*make_blocks(1, costs_ms, spin_s))
        opt = adamw(module)
        target = torch.randn(MICRO_BATCH, WIDTH)
        grad_out = torch.randn(MICRO_BATCH, WIDTH)
        samples = {k: [] for k in ("fwd", "bwd", "fwd_last", "bwd_last", "bwd_input", "bwd_weight", "opt")}
        for _ in range(repeats):
            x = torch.randn(MICRO_BATCH, WIDTH, requires_grad=True)
            t0 = time.perf_counter()
            y = module(x)
            t1 = time.perf_counter()
            y.backward(grad_out)
            t2 = time.perf_counter()
            samples["fwd"].append(t1 - t0)
            samples["bwd"].append(t2 - t1)
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(module(x), target)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            samples["fwd_last"].append(t1 - t0)
            samples["bwd_last"].append(t2 - t1)
            y = module(x)
            t0 = time.perf_counter()
            _, groups = stage_backward_input([y], [grad_out], [x], module.parameters())
            t1 = time.perf_counter()
            stage_backward_weight(module.parameters(), groups)
            t2 = time.perf_counter()
            samples["bwd_input"].append(t1 - t0)
            samples["bwd_weight"].append(t2 - t1)
            t0 = time.perf_counter()
            opt.step()
            samples["opt"].append(time.perf_counter() - t0)
            opt.zero_grad()
        med = {k: min(v) for k, v in samples.items()}
        med["per_mb"] = max(med["fwd"] + med["bwd"], med["fwd_last"] + med["bwd_last"])
        return med
    finally:
        torch.set_num_threads(threads)


def model_step_s(impl: str, name: str, stages: int, m: int, cal: dict, costs_ms: dict) -> float:
    """Predicted seconds per step: ours from the closed forms (steady state), torch's from its own
    action order simulated with the calibrated costs; both plus the optimizer step."""
    c, o = cal["per_mb"], cal["opt"]
    if impl == "ours":
        if name == "pipedream":
            return m * (c + o)
        frac = analytic.steady_bubble_fraction(name, stages, m)
        return m * c / (1 - frac) + o
    orders, stage_to_rank = torch_orders(name, stages, m)
    chunks = 1 if PEERS[name] == "single" else BLOCKS_PER_RANK
    total = sum(costs_ms.values())  # zero: the runtimes' host work alone; split it evenly
    share = {k: v / total for k, v in costs_ms.items()} if total > 0 else {k: 1 / 3 for k in costs_ms}
    costs = {"F": c * share["fwd"] / chunks, "I": c * share["bwd_input"] / chunks,
             "W": c * share["bwd_weight"] / chunks, "B": c * (share["bwd_input"] + share["bwd_weight"]) / chunks}
    return analytic.simulate_actions(orders, stage_to_rank, costs, chunks=chunks).makespan + o


def loss_gap(impl: str, name: str, stages: int) -> dict | None:
    """{optimizer: gap} from the delay study, 0 for synchronous schedules, None where not studied."""
    if impl == "torch" or name in ("gpipe", "1f1b"):
        return {"muon": 0.0, "adamw": 0.0}
    out = {}
    for opt, gaps in LOSS_GAP.items():
        g = gaps[name]
        out[opt] = g if not isinstance(g, dict) else g.get(stages)
    return out if all(v is not None for v in out.values()) else None


# ---- the whole measurement -------------------------------------------------------------------

def plan_for(stages: int, ms: list[int], peers: list[str]) -> tuple[list, list[str]]:
    plan, skipped = [], []
    for m in ms:
        for name in OURS:
            plan.append((m, "ours", name))
        for name in peers:
            why = torch_refusal(name, stages, m)
            if why:
                skipped.append(f"S={stages} m={m}: {why}")
            else:
                plan.append((m, "torch", name))
    return plan, skipped


def measure(stage_list: list[int], m_factors: list[int], costs_ms: dict, steps: int, warmup: int,
            peers: list[str], microbatches: list[int] | None = None, repeats: int = 1) -> dict:
    """Every row's figure is its fastest repeat (the slowest rank's steady step within a repeat)."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    # One thread per rank for every runtime, through the environment so that every thread of every
    # runtime starts with it (OpenMP's count is per thread; our executor thread now copies the
    # rank's, torch's schedules get the same from here; docs/results.md).
    omp_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    rows, skipped, calibration = [], [], {}
    for S in stage_list:
        ms = microbatches or [f * S for f in m_factors]
        cal = calibrate(S, costs_ms)
        calibration[S] = cal
        plan, skip = plan_for(S, ms, peers)
        skipped += skip
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, "run")
            spawn(worker, S, (S, plan, repeats, costs_ms, steps, warmup, prefix))
            per_rank = []
            for r in range(S):
                with open(f"{prefix}-{r}.json") as fh:
                    per_rank.append(json.load(fh))
        for i, (m, impl, name) in enumerate(plan):
            seen = [[ranks[j * len(plan) + i] for ranks in per_rank] for j in range(repeats)]
            views = min(seen, key=lambda vs: max(v["steady_step_s"] for v in vs))
            step_s = max(v["steady_step_s"] for v in views)
            ideal = m * cal["per_mb"] + cal["opt"]
            memory = [v["memory"] for v in views]
            for mem in memory:
                mem["total"] = mem["weights"] + mem["grads"] + mem["optimizer_state"] + (mem["activations"] or 0)
            rows.append({"stages": S, "m": m, "impl": impl, "schedule": name,
                         "chunks_per_rank": 1 if impl == "ours" or PEERS[name] == "single" else BLOCKS_PER_RANK,
                         "placement": "stage" if impl == "ours" else PEERS[name],
                         "steps_per_s": 1 / step_s, "step_ms": 1e3 * step_s,
                         "stream_steps_per_s": 1 / max(v["stream_step_s"] for v in views),
                         "all_steps_per_s": [1 / max(v["steady_step_s"] for v in vs) for vs in seen],
                         "run_s": max(v["run_s"] for v in views), "setup_s": max(v["setup_s"] for v in views),
                         "warmup_s": max(v["warmup_s"] for v in views),
                         "ideal_step_ms": 1e3 * ideal, "achieved_over_ideal": ideal / step_s,
                         "model_over_ideal": ideal / model_step_s(impl, name, S, m, cal, costs_ms),
                         "memory": memory, "loss_gap": loss_gap(impl, name, S)})
    if omp_before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp_before
    for S in stage_list:
        for m in sorted({r["m"] for r in rows if r["stages"] == S}):
            group = [r for r in rows if r["stages"] == S and r["m"] == m]
            base = next((r for r in group if r["impl"] == "torch" and r["schedule"] == "1F1B"), None)
            for r in group:
                r["ratio_to_torch_1f1b"] = r["steps_per_s"] / base["steps_per_s"] if base else None
    return {"costs_ms": costs_ms, "steps": steps, "warmup": warmup, "repeats": repeats, "micro_batch_rows": MICRO_BATCH,
            "block": f"Linear({WIDTH},{HIDDEN})-GELU-Linear({HIDDEN},{WIDTH})", "blocks_per_rank": BLOCKS_PER_RANK,
            "machine": _machine(), "torch": torch.__version__,
            "loadavg_before_after": [load_before, os.getloadavg()[0]],
            "calibration_ms": {S: {k: 1e3 * v for k, v in cal.items()} for S, cal in calibration.items()},
            "rows": rows, "skipped": skipped, "seconds": time.monotonic() - started}


def model_rows(stage_list: list[int], ms_for, costs_ms: dict, peers: list[str]) -> tuple[list, list]:
    """The analytical model alone (no processes): per (S, m, schedule) the fraction of the ideal
    with the nominal costs (no optimizer step, no host work) and the most microbatches' activations
    a rank holds (units of a rank's activations for one microbatch)."""
    cal = {"per_mb": sum(costs_ms.values()) / 1e3, "opt": 0.0}
    rows, skipped = [], []
    for S in stage_list:
        for m in ms_for(S):
            for name in OURS:
                inflight = max(analytic.activations_in_flight(name, s, S, 1 if name == "pipedream" else m)
                               for s in range(S))
                rows.append({"stages": S, "m": m, "impl": "ours", "schedule": name, "placement": "stage",
                             "model_over_ideal": m * cal["per_mb"] / model_step_s("ours", name, S, m, cal, costs_ms),
                             "model_in_flight": inflight,
                             "weight_versions": analytic.weight_versions(name, 0, S)})
            for name in peers:
                why = torch_refusal(name, S, m)
                if why:
                    skipped.append(f"S={S} m={m}: {why}")
                    continue
                orders, stage_to_rank = torch_orders(name, S, m)
                chunks = 1 if PEERS[name] == "single" else BLOCKS_PER_RANK
                total = sum(costs_ms.values())
                c = {"F": costs_ms["fwd"] / chunks, "I": costs_ms["bwd_input"] / chunks,
                     "W": costs_ms["bwd_weight"] / chunks, "B": (costs_ms["bwd_input"] + costs_ms["bwd_weight"]) / chunks}
                res = analytic.simulate_actions(orders, stage_to_rank, c, chunks=chunks)
                rows.append({"stages": S, "m": m, "impl": "torch", "schedule": name, "placement": PEERS[name],
                             "model_over_ideal": m * total / res.makespan, "model_in_flight": max(res.peak_inflight),
                             "weight_versions": 1})
    return rows, skipped


def format_model_table(rows: list, skipped: list, costs_ms: dict) -> str:
    stage_list = sorted({r["stages"] for r in rows})
    labels = []
    for r in rows:
        if row_label(r) not in labels:
            labels.append(row_label(r))
    lines = [f"# analytic model: F {costs_ms['fwd']:g} / B {costs_ms['bwd_input']:g} / W {costs_ms['bwd_weight']:g} per rank, "
             "no optimizer step, no host work; fraction of the bubble-free ideal (steady state) / most microbatches' "
             "activations on one rank / weight copies"]
    cols = [(S, m) for S in stage_list for m in sorted({r["m"] for r in rows if r["stages"] == S})]
    lines.append(f"  {'schedule':<40}" + "".join(f"{f'S={S} m={m}':>17}" for S, m in cols))
    by = {(row_label(r), r["stages"], r["m"]): r for r in rows}
    for label in labels:
        cells = []
        for S, m in cols:
            r = by.get((label, S, m))
            cells.append(f"{'-':>17}" if r is None else
                         f"{r['model_over_ideal']:>7.3f} {r['model_in_flight']:>5.1f} {r['weight_versions']:>2d}x")
        lines.append(f"  {label:<40}" + "".join(cells))
    lines += [f"  skipped: {line}" for line in skipped]
    return "\n".join(lines)


def _machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


def row_label(r: dict) -> str:
    if r["impl"] == "ours":
        return f"ours  {r['schedule']}"
    tag = {"single": "", "loop": " (2 chunks, loop)", "v": " (2 chunks, V)"}[r["placement"]]
    return f"torch {r['schedule']}{tag}"


def _kib(b) -> str:
    return "-" if b is None else f"{b / 1024:.0f}"


def format_table(result: dict) -> str:
    c = result["costs_ms"]
    lines = [f"# per rank: 2 MLP blocks ({result['block']}, {result['micro_batch_rows']} rows per microbatch), "
             f"emulated F {c['fwd']:g} / B {c['bwd_input']:g} / W {c['bwd_weight']:g} ms per microbatch "
             f"(F: forward, B: input gradient, W: weight gradient); AdamW; {result['steps']} timed steps after "
             f"{result['warmup']}, best of {result['repeats']}",
             f"# {result['machine']}, torch {result['torch']}; 1-min load {result['loadavg_before_after'][0]:.1f} -> "
             f"{result['loadavg_before_after'][1]:.1f}; ours over socket, torch over gloo; {result['seconds']:.0f} s",
             "# steps/s: steady state; ach/ideal: measured vs bubble-free ideal (calibrated compute alone); "
             "model: analytic prediction of the same ratio; mem KiB: measured per rank (weights+grads+optimizer+"
             "activations), max and [per rank]; act: peak activations KiB, max rank; "
             f"loss gap muon/adamw: {DELAY_STUDY}"]
    for S, cal in result["calibration_ms"].items():
        lines.append(f"# S={S} calibration (ms, one rank alone, fastest of 30): fwd+bwd {cal['per_mb']:.2f} "
                     f"(fwd {cal['fwd']:.2f}, bwd {cal['bwd']:.2f}; split: input {cal['bwd_input']:.2f} + weight "
                     f"{cal['bwd_weight']:.2f}), AdamW step {cal['opt']:.2f}")
    head = (f"  {'runtime schedule':<40}{'steps/s':>8}{'ach/ideal':>10}{'model':>7}{'x1F1B':>7}"
            f"{'mem KiB':>9}{'act':>7}  {'loss gap':<12} per rank KiB")
    last = None
    for r in result["rows"]:
        if (r["stages"], r["m"]) != last:
            last = (r["stages"], r["m"])
            lines.append(f"## S={r['stages']} m={r['m']}")
            lines.append(head)
        totals = [mem["total"] for mem in r["memory"]]
        acts = [mem["activations"] or 0 for mem in r["memory"]]
        gap = r["loss_gap"]
        gap_s = "-" if gap is None else ("0" if not any(gap.values()) else f"{gap['muon']:.3f}/{gap['adamw']:.3f}")
        ratio = "-" if r.get("ratio_to_torch_1f1b") is None else f"{r['ratio_to_torch_1f1b']:.2f}"
        lines.append(f"  {row_label(r):<40}{r['steps_per_s']:>8.2f}{r['achieved_over_ideal']:>10.3f}"
                     f"{r['model_over_ideal']:>7.3f}{ratio:>7}{_kib(max(totals)):>9}{_kib(max(acts)):>7}  "
                     f"{gap_s:<12} [{' '.join(_kib(t) for t in totals)}]")
    for line in result["skipped"]:
        lines.append(f"  skipped: {line}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    """Achieved (markers) and modelled (lines) fraction of the ideal against m/S, one panel per S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage_list = sorted({r["stages"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(stage_list), figsize=(4.2 * len(stage_list) + 3.2, 4.2), sharey=True,
                             squeeze=False)
    names = []
    for r in result["rows"]:
        if row_label(r) not in names:
            names.append(row_label(r))
    cmap = plt.get_cmap("tab20")
    for ax, S in zip(axes[0], stage_list):
        for k, label in enumerate(names):
            rows = sorted((r for r in result["rows"] if r["stages"] == S and row_label(r) == label), key=lambda r: r["m"])
            if not rows:
                continue
            x = [r["m"] / S for r in rows]
            style = "-" if label.startswith("ours") else "--"
            ax.plot(x, [r["model_over_ideal"] for r in rows], style, color=cmap(k), alpha=0.5)
            ax.plot(x, [r["achieved_over_ideal"] for r in rows], "o" if label.startswith("ours") else "s",
                    color=cmap(k), label=label)
        ax.set_title(f"S = {S}")
        ax.set_xlabel("microbatches per step / S")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4], ["1", "2", "4"])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of the bubble-free ideal")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle("measured (markers) vs analytic model (lines: ours solid, torch dashed)")
    fig.tight_layout(rect=(0, 0, 1 - 3.0 / (4.2 * len(stage_list) + 3.2), 1))
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


# The settings' defaults, and --quick's (the smoke test's); a flag given on the command line wins over both.
DEFAULTS = dict(stages="2,4,8", fwd_ms=4.0, bwd_input_ms=4.0, bwd_weight_ms=4.0, steps=5, repeats=2)
QUICK = dict(stages="2", microbatches="2,4", fwd_ms=2.0, bwd_input_ms=2.0, bwd_weight_ms=2.0, steps=3, repeats=1)


def main(argv=None) -> int:
    p = ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--stages", help="comma-separated depths S (default 2,4,8)")
    p.add_argument("--microbatches", default=None,
                   help="comma-separated m for every S (default: S, 2S, 4S)")
    p.add_argument("--fwd-ms", type=float, help="emulated forward per rank and microbatch (default 4)")
    p.add_argument("--bwd-input-ms", type=float, help="emulated input-gradient part (default 4)")
    p.add_argument("--bwd-weight-ms", type=float,
                   help="emulated weight-gradient part (default 4; all three 0: the runtimes' own host work per step)")
    p.add_argument("--steps", type=int, help="timed steps per run (steady rate over the middle ones; default 5)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, help="round-robin repeats; each row keeps its fastest (default 2)")
    p.add_argument("--peers", default=",".join(PEERS), help="torch schedules to run (default: all)")
    p.add_argument("--quick", action="store_true", help="S=2, m=2,4, 2 ms costs, 3 steps, 1 repeat: the smoke "
                   "test (flags given as well override these)")
    p.add_argument("--model-only", action="store_true",
                   help="print the analytical model's table (fraction of the ideal, activations, weight copies) and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="PATH", help="write the achieved/model figure")
    a = p.parse_args(argv)
    for name, value in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    try:
        stage_list = [int(s) for s in a.stages.split(",")]
        ms = [int(s) for s in a.microbatches.split(",")] if a.microbatches else None
    except ValueError:
        p.error("--stages and --microbatches take comma-separated integers")
    peers = [s for s in a.peers.split(",") if s]
    unknown = [s for s in peers if s not in PEERS]
    if unknown:
        p.error(f"unknown torch schedule {unknown[0]!r}: choose from {', '.join(PEERS)}")
    if any(s < 2 for s in stage_list) or (ms and any(m < max(stage_list) for m in ms)):
        p.error("need S >= 2 and m >= S (2bw keeps at most two versions only with m >= S)")
    if a.steps < 3 or a.warmup < 1 or a.repeats < 1:
        p.error("--steps must be >= 3, --warmup and --repeats >= 1")
    costs = {"fwd": a.fwd_ms, "bwd_input": a.bwd_input_ms, "bwd_weight": a.bwd_weight_ms}
    if not all(0 <= v < math.inf for v in costs.values()) or (a.model_only and sum(costs.values()) <= 0):
        p.error(f"the emulated costs must be numbers >= 0 (and not all 0 for --model-only); got --fwd-ms "
                f"{a.fwd_ms:g} --bwd-input-ms {a.bwd_input_ms:g} --bwd-weight-ms {a.bwd_weight_ms:g}")
    if a.plot is not None:
        try:
            check_figure_path(a.plot, example="peer_schedules.png")
        except ValueError as exc:
            p.error(f"--plot {exc}")
    if a.model_only:
        rows, skipped = model_rows(stage_list, lambda S: ms or [S, 2 * S, 4 * S], costs, peers)
        print(json.dumps({"costs_ms": costs, "rows": rows, "skipped": skipped}, indent=2) if a.json
              else format_model_table(rows, skipped, costs))
        return 0
    result = measure(stage_list, [1, 2, 4], costs, a.steps, a.warmup, peers, ms, a.repeats)
    if a.plot:
        result["plot"] = plot(result, a.plot)
    print(json.dumps(result, indent=2) if a.json else format_table(result))
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
