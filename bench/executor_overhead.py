"""Host overhead of the pipeline runtime per microbatch per stage: ours vs torch.distributed.pipelining.

Every stage is one ``nn.Linear(16, 16)`` on micro-batches of 2 rows (mse loss, SGD), so its compute
is tiny (the fwd+bwd itself, measured alone and printed, is mostly torch's per-op dispatch) and what
a microbatch costs is the runtime's own host work: scheduling, posting and completing messages,
the Python callbacks around the layer. Each run is one ``spawn``
of S ranks (gloo on 127.0.0.1, one torch thread per rank): ``--warmup`` untimed steps, then
``--steps`` timed steps in one ``train`` call (torch: one ``step()`` per step). Our runs cover
every schedule in ``--schedules`` and every transport in ``--transports`` (default: every name in
``asyncpp_ext.pipeline.devices.TRANSPORTS`` but "auto" and "nccl"); torch's cover its gpipe and
1f1b. pipedream takes one microbatch per optimizer step: it runs steps*m steps of one microbatch.
``--repeats N`` goes over all runs N times, round-robin, and keeps each run's fastest repeat: on a
shared machine other jobs only ever add time, and a single repeat can be off by 2-3x.
A run that fails (a rank errs or stalls for 60 s) shows as FAILED with the launcher's reason;
the other runs still go ahead, and the exit status is then 1.

    python bench/executor_overhead.py [--stages 2 --microbatches 8 --steps 50 --warmup 3]
        [--schedules gpipe,1f1b,2bw,pipedream] [--transports gloo,torch] [--no-torch] [--repeats 1] [--json]

Columns (all in microseconds per microbatch per stage; breakdowns are means over the stages):

- us/mb: wall time of the timed steps / (steps * m), the slowest stage's (the headline: with
  ~zero compute it is the host time one microbatch costs a stage).
- fwd, bwd, step: time inside our ``forward``, ``backward`` and ``optimizer_step`` callbacks
  (the optimizer step's time spread over the step's microbatches).
- send: the ``send_act``/``send_grad`` instructions: posting the send, plus waiting for the
  oldest one when more than 8 are in flight (the peer has not posted their receives yet).
- recv-wait: waiting for receives (``recv_act``, ``recv_grad``), i.e. for the peer stage.
- loop: wall minus every traced instruction: the executor between instructions (posting
  receives, testing sends, recording the trace) and the ``train`` call around it.
- cb-host: fwd + bwd minus the stage's own forward+backward measured alone in one process
  (median of 200): the Python host cost inside the callbacks.
- ratio: our us/mb / torch's for the same schedule (2bw and pipedream: torch's 1f1b). Goal <= 0.25.
- rt-us, rt-ratio: us/mb minus the slowest stage's compute alone and its optimizer steps (the
  optimizer's step measured alone, once per microbatch for pipedream, 1/m of it otherwise), for
  ours and torch's runs: what the runtime costs beyond the work both runtimes pay; and our rt-us
  over torch's. The header says what share of torch's us/mb the compute alone is: no runtime can
  bring the ratio below it.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_command import ArgumentParser  # noqa: E402
from gpt_workload import cpu_model  # noqa: E402
from schedule_efficiency import MICRO_BATCH, WIDTH, _batches, _sgd, torch_stepper  # noqa: E402
from asyncpp_ext.pipeline import LaunchError, Pipeline, init_distributed, spawn  # noqa: E402
from asyncpp_ext.pipeline.devices import TRANSPORTS  # noqa: E402
from asyncpp_ext.pipeline.sockets import RECV_SPIN_ENV, recv_spin_of_local_launch  # noqa: E402

OURS_SCHEDULES = ("gpipe", "1f1b", "2bw", "pipedream")
TORCH_SCHEDULES = ("gpipe", "1f1b")
DEFAULT_TRANSPORTS = tuple(t for t in TRANSPORTS if t not in ("auto", "nccl"))
"""Every CPU transport of our runtime ("auto" is one of them again; "nccl" needs CUDA)."""
GOAL_RATIO = 0.25
RUN_TIMEOUT_S = 60
"""A stalled run fails after this long (every run here takes seconds), not the default 300 s."""
COMPUTE_REPEATS = 200
SEND_OPS = ("send_act", "send_grad")
RECV_OPS = ("recv_act", "recv_grad")
BREAKDOWN = ("forward_us", "backward_us", "optimizer_step_us", "send_us", "recv_wait_us", "executor_loop_us")
"""Per-microbatch parts of one stage's wall time; they add up to it."""


class OverheadBenchError(ValueError):
    """A benchmark setting that cannot run (unknown schedule or transport, too few microbatches)."""


def torch_baseline(schedule: str) -> str:
    """torch's schedule an our-runtime schedule is compared with: itself if torch has it, else 1f1b."""
    return schedule if schedule in TORCH_SCHEDULES else "1f1b"


def _write_rank_result(out_prefix: str, payload: dict) -> None:
    with open(f"{out_prefix}-{dist.get_rank()}.json", "w") as fh:
        json.dump(payload, fh)


def run_ours(schedule: str, transport: str, stages: int, m: int, steps: int, warmup: int, out_prefix: str) -> None:
    """One rank of an our-runtime run: writes its timed wall ns and traced ns per op."""
    torch.set_num_threads(1)
    init_distributed(120)
    microbatches_timed = steps * m
    if schedule == "pipedream":  # the same microbatches, one optimizer step each
        m, steps, warmup = 1, steps * m, warmup * m
    torch.manual_seed(0)  # every rank builds the same model
    blocks = [nn.Linear(WIDTH, WIDTH) for _ in range(stages)]
    pipe = Pipeline(blocks, loss_fn=nn.functional.mse_loss, optimizer=_sgd, schedule=schedule,
                    microbatches=m, transport=transport, timeout_s=RUN_TIMEOUT_S)
    data = _batches(m)
    for _ in pipe.train(data, warmup):
        pass
    pipe.trace.clear()
    dist.barrier()
    start = time.monotonic_ns()
    for _ in pipe.train(data, steps):
        pass
    wall_ns = time.monotonic_ns() - start
    dist.barrier()
    spent: dict[str, int] = {}
    for op, _step, _mb, _version, begin, end in pipe.trace:
        spent[op] = spent.get(op, 0) + (end - begin)
    forwards = sum(1 for event in pipe.trace if event[0] == "forward")
    if forwards != microbatches_timed:  # a truncated trace would understate every part
        raise RuntimeError(f"stage {pipe.stage}: traced {forwards} forwards, expected {microbatches_timed}")
    _write_rank_result(out_prefix, {"stage": pipe.stage, "wall_ns": wall_ns, "spent_ns": spent})


def run_torch(schedule: str, stages: int, m: int, steps: int, warmup: int, out_prefix: str) -> None:
    """One rank of a torch.distributed.pipelining run: writes its timed wall ns."""
    torch.set_num_threads(1)
    rank, _ = init_distributed(120)
    torch.manual_seed(0)
    one_step = torch_stepper(nn.Linear(WIDTH, WIDTH), schedule, stages, m, rank)

    for _ in range(warmup):
        one_step()
    dist.barrier()
    start = time.monotonic_ns()
    for _ in range(steps):
        one_step()
    wall_ns = time.monotonic_ns() - start
    dist.barrier()
    _write_rank_result(out_prefix, {"stage": rank, "wall_ns": wall_ns})


def stage_compute_us(stage: int, stages: int, repeats: int = COMPUTE_REPEATS) -> float:
    """Median µs of stage ``stage``'s own forward+backward on one microbatch, alone in this process
    with one thread: the first stage's input needs no gradient, the last stage adds the loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(WIDTH, WIDTH)
        x = torch.randn(MICRO_BATCH, WIDTH, requires_grad=stage > 0)
        target = torch.randn(MICRO_BATCH, WIDTH)
        grad_out = torch.randn(MICRO_BATCH, WIDTH)
        last = stage == stages - 1
        samples = []
        for i in range(repeats + 20):  # the first 20 warm the allocator and autograd up
            begin = time.perf_counter_ns()
            y = layer(x)
            if last:
                nn.functional.mse_loss(y, target).backward()
            else:
                y.backward(grad_out)
            if i >= 20:
                samples.append(time.perf_counter_ns() - begin)
        return statistics.median(samples) / 1e3
    finally:
        torch.set_num_threads(threads)


def optimizer_step_alone_us(repeats: int = COMPUTE_REPEATS) -> float:
    """Median µs of one step of the benchmark's optimizer (``_sgd`` on one stage's layer, gradients
    set), alone in this process with one thread: the optimizer's own host cost, which a pipeline
    pays once per step -- per microbatch for pipedream."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(WIDTH, WIDTH)
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        optimizer = _sgd(layer)
        samples = []
        for i in range(repeats + 20):
            begin = time.perf_counter_ns()
            optimizer.step()
            if i >= 20:
                samples.append(time.perf_counter_ns() - begin)
        return statistics.median(samples) / 1e3
    finally:
        torch.set_num_threads(threads)


def steps_per_microbatch(schedule: str, m: int) -> float:
    """Optimizer steps a schedule takes per microbatch: one per microbatch for pipedream."""
    return 1.0 if schedule == "pipedream" else 1.0 / m


def _read_ranks(out_prefix: str, stages: int) -> list[dict]:
    results = []
    for rank in range(stages):
        with open(f"{out_prefix}-{rank}.json") as fh:
            results.append(json.load(fh))
    return sorted(results, key=lambda r: r["stage"])


def summarize_ours(ranks: list[dict], microbatches_timed: int, compute_us: list[float]) -> dict:
    """A row's figures from each stage's wall and traced ns: the slowest stage's wall, and each
    part of the breakdown averaged over the stages."""
    per_stage = []
    for rank, compute in zip(ranks, compute_us):
        spent, n = rank["spent_ns"], microbatches_timed
        part = {"stage": rank["stage"], "wall_us": rank["wall_ns"] / n / 1e3,
                "forward_us": spent.get("forward", 0) / n / 1e3,
                "backward_us": spent.get("backward", 0) / n / 1e3,
                "optimizer_step_us": spent.get("optimizer_step", 0) / n / 1e3,
                "send_us": sum(spent.get(op, 0) for op in SEND_OPS) / n / 1e3,
                "recv_wait_us": sum(spent.get(op, 0) for op in RECV_OPS) / n / 1e3,
                "compute_us": compute}
        part["executor_loop_us"] = (rank["wall_ns"] - sum(spent.values())) / n / 1e3
        part["callback_host_us"] = part["forward_us"] + part["backward_us"] - compute
        per_stage.append(part)
    row = {"us_per_microbatch": max(p["wall_us"] for p in per_stage)}
    for key in BREAKDOWN + ("compute_us", "callback_host_us"):
        row[key] = statistics.fmean(p[key] for p in per_stage)
    row["stages"] = per_stage
    return row


def _check_settings(stages: int, m: int, steps: int, warmup: int, schedules, transports) -> None:
    if stages < 2:
        raise OverheadBenchError(f"--stages must be >= 2 (got {stages}): a pipeline needs two stages")
    if steps < 1 or warmup < 1 or m < 1:
        raise OverheadBenchError(f"--steps, --warmup and --microbatches must be >= 1 (got {steps}, {warmup}, {m})")
    for flag, names, known in (("--schedules", schedules, OURS_SCHEDULES), ("--transports", transports,
                                                                            DEFAULT_TRANSPORTS)):
        if not names:
            raise OverheadBenchError(f"{flag} is empty; name one or more of {','.join(known)}")
    for s in schedules:
        if s not in OURS_SCHEDULES:
            raise OverheadBenchError(f"unknown schedule {s!r} in --schedules; choose from {','.join(OURS_SCHEDULES)}")
    for t in transports:
        if t not in DEFAULT_TRANSPORTS:
            raise OverheadBenchError(f"transport {t!r} in --transports cannot run on CPU here; choose from "
                                     f"{','.join(DEFAULT_TRANSPORTS)}")
    if "2bw" in schedules and m < stages:
        raise OverheadBenchError(f"2bw needs --microbatches >= --stages ({m} < {stages}); raise --microbatches")


def _one_run(runtime: str, schedule: str, transport: str, stages: int, m: int, steps: int, warmup: int,
             compute_us: list[float], tmp: str) -> dict:
    """Spawn one run and summarise it as a row (ratio not yet filled in)."""
    prefix = os.path.join(tmp, f"{runtime}-{schedule}-{transport}")
    row = {"runtime": runtime, "schedule": schedule, "transport": transport}
    if runtime == "ours":
        spawn(run_ours, stages, (schedule, transport, stages, m, steps, warmup, prefix))
        row.update(summarize_ours(_read_ranks(prefix, stages), steps * m, compute_us))
        return row
    spawn(run_torch, stages, (schedule, stages, m, steps, warmup, prefix))
    walls = [r["wall_ns"] / (steps * m) / 1e3 for r in _read_ranks(prefix, stages)]
    row["us_per_microbatch"] = max(walls)
    row.update({key: None for key in BREAKDOWN + ("compute_us", "callback_host_us")})
    row["stages"] = [{"stage": s, "wall_us": w} for s, w in enumerate(walls)]
    return row


def _one_run_or_failure(run: tuple, *args) -> dict:
    """``_one_run``, or a row holding the launcher's one-line reason when a rank failed: a run that
    fails (e.g. a transport that stalls) is reported and the other runs still go ahead."""
    try:
        return _one_run(*run, *args)
    except LaunchError as e:
        row = dict(zip(("runtime", "schedule", "transport"), run), us_per_microbatch=None, error=str(e))
        row.update({key: None for key in BREAKDOWN + ("compute_us", "callback_host_us")})
        return row


def _faster(row: dict, other: dict) -> bool:
    if row["us_per_microbatch"] is None:
        return False
    return other["us_per_microbatch"] is None or row["us_per_microbatch"] < other["us_per_microbatch"]


def measure(stages: int = 2, m: int = 8, steps: int = 50, warmup: int = 3, schedules=OURS_SCHEDULES,
            transports=DEFAULT_TRANSPORTS, with_torch: bool = True, repeats: int = 1) -> list[dict]:
    """Every run's row, ours (schedule x transport) first, then torch's: the torch schedules asked
    for in ``schedules`` plus those our rows are compared with. With ``repeats`` > 1 all runs go
    round-robin that many times and each row is its run's fastest repeat (a shared machine's
    load only ever adds time). Raises OverheadBenchError."""
    _check_settings(stages, m, steps, warmup, schedules, transports)
    if repeats < 1:
        raise OverheadBenchError(f"--repeats must be >= 1 (got {repeats})")
    compute_us = [stage_compute_us(s, stages) for s in range(stages)]
    step_us = optimizer_step_alone_us()
    runs = [("ours", s, t) for s in schedules for t in transports]
    runs += [("torch", s, "gloo") for s in TORCH_SCHEDULES
             if with_torch and any(s in (x, torch_baseline(x)) for x in schedules)]
    best: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for run in runs:
                row = _one_run_or_failure(run, stages, m, steps, warmup, compute_us, tmp)
                figures = best.get(run, {}).get("us_per_microbatch_repeats", []) + [row["us_per_microbatch"]]
                if run not in best or _faster(row, best[run]):
                    best[run] = row
                best[run]["us_per_microbatch_repeats"] = figures
    rows = [best[run] for run in runs]
    for r in rows:  # beyond the work any runtime does: the slowest stage's fwd+bwd and its optimizer steps
        r["optimizer_step_alone_us"] = step_us
        floor = max(compute_us) + step_us * steps_per_microbatch(r["schedule"], m)
        r["runtime_us"] = r["us_per_microbatch"] - floor if r["us_per_microbatch"] is not None else None
    torch_rows = {r["schedule"]: r for r in rows if r["runtime"] == "torch" and r["us_per_microbatch"] is not None}
    for r in rows:
        baseline = torch_baseline(r["schedule"])
        theirs = torch_rows.get(baseline) if r["us_per_microbatch"] is not None else None
        r["ratio_baseline"] = f"torch {baseline}" if theirs else None
        r["ratio_to_torch"] = r["us_per_microbatch"] / theirs["us_per_microbatch"] if theirs else None
        r["runtime_ratio_to_torch"] = r["runtime_us"] / theirs["runtime_us"] if theirs else None
    return rows


def cpu_name() -> str:
    """This machine's processor, as platform reports it or else /proc/cpuinfo's model name."""
    return platform.processor() or cpu_model()


def _cell(value, width: int, fmt: str = ".1f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


def format_table(result: dict) -> str:
    """The result as an nccl-tests-style table: ``#`` header lines, one row per run."""
    rows = result["rows"]
    ours = [r for r in rows if r["runtime"] == "ours" and r["us_per_microbatch"] is not None]
    lines = [f"# S={result['stages']} m={result['microbatches']} steps={result['steps']} "
             f"warmup={result['warmup']} repeats={result.get('repeats', 1)} (fastest kept); "
             f"Linear({WIDTH},{WIDTH}) x {MICRO_BATCH} rows per stage, gloo on 127.0.0.1, 1 torch thread per rank",
             f"# cpu: {result['cpu']}, {os.cpu_count()} cores; torch {result['torch']}; socket transport's receive "
             f"spin {result['recv_spin_us']} us ({RECV_SPIN_ENV}={result['recv_spin_setting']})",
             f"# goal: ratio (ours us/mb / torch us/mb) <= {GOAL_RATIO}; all times in us per microbatch per stage"]
    if ours:
        compute = ", ".join(f"stage {p['stage']} {p['compute_us']:.1f}" for p in ours[0]["stages"])
        lines.append(f"# compute alone (fwd+bwd, median of {COMPUTE_REPEATS}): {compute}")
        slowest = max(p["compute_us"] for p in ours[0]["stages"])
        floors = ", ".join(f"torch {r['schedule']} {slowest / r['us_per_microbatch']:.2f}" for r in rows
                           if r["runtime"] == "torch" and r["us_per_microbatch"] is not None)
        if floors:
            lines.append(f"# compute alone / torch us/mb (the lowest ratio any runtime could reach here): {floors}")
        lines.append(f"# optimizer step alone (torch SGD, median of {COMPUTE_REPEATS}): "
                     f"{ours[0]['optimizer_step_alone_us']:.1f} us, paid once per step: per microbatch 1/m of it, "
                     "pipedream all of it (rt-us subtracts compute and steps)")
    lines.append(f"# {'runtime':<8}{'schedule':<10}{'transport':<10}{'us/mb':>8}{'fwd':>7}{'bwd':>7}{'step':>7}"
                 f"{'send':>7}{'recv-wait':>10}{'loop':>7}{'cb-host':>8}{'ratio':>7}{'rt-us':>8}{'rt-ratio':>9}")
    for r in rows:
        if r["us_per_microbatch"] is None:
            lines.append(f"  {r['runtime']:<8}{r['schedule']:<10}{r['transport']:<10}  FAILED: {r['error']}")
            continue
        lines.append(f"  {r['runtime']:<8}{r['schedule']:<10}{r['transport']:<10}{r['us_per_microbatch']:>8.1f}"
                     f"{_cell(r['forward_us'], 7)}{_cell(r['backward_us'], 7)}{_cell(r['optimizer_step_us'], 7)}"
                     f"{_cell(r['send_us'], 7)}{_cell(r['recv_wait_us'], 10)}{_cell(r['executor_loop_us'], 7)}"
                     f"{_cell(r['callback_host_us'], 8)}{_cell(r['ratio_to_torch'], 7, '.2f')}"
                     f"{_cell(r['runtime_us'], 8)}{_cell(r['runtime_ratio_to_torch'], 9, '.2f')}")
    if ours:  # where our time goes, over every run of ours
        total = sum(sum(r[k] for k in BREAKDOWN) for r in ours)
        shares = ", ".join(f"{k.removesuffix('_us')} {sum(r[k] for r in ours) / total:.0%}" for k in BREAKDOWN)
        lines.append(f"# ours, share of stage time: {shares}")
    return "\n".join(lines)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def main(argv=None) -> int:
    """Command-line entry: measure, then print the table (or ``--json``)."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=50, help="timed steps (pipedream: steps*m of one microbatch)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--schedules", default=",".join(OURS_SCHEDULES), help="our schedules, comma-separated")
    p.add_argument("--transports", default=",".join(DEFAULT_TRANSPORTS), help="our transports, comma-separated")
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining's runs")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all runs; each row keeps its fastest")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    try:
        rows = measure(a.stages, a.microbatches, a.steps, a.warmup, _names(a.schedules), _names(a.transports),
                       with_torch=not a.no_torch, repeats=a.repeats)
    except OverheadBenchError as e:
        p.error(str(e))
    spin_us, spin_setting = recv_spin_of_local_launch(a.stages)
    result = {"stages": a.stages, "microbatches": a.microbatches, "steps": a.steps, "warmup": a.warmup,
              "repeats": a.repeats, "cpu": cpu_name(), "torch": torch.__version__, "goal_ratio": GOAL_RATIO,
              "recv_spin_us": spin_us, "recv_spin_setting": spin_setting, "rows": rows}
    print(json.dumps(result, indent=2) if a.json else format_table(result))
    return 1 if any(r["us_per_microbatch"] is None for r in rows) else 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
