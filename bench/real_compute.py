"""Throughput with real CPU compute: our gpipe/1f1b/2bw vs torch.distributed.pipelining.

Two processes (one per stage, one torch thread each, so the two stages get one core each) train
the preset GPT split in two, with the same microbatch size, microbatch count and optimizer (the
project's fused AdamW) in every run. Each run does ``--warmup`` steps, then ``--steps`` timed
steps between two barriers; our timed steps are ONE ``Pipeline.train`` call, i.e. one continuous
instruction stream with a single fill and drain. All runs share one pair of processes and run
round-robin ``--repeats`` times; each run's figure is its fastest repeat.

    python bench/real_compute.py [--model small|tiny] [--microbatches 4] [--micro-batch-size 16]
                                 [--steps 20] [--warmup 3] [--repeats 3] [--json]
    python bench/real_compute.py --ties [--vocab-size 8192] [same flags but --model]

Theory: a synchronous schedule (GPipe, 1F1B) of S stages idles (S-1)/(m+S-1) of each step (1/5 for
m=4, S=2); 2BW does not, so 2bw/1f1b -> (m+S-1)/m = 1.25 when compute dominates and the stages are
balanced. A K-step stream still fills and drains once: K(m+S-1)/(Km+S-1). The per-stage breakdown
comes from our runtime's trace (one (op, step, microbatch, version, start_ns, end_ns) per
instruction) and says where the time goes: compute, waiting for a peer, or neither (host overhead).
The cpu/wall column is the CPU each stage process actually got: a bubble only costs wall time when
the idle core would otherwise be ours; on a machine shared with other jobs the bubble is filled by
them, every schedule becomes CPU-bound and the ratio tends to 1 (check the load average line).

``--ties`` measures instead what tied input/output embeddings and gradient clipping by the previous
step's norm cost our 2bw (and 1f1b, for reference): a Llama of the ``small`` preset's shape with a
``--vocab-size`` vocabulary, untied, tied, and tied with ``clip_grad_norm=1.0``. The embedding
(stage 0) owns the tied matrix; the head (stage 1) sends its gradient at its optimizer step and
installs the new values before first using that version (step_exchange.py), and clipping
all-gathers per-parameter norms asynchronously. Waits inside those exchanges happen within the
traced forward and optimizer_step instructions, so they show up as compute time.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_command import ArgumentParser  # noqa: E402
from gpt_workload import (GPT, WorkloadVocabularyError, adamw_factory, build_gpt, build_llama,  # noqa: E402
                          llama_config, machine_description, minibatches, stage_module, tokens_per_step)
from asyncpp_ext.pipeline import Pipeline, init_distributed, spawn  # noqa: E402

STAGES = 2
COMPUTE_OPS = ("forward", "backward", "optimizer_step")
WAIT_OPS = ("recv_act", "recv_grad", "send_act", "send_grad")
RUNS = [("ours", "gpipe"), ("ours", "1f1b"), ("ours", "2bw"), ("torch", "gpipe"), ("torch", "1f1b")]
# --ties: variant -> (tie_embeddings, clip_grad_norm); every variant under 2bw, then under 1f1b.
TIE_VARIANTS = {"untied": (False, None), "tied": (True, None), "tied+clip": (True, 1.0)}
TIE_RUNS = [(variant, schedule) for schedule in ("2bw", "1f1b") for variant in TIE_VARIANTS]
DEFAULT_VOCAB_SIZE = 8192


def _write(out: str, payload: dict) -> None:
    with open(out, "w") as fh:
        json.dump(payload, fh)


def summarize_trace(trace: list, wall_ns: int, steps: int, microbatches: int) -> dict:
    """Where one stage's time went, from its trace events (op, step, mb, version, start, end)."""
    spent = {}
    for op, *_, start, end in trace:
        spent[op] = spent.get(op, 0) + (end - start)
    compute = sum(spent.get(op, 0) for op in COMPUTE_OPS)
    wait = sum(spent.get(op, 0) for op in WAIT_OPS)
    n_mb = steps * microbatches
    return {"wall_ms": wall_ns / 1e6,
            "forward_ms_per_mb": spent.get("forward", 0) / n_mb / 1e6,
            "backward_ms_per_mb": spent.get("backward", 0) / n_mb / 1e6,
            "optimizer_ms_per_step": spent.get("optimizer_step", 0) / steps / 1e6,
            "compute_frac": compute / wall_ns,
            "wait_frac": wait / wall_ns,
            "untraced_frac": 1 - (compute + wait) / wall_ns}


def _timed(body) -> tuple[int, float]:
    """Wall ns of ``body()`` between two barriers (every rank starts and ends together), and the
    CPU seconds this process (all its threads) used meanwhile."""
    dist.barrier()
    start_ns, start_cpu = time.monotonic_ns(), time.process_time()
    body()
    dist.barrier()
    return time.monotonic_ns() - start_ns, time.process_time() - start_cpu


def run_ours(schedule, model, m, micro_batch, steps, warmup) -> dict:
    pipe = Pipeline(build_gpt(model), loss_fn=GPT.loss, optimizer=adamw_factory(), schedule=schedule,
                    microbatches=m)
    return _time_pipeline(pipe, minibatches(model, m, micro_batch), m, steps, warmup)


def run_llama(variant, schedule, vocab_size, m, micro_batch, steps, warmup) -> dict:
    """One ``--ties`` run: the benchmark Llama in ``variant`` (a TIE_VARIANTS key) on our runtime."""
    tied, clip = TIE_VARIANTS[variant]
    model = build_llama(tied, vocab_size)
    pipe = Pipeline(model, loss_fn=model.loss, optimizer=adamw_factory(), schedule=schedule,
                    microbatches=m, clip_grad_norm=clip)
    return _time_pipeline(pipe, minibatches(model.config, m, micro_batch), m, steps, warmup)


def _time_pipeline(pipe, data, m, steps, warmup) -> dict:
    """``warmup`` untimed steps, then ``steps`` timed ones in one ``train`` call, summarised."""
    for _ in pipe.train(data, warmup):
        pass
    timed_from = len(pipe.trace)

    def body():
        for _ in pipe.train(data, steps):
            pass

    wall_ns, cpu_s = _timed(body)
    timed = pipe.trace[timed_from:]
    step_ends = sorted(e[5] for e in timed if e[0] == "optimizer_step")
    return {"seconds": wall_ns / 1e9, "cpu_share": cpu_s / (wall_ns / 1e9), "step_ends_ns": step_ends,
            "stage": summarize_trace(timed, wall_ns, steps, m)}


def run_torch(schedule, model, m, micro_batch, steps, warmup) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    module = stage_module(build_gpt(model), STAGES, rank)
    stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))  # shapes inferred at step 1
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=GPT.loss)  # grads scaled by 1/m, as ours
    opt = adamw_factory()(module)
    data = minibatches(model, m, micro_batch, concatenated=True)

    def one_step():
        x, y = next(data)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        one_step()
    step_ends = []

    def body():
        for _ in range(steps):
            one_step()
            step_ends.append(time.monotonic_ns())

    wall_ns, cpu_s = _timed(body)
    return {"seconds": wall_ns / 1e9, "cpu_share": cpu_s / (wall_ns / 1e9), "step_ends_ns": step_ends,
            "stage": None}


def _runner(impl):
    """The function timing one run of ``impl``: "ours", "torch", or a TIE_VARIANTS key."""
    if impl in TIE_VARIANTS:
        return partial(run_llama, impl)
    return run_ours if impl == "ours" else run_torch


def worker(runs, repeats, model, m, micro_batch, steps, warmup, out_prefix):
    """Every run in this one process group, ``repeats`` times round-robin, so a burst of outside
    load hits all runs alike. Each run builds its own model, pipeline and optimizer; the barriers
    around every timed section mean no message of one run is in flight when the next starts.
    ``model`` is the GPT preset name, or with tie variants in ``runs`` the vocabulary size."""
    torch.set_num_threads(1)
    rank, _ = init_distributed(300)
    results = []
    for repeat in range(repeats):
        for impl, schedule in runs:
            fn = _runner(impl)
            results.append({"impl": impl, "schedule": schedule, "repeat": repeat,
                             **fn(schedule, model, m, micro_batch, steps, warmup)})
    _write(f"{out_prefix}-stage{rank}.json", {"results": results})


def predicted_ratio_from_trace(stage_summaries: list[dict], m: int) -> float:
    """2bw/1f1b expected from the measured per-microbatch compute of each stage: a synchronous step
    costs about sum_s(t_s) + (m-1)*max_s(t_s) (fill, steady state at the slowest stage, drain), a
    2bw step m*max_s(t_s); both add the slowest optimizer step."""
    t = [s["forward_ms_per_mb"] + s["backward_ms_per_mb"] for s in stage_summaries]
    opt = max(s["optimizer_ms_per_step"] for s in stage_summaries)
    return (sum(t) + (m - 1) * max(t) + opt) / (m * max(t) + opt)


def _intervals(ends_ns: list) -> list:
    return [(b - a) / 1e6 for a, b in zip(ends_ns, ends_ns[1:])]


def _median_step_ms(repeats_seen: list) -> float:
    """Steady-state step time: per rank, the median interval between consecutive step ends over all
    repeats (robust to a burst of outside load); the slower rank sets the pace."""
    per_rank = zip(*(r["intervals"] for r in repeats_seen))
    return max(statistics.median([x for rep in rank_runs for x in rep]) for rank_runs in per_rank)


def _run_all(runs, repeats, model, m, micro_batch, steps, warmup) -> list[list[dict]]:
    """Spawn the two stage processes, run ``runs`` round-robin; each rank's results."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "run")
        spawn(worker, STAGES, (runs, repeats, model, m, micro_batch, steps, warmup, prefix))
        per_rank = []
        for s in range(STAGES):
            with open(f"{prefix}-stage{s}.json") as fh:
                per_rank.append(json.load(fh)["results"])
    return per_rank


def _rows(per_rank: list, runs: list, steps: int, tokens: int) -> list[dict]:
    """One row per run: its fastest repeat's throughput, the steady-state rate over all repeats,
    CPU shares, and (our runtime only) the fastest repeat's per-stage trace summary."""
    rows = []
    for impl, schedule in runs:
        # One repeat = the same run seen by every rank: slowest rank's wall time, each rank's trace.
        repeats_seen = []
        for i, first in enumerate(per_rank[0]):
            if (first["impl"], first["schedule"]) == (impl, schedule):
                views = [ranks[i] for ranks in per_rank]
                repeats_seen.append({"seconds": max(v["seconds"] for v in views),
                                     "stages": [v["stage"] for v in views],
                                     "cpu_share": [v["cpu_share"] for v in views],
                                     "intervals": [_intervals(v["step_ends_ns"]) for v in views]})
        best = min(repeats_seen, key=lambda r: r["seconds"])
        row = {"impl": impl, "schedule": schedule, "seconds": best["seconds"],
               "tokens_per_s": steps * tokens / best["seconds"],
               "tokens_per_s_all": [steps * tokens / r["seconds"] for r in repeats_seen],
               "median_step_ms": _median_step_ms(repeats_seen), "cpu_share": best["cpu_share"]}
        row["steady_tokens_per_s"] = tokens / (row["median_step_ms"] / 1e3)
        # Work per CPU second: equal across schedules unless one does extra work (or spins).
        row["tokens_per_cpu_s"] = row["tokens_per_s"] / sum(row["cpu_share"])
        if best["stages"][0] is not None:  # traced: our runtime
            row["stages"] = best["stages"]
        rows.append(row)
    return rows


def measure(model: str, m: int, micro_batch: int, steps: int, warmup: int, repeats: int) -> dict:
    """Each run's figure is its fastest repeat (outside load can only add time)."""
    tokens = tokens_per_step(model, m, micro_batch)
    load_before = os.getloadavg()
    rows = _rows(_run_all(RUNS, repeats, model, m, micro_batch, steps, warmup), RUNS, steps, tokens)
    by = {(r["impl"], r["schedule"]): r for r in rows}
    base, steady_base = by[("torch", "1f1b")]["tokens_per_s"], by[("torch", "1f1b")]["steady_tokens_per_s"]
    for r in rows:
        r["ratio_to_torch_1f1b"] = r["tokens_per_s"] / base
        r["steady_ratio_to_torch_1f1b"] = r["steady_tokens_per_s"] / steady_base
    ratio = by[("ours", "2bw")]["tokens_per_s"] / by[("ours", "1f1b")]["tokens_per_s"]
    steady_ratio = by[("ours", "2bw")]["steady_tokens_per_s"] / by[("ours", "1f1b")]["steady_tokens_per_s"]
    return {"model": model, "stages": STAGES, "microbatches": m, "micro_batch_size": micro_batch,
            "tokens_per_step": tokens, "steps": steps, "warmup": warmup, "repeats": repeats,
            "machine": machine_description(), "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
            "rows": rows, "ratio_2bw_over_1f1b": ratio, "steady_ratio_2bw_over_1f1b": steady_ratio,
            "theory_ratio": (m + STAGES - 1) / m,
            "theory_ratio_k_steps": steps * (m + STAGES - 1) / (steps * m + STAGES - 1),
            "trace_predicted_ratio": predicted_ratio_from_trace(by[("ours", "1f1b")]["stages"], m)}


def format_report(r: dict) -> str:
    lines = [f"# {r['model']} GPT, S={r['stages']} m={r['microbatches']} micro-batch {r['micro_batch_size']} "
             f"({r['tokens_per_step']} tokens/step), {r['steps']} timed steps after {r['warmup']}, "
             f"AdamW, gloo, 1 torch thread per stage; {r['machine']}",
             f"# best of {r['repeats']} round-robin repeats; 1-min load average before/after: "
             f"{r['loadavg_1min_before_after'][0]:.2f}/{r['loadavg_1min_before_after'][1]:.2f}",
             "# tokens/s: timed steps / wall time (one fill+drain included); steady: tokens per median "
             "step interval; cpu/wall: CPU seconds each stage's process got per wall second (1.0 = a "
             "whole core); tok/cpu-s: tokens/s over the two stages' summed cpu/wall",
             f"  {'runtime':<8}{'schedule':<10}{'tokens/s':>10}{'x torch1F1B':>13}{'steady tok/s':>14}"
             f"{'x torch1F1B':>13}{'cpu/wall':>11}{'tok/cpu-s':>11}   all repeats (tokens/s)"]
    for row in r["rows"]:
        lines.append(f"  {row['impl']:<8}{row['schedule']:<10}{row['tokens_per_s']:>10.0f}"
                     f"{row['ratio_to_torch_1f1b']:>13.3f}{row['steady_tokens_per_s']:>14.0f}"
                     f"{row['steady_ratio_to_torch_1f1b']:>13.3f}"
                     f"{'/'.join(f'{c:.2f}' for c in row['cpu_share']):>11}{row['tokens_per_cpu_s']:>11.0f}   "
                     + " ".join(f"{v:.0f}" for v in row["tokens_per_s_all"]))
    lines.append(f"  ours 2bw / ours 1f1b = {r['ratio_2bw_over_1f1b']:.3f} (steady {r['steady_ratio_2bw_over_1f1b']:.3f})"
                 f"   theory (m+S-1)/m = {r['theory_ratio']:.3f}; for one {r['steps']}-step stream "
                 f"{r['theory_ratio_k_steps']:.3f}; from the traced stage compute times {r['trace_predicted_ratio']:.3f}")
    lines.append("  where our stages' time goes (timed steps, per stage):")
    lines.append(f"    {'schedule':<9}{'stage':>5}{'fwd ms/mb':>11}{'bwd ms/mb':>11}{'opt ms/step':>13}"
                 f"{'compute':>9}{'waiting':>9}{'untraced':>10}")
    for row in r["rows"]:
        for s, st in enumerate(row.get("stages", [])):
            lines.append(f"    {row['schedule']:<9}{s:>5}{st['forward_ms_per_mb']:>11.1f}{st['backward_ms_per_mb']:>11.1f}"
                         f"{st['optimizer_ms_per_step']:>13.1f}{st['compute_frac']:>9.1%}{st['wait_frac']:>9.1%}"
                         f"{st['untraced_frac']:>10.1%}")
    return "\n".join(lines)


def measure_ties(vocab_size: int, m: int, micro_batch: int, steps: int, warmup: int, repeats: int) -> dict:
    """The TIE_RUNS rows (fastest repeat each), with each row's throughput relative to ``untied``
    under the same schedule. Raises WorkloadVocabularyError (before spawning) for a vocabulary
    smaller than the corpus's byte ids."""
    cfg = llama_config(True, vocab_size)
    params = {"untied": build_llama(False, vocab_size).num_parameters(),
              "tied": build_llama(True, vocab_size).num_parameters()}
    tied_matrix = vocab_size * cfg.n_embd
    tokens = tokens_per_step(cfg, m, micro_batch)
    load_before = os.getloadavg()
    rows = _rows(_run_all(TIE_RUNS, repeats, vocab_size, m, micro_batch, steps, warmup), TIE_RUNS, steps, tokens)
    by = {}
    for r in rows:
        r["variant"] = r.pop("impl")
        by[r["variant"], r["schedule"]] = r
    for r in rows:
        base = by["untied", r["schedule"]]
        r["ratio_to_untied"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["steady_ratio_to_untied"] = r["steady_tokens_per_s"] / base["steady_tokens_per_s"]
    ratio_2bw_over_1f1b = {v: by[v, "2bw"]["tokens_per_s"] / by[v, "1f1b"]["tokens_per_s"] for v in TIE_VARIANTS}
    shape = {k: v for k, v in cfg.to_dict().items() if k != "tie_embeddings"}
    return {"model": "llama", "config": shape, "parameters": params, "tied_matrix_numel": tied_matrix,
            "tied_matrix_share": {k: tied_matrix / n for k, n in params.items()},
            "stages": STAGES, "microbatches": m, "micro_batch_size": micro_batch, "tokens_per_step": tokens,
            "steps": steps, "warmup": warmup, "repeats": repeats, "machine": machine_description(),
            "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]], "rows": rows,
            "ratio_2bw_over_1f1b": ratio_2bw_over_1f1b}


def format_ties_report(r: dict) -> str:
    """The ``--ties`` table: one line per (variant, schedule), then where each stage's time went."""
    c, p, share = r["config"], r["parameters"], r["tied_matrix_share"]
    lines = [f"# Llama {c['n_layer']} layers, width {c['n_embd']}, {c['n_head']}/{c['n_kv_head']} q/kv heads, "
             f"SwiGLU {c['intermediate_size']}, context {c['seq_len']}, vocabulary {c['vocab_size']}: "
             f"{p['untied']:,} parameters untied, {p['tied']:,} tied; the tied {c['vocab_size']}x{c['n_embd']} "
             f"matrix is {share['tied']:.1%} of the tied model ({share['untied']:.1%} of the untied)",
             f"# S={r['stages']} m={r['microbatches']} micro-batch {r['micro_batch_size']} "
             f"({r['tokens_per_step']} tokens/step), {r['steps']} timed steps after {r['warmup']}, AdamW, gloo, "
             f"1 torch thread per stage; {r['machine']}",
             f"# best of {r['repeats']} round-robin repeats; 1-min load average before/after: "
             f"{r['loadavg_1min_before_after'][0]:.2f}/{r['loadavg_1min_before_after'][1]:.2f}",
             "# tied: one matrix less to optimize (stage 1's head copy is updated by stage 0), so compare "
             "tokens/s, not per-parameter rates; tied+clip: clip_grad_norm=1.0 by the previous step's norm",
             f"  {'variant':<11}{'schedule':<10}{'tokens/s':>10}{'x untied':>10}{'steady tok/s':>14}"
             f"{'x untied':>10}{'cpu/wall':>11}   all repeats (tokens/s)"]
    for row in r["rows"]:
        lines.append(f"  {row['variant']:<11}{row['schedule']:<10}{row['tokens_per_s']:>10.0f}"
                     f"{row['ratio_to_untied']:>10.3f}{row['steady_tokens_per_s']:>14.0f}"
                     f"{row['steady_ratio_to_untied']:>10.3f}"
                     f"{'/'.join(f'{x:.2f}' for x in row['cpu_share']):>11}   "
                     + " ".join(f"{v:.0f}" for v in row["tokens_per_s_all"]))
    lines.append("  2bw / 1f1b: " + ", ".join(f"{v} {x:.3f}" for v, x in r["ratio_2bw_over_1f1b"].items()))
    lines.append("  where the stages' time goes (timed steps, per stage; exchange waits count as compute):")
    lines.append(f"    {'variant':<11}{'schedule':<9}{'stage':>5}{'fwd ms/mb':>11}{'bwd ms/mb':>11}"
                 f"{'opt ms/step':>13}{'compute':>9}{'waiting':>9}{'untraced':>10}")
    for row in r["rows"]:
        for s, st in enumerate(row["stages"]):
            lines.append(f"    {row['variant']:<11}{row['schedule']:<9}{s:>5}{st['forward_ms_per_mb']:>11.1f}"
                         f"{st['backward_ms_per_mb']:>11.1f}{st['optimizer_ms_per_step']:>13.1f}"
                         f"{st['compute_frac']:>9.1%}{st['wait_frac']:>9.1%}{st['untraced_frac']:>10.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, choices=("tiny", "small"), help="GPT preset (default small)")
    p.add_argument("--ties", action="store_true",
                   help="measure untied / tied / tied+clip Llama rows under 2bw and 1f1b instead")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"with --ties: the Llama's vocabulary (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed steps (>= 10 for a stable figure)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="round-robin repeats; the fastest is kept")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    p.require_positive(a, ("microbatches", "micro_batch_size", "steps", "warmup", "repeats"))
    if a.microbatches < STAGES:
        p.error(f"--microbatches must be >= {STAGES} (2bw needs at least one microbatch per stage)")
    if a.ties and a.model is not None:
        p.error("--model does not apply with --ties (the Llama's shape is fixed); drop it or drop --ties")
    if not a.ties and a.vocab_size is not None:
        p.error("--vocab-size only applies with --ties; add --ties or drop --vocab-size")
    if a.vocab_size is not None and a.vocab_size < 1:
        p.error(f"--vocab-size must be >= 1, got {a.vocab_size}")
    if a.ties:
        try:
            result = measure_ties(a.vocab_size or DEFAULT_VOCAB_SIZE, a.microbatches, a.micro_batch_size,
                                  a.steps, a.warmup, a.repeats)
        except WorkloadVocabularyError as e:
            p.error(str(e))
        print(json.dumps(result, indent=2) if a.json else format_ties_report(result))
        return 0
    result = measure(a.model or "small", a.microbatches, a.micro_batch_size, a.steps, a.warmup, a.repeats)
    print(json.dumps(result, indent=2) if a.json else format_report(result))
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
