"""Schedule efficiency with emulated compute: our gpipe/1f1b/2bw/pipedream vs torch.distributed.pipelining.

Each stage's compute is a fixed-time wait (forward f, backward 2f), as a GPU kernel would look
to the host, so the table measures schedules and runtime overheads, not this CPU. All runs use
127.0.0.1 (ours: the default CPU transport, socket; torch: gloo) with the same stage costs,
stages, microbatches and steps.

    python bench/schedule_efficiency.py [--stages 4 --microbatches 8 --steps 50 --fwd-ms 20] [--json]

Columns: steps/s; achieved / ideal, where ideal is a bubble-free pipeline (every stage busy all
the time: one step = m*(f+2f)) with the nominal f; achieved / calibrated ideal, the same with the
forward and backward times the slowest emulated stage really takes in one process (the waits end
at a deadline, so this stays within ~0.1 ms of f and 2f: the calibration shows what remains; the
last stage's times include the loss it computes);
achieved / own ideal, where a synchronous schedule's own ideal
includes its unavoidable bubble ((m+S-1)*(f+2f) per step); ratio to torch's Schedule1F1B.
pipedream takes one microbatch per optimizer step: it runs steps*m steps of one microbatch (the
same microbatches as the others' steps of m), and its figures count m of its steps as one.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncpp_ext.pipeline import Pipeline, init_distributed, spawn  # noqa: E402
from asyncpp_ext.pipeline.sockets import RECV_SPIN_ENV, recv_spin_of_local_launch  # noqa: E402
from bench_command import ArgumentParser  # noqa: E402

WIDTH, MICRO_BATCH = 16, 2


def wait_until(deadline: float) -> None:
    """Sleep to just before ``deadline`` (perf_counter seconds), then spin the last stretch: a
    plain sleep overshoots by ~0.1 ms and would make every emulated kernel longer than asked."""
    remaining = deadline - time.perf_counter()
    if remaining > 5e-4:
        time.sleep(remaining - 5e-4)
    while time.perf_counter() < deadline:
        pass


class _KernelEnd(torch.autograd.Function):
    """At the stage output: the forward waits until its deadline; the backward (the first node of
    the stage's backward) notes when the backward began."""

    @staticmethod
    def forward(ctx, y, deadline, clock):
        ctx.clock = clock
        out = y.clone()
        wait_until(deadline)
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.clock["backward_start"] = time.perf_counter()
        return grad, None, None


class _KernelTail(torch.autograd.Function):
    """On the weight path (always part of the backward, even when the stage input needs no
    gradient), run last: waits until the backward has lasted bwd_s."""

    @staticmethod
    def forward(ctx, w, clock, bwd_s):
        ctx.clock, ctx.bwd_s = clock, bwd_s
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        wait_until(ctx.clock["backward_start"] + ctx.bwd_s)
        return grad, None, None


class EmulatedStage(nn.Module):
    """A tiny linear layer inside a fixed-time "kernel": the stage forward takes fwd_s in total
    (the layer's own time included) and its backward bwd_s, as a GPU kernel looks to the host."""

    def __init__(self, fwd_s: float, bwd_s: float):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        deadline, clock = time.perf_counter() + self.fwd_s, {}
        weight = _KernelTail.apply(self.linear.weight, clock, self.bwd_s)
        y = nn.functional.linear(x, weight, self.linear.bias)
        return _KernelEnd.apply(y, deadline, clock)


def _batches(m: int):
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(m * MICRO_BATCH, WIDTH, generator=g), torch.randn(m * MICRO_BATCH, WIDTH, generator=g)


def _sgd(module):
    return torch.optim.SGD(module.parameters(), lr=1e-3)


def ours(schedule, stages, m, steps, warmup, f, out):
    init_distributed(120)
    if schedule == "pipedream":  # the same microbatches, one optimizer step each
        m, steps, warmup = 1, steps * m, warmup * m
    blocks = [EmulatedStage(f, 2 * f) for _ in range(stages)]
    pipe = Pipeline(blocks, loss_fn=nn.functional.mse_loss, optimizer=_sgd, schedule=schedule,
                    microbatches=m)
    data = _batches(m)
    for _ in pipe.train(data, warmup):
        pass
    dist.barrier()
    start = time.monotonic()
    for _ in pipe.train(data, steps):
        pass
    dist.barrier()
    if pipe.stage == 0:
        with open(out, "w") as fh:
            json.dump({"seconds": time.monotonic() - start}, fh)


def torch_stepper(module: nn.Module, schedule: str, stages: int, m: int, rank: int):
    """One training step of torch.distributed.pipelining's ``schedule`` on this rank's ``module``
    (mse loss, SGD, the same batches as ours), as a callable."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(module, rank, stages, torch.device("cpu"))  # shapes inferred at step 1
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
    opt = _sgd(module)
    data = _batches(m)

    def one_step():
        x, y = next(data)
        if rank == 0:
            sched.step(x)
        elif rank == stages - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad()

    return one_step


def theirs(schedule, stages, m, steps, warmup, f, out):
    rank, _ = init_distributed(120)
    torch.manual_seed(0)
    one_step = torch_stepper(EmulatedStage(f, 2 * f), schedule, stages, m, rank)

    for _ in range(warmup):
        one_step()
    dist.barrier()
    start = time.monotonic()
    for _ in range(steps):
        one_step()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"seconds": time.monotonic() - start}, fh)


RUNS = [("ours", "gpipe"), ("ours", "1f1b"), ("ours", "2bw"), ("ours", "pipedream"), ("torch", "gpipe"),
        ("torch", "1f1b")]


def calibrate(f: float, m: int, repeats: int = 30) -> dict[str, tuple[float, float]]:
    """Median seconds one emulated stage really spends per microbatch forward and backward in this
    process (the wait overshoots and the tiny layer/autograd cost something): the compute a
    bubble-free pipeline of these very stages would do back to back. Two kinds, measured in
    alternation: "inner" (any stage but the last) and "last", whose forward also computes the
    loss and whose backward starts from it with the gradient 1/m, as the last stage of either
    runtime does (the first torch call after an emulated kernel's wait costs ~0.2 ms on some VMs,
    so the loss is not free)."""
    torch.set_num_threads(1)
    stage = EmulatedStage(f, 2 * f)
    x = torch.randn(MICRO_BATCH, WIDTH, requires_grad=True)
    target = torch.randn(MICRO_BATCH, WIDTH)
    loss_grad = torch.tensor(1.0 / m)
    times = {"inner": ([], []), "last": ([], [])}
    for _ in range(repeats):
        for kind, (fwd, bwd) in times.items():
            t0 = time.perf_counter()
            out = stage(x)
            if kind == "last":
                out = nn.functional.mse_loss(out, target)
            t1 = time.perf_counter()
            if kind == "last":
                out.backward(loss_grad)
            else:
                out.sum().backward()
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {kind: (sorted(fwd)[repeats // 2], sorted(bwd)[repeats // 2]) for kind, (fwd, bwd) in times.items()}


def measure(stages: int, m: int, steps: int, warmup: int, f: float) -> list[dict]:
    rows = []
    cal = calibrate(f, m)
    f_real, b_real = cal["inner"]
    f_last, b_last = cal["last"]
    # A bubble-free pipeline runs at its slowest stage's pace (with S = 1 the one stage is the last).
    per_mb = max(f_real + b_real, f_last + b_last) if stages > 1 else f_last + b_last
    with tempfile.TemporaryDirectory() as tmp:
        for impl, schedule in RUNS:
            out = os.path.join(tmp, f"{impl}-{schedule}.json")
            fn = ours if impl == "ours" else theirs
            spawn(fn, stages, (schedule, stages, m, steps, warmup, f, out))
            with open(out) as fh:
                seconds = json.load(fh)["seconds"]
            step_ideal = m * 3 * f
            own_ideal = step_ideal if schedule in ("2bw", "pipedream") else (m + stages - 1) * 3 * f
            rows.append({"impl": impl, "schedule": schedule, "seconds": seconds,
                         "steps_per_s": steps / seconds,
                         "achieved_over_ideal": step_ideal * steps / seconds,
                         "achieved_over_calibrated_ideal": m * per_mb * steps / seconds,
                         "calibrated_fwd_ms": 1e3 * f_real, "calibrated_bwd_ms": 1e3 * b_real,
                         "calibrated_last_fwd_ms": 1e3 * f_last, "calibrated_last_bwd_ms": 1e3 * b_last,
                         "achieved_over_own_ideal": own_ideal * steps / seconds})
    base = next(r for r in rows if r["impl"] == "torch" and r["schedule"] == "1f1b")["steps_per_s"]
    for r in rows:
        r["ratio_to_torch_1f1b"] = r["steps_per_s"] / base
    return rows


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=50,
                   help="steps in the timed stream (its one fill+drain costs (S-1)/(steps*m+S-1))")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fwd-ms", type=float, default=20.0, help="emulated forward time; backward is 2x")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    for flag, value, low in (("--stages", a.stages, 2), ("--microbatches", a.microbatches, a.stages),
                             ("--steps", a.steps, 1), ("--warmup", a.warmup, 0)):
        if value < low:  # before any rank starts: a rank's failure would come back as a traceback
            p.error(f"{flag} must be >= {low}, got {value}"
                    + {"--stages": " (the schedules compared are pipelines)",
                       "--microbatches": " (2bw needs a microbatch per stage)"}.get(flag, ""))
    if not (math.isfinite(a.fwd_ms) and a.fwd_ms > 0):
        p.error(f"--fwd-ms must be a positive number of milliseconds, got {a.fwd_ms}")
    rows = measure(a.stages, a.microbatches, a.steps, a.warmup, a.fwd_ms / 1000)
    spin_us, spin_setting = recv_spin_of_local_launch(a.stages)
    result = {"stages": a.stages, "microbatches": a.microbatches, "steps": a.steps, "recv_spin_us": spin_us,
              "fwd_ms": a.fwd_ms, "bwd_ms": 2 * a.fwd_ms, "rows": rows}
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"# S={a.stages} m={a.microbatches} steps={a.steps} fwd={a.fwd_ms:g} ms bwd={2 * a.fwd_ms:g} ms; ours: "
          f"the default CPU transport (socket, receive spin {spin_us} us: {RECV_SPIN_ENV}={spin_setting}), torch: gloo")
    r0 = rows[0]
    print(f"# calibrated stage compute: fwd {r0['calibrated_fwd_ms']:.2f} ms, bwd {r0['calibrated_bwd_ms']:.2f} ms; "
          f"last stage (with the loss) fwd {r0['calibrated_last_fwd_ms']:.2f} ms, bwd {r0['calibrated_last_bwd_ms']:.2f} ms "
          "(median of 30 in one process; the ideal in ach/cal runs at the slower)")
    print(f"# {'runtime':<8}{'schedule':<10}{'steps/s':>9}{'ach/ideal':>11}{'ach/cal':>9}{'ach/own':>9}{'x torch1F1B':>13}")
    for r in rows:
        print(f"  {r['impl']:<8}{r['schedule']:<10}{r['steps_per_s']:>9.3f}{r['achieved_over_ideal']:>11.3f}{r['achieved_over_calibrated_ideal']:>9.3f}"
              f"{r['achieved_over_own_ideal']:>9.3f}{r['ratio_to_torch_1f1b']:>13.2f}")
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
