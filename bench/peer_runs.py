"""One rank's side of bench/peer_schedules.py: the emulated MLP block (a fixed host-time cost per
forward, input-gradient and weight-gradient pass, so schedules are compared on their orders, not on
the machine's arithmetic), the placement and action orders of torch's pipelining schedules, and the
timed runs of ours and torch's on one rank (``worker``, started by peer_schedules.measure).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncpp_ext.optim import build_optimizer  # noqa: E402
from asyncpp_ext.pipeline import Pipeline, init_distributed  # noqa: E402
from asyncpp_ext.pipeline.memory import ActivationMeter, optimizer_state_bytes, tensor_bytes  # noqa: E402

WIDTH, HIDDEN, MICRO_BATCH = 64, 256, 32
BLOCKS_PER_RANK = 2
SPIN_S = 5e-4
RUN_TIMEOUT_S = 120
OURS = ("gpipe", "1f1b", "2bw", "pipedream")
# torch class name -> placement of its stages: "single" (one stage of two blocks per rank),
# "loop" (stages r and r+S on rank r) or "v" (stages r and 2S-1-r)
PEERS = {"GPipe": "single", "1F1B": "single", "Interleaved1F1B": "loop", "LoopedBFS": "loop",
         "InterleavedZeroBubble": "loop", "ZBVZeroBubble": "v", "DualPipeV": "v"}


# ---- the emulated MLP block -------------------------------------------------------------------

def hold(seconds: float, spin_s: float) -> None:
    """Wait ``seconds``: sleep, then spin the last ``spin_s`` (a plain sleep overshoots by ~0.1 ms)."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if seconds > spin_s:
        time.sleep(seconds - spin_s)
    while time.perf_counter() < deadline:
        pass


class _Forward(torch.autograd.Function):
    """At the block output: the forward holds; the backward passes the gradient through."""

    @staticmethod
    def forward(ctx, y, seconds, spin_s):
        out = y.clone()
        hold(seconds, spin_s)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Gradient(torch.autograd.Function):
    """Identity whose backward holds: on the block input it is part of the input gradient only, on
    a weight part of the weight gradient only."""

    @staticmethod
    def forward(ctx, x, seconds, spin_s):
        ctx.seconds, ctx.spin_s = seconds, spin_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        hold(ctx.seconds, ctx.spin_s)
        return grad, None, None


class EmulatedMLP(nn.Module):
    """Linear(64, 256) -> GELU -> Linear(256, 64) with fixed-time forward, input-gradient and
    weight-gradient parts (seconds per block)."""

    def __init__(self, fwd_s: float, bwd_input_s: float, bwd_weight_s: float, spin_s: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.fwd_s, self.bwd_input_s, self.bwd_weight_s, self.spin_s = fwd_s, bwd_input_s, bwd_weight_s, spin_s

    def forward(self, x):
        if not x.requires_grad:  # the first block: give it an input gradient like every other block
            x = x.detach().requires_grad_()
        x = _Gradient.apply(x, self.bwd_input_s, self.spin_s)
        w1 = _Gradient.apply(self.fc1.weight, self.bwd_weight_s, self.spin_s)
        h = nn.functional.gelu(nn.functional.linear(x, w1, self.fc1.bias))
        return _Forward.apply(self.fc2(h), self.fwd_s, self.spin_s)


def make_blocks(stages: int, costs_ms: dict, spin_s: float) -> list[nn.Module]:
    """The 2S blocks of the model, seeded (every rank builds the same weights)."""
    torch.manual_seed(0)
    per_block = {k: v / 1e3 / BLOCKS_PER_RANK for k, v in costs_ms.items()}
    return [EmulatedMLP(per_block["fwd"], per_block["bwd_input"], per_block["bwd_weight"], spin_s)
            for _ in range(BLOCKS_PER_RANK * stages)]


def batches(m: int):
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(m * MICRO_BATCH, WIDTH, generator=g), torch.randn(m * MICRO_BATCH, WIDTH, generator=g)


def adamw(module: nn.Module):
    return build_optimizer(module, "adamw", lr=1e-3, weight_decay=0.0, ef_beta=0.0)


def spin_for(stages: int) -> float:
    """Spin the end of a hold only while every rank has a core of its own."""
    return SPIN_S if stages <= (os.cpu_count() or 1) else 0.0


# ---- torch's schedules: which run, their stage placement, their action orders ----------------

def torch_stage_indices(name: str, stages: int, rank: int) -> list[int]:
    place = PEERS[name]
    if place == "single":
        return [rank]
    if place == "loop":
        return [rank, rank + stages]
    return [rank, 2 * stages - 1 - rank]


def _torch_class(name: str):
    from torch.distributed.pipelining import schedules

    return getattr(schedules, "Schedule" + name, None)


def torch_orders(name: str, stages: int, m: int):
    """torch's own per-rank action order for ``name`` (built with stand-in stages, no process
    group) as analytic.Action tuples, and its stage -> rank map. ValueError (torch's own message)
    where the schedule refuses the shape."""
    cls = _torch_class(name)
    if PEERS[name] == "single":  # torch's single-stage schedules: the classic GPipe / 1F1B orders
        if name == "GPipe":
            order = {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(stages)}
        else:
            order = {}
            for r in range(stages):
                warm = min(stages - 1 - r, m)
                acts = [("F", r, i) for i in range(warm)]
                for i in range(m - warm):
                    acts += [("F", r, warm + i), ("B", r, i)]
                acts += [("B", r, i) for i in range(m - warm, m)]
                order[r] = acts
        return order, {s: s for s in range(stages)}
    stub = [types.SimpleNamespace(num_stages=2 * stages, group_size=stages, group_rank=0, submod=None,
                                  stage_index=i) for i in range(2)]
    sched = cls(stub, n_microbatches=m, loss_fn=lambda out, target: out)
    orders = {}
    for r, acts in sched.pipeline_order.items():
        out = []
        for a in acts:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):  # DualPipeV's OVERLAP_F_B runs its two parts in turn here
                out.append((str(sub.computation_type.value), sub.stage_index, sub.microbatch_index))
        orders[r] = out
    return orders, dict(sched.stage_index_to_group_rank)


def torch_refusal(name: str, stages: int, m: int) -> str | None:
    """Why torch's ``name`` cannot run (S, m) here, in one line; None when it can."""
    if _torch_class(name) is None:
        return f"torch {name}: not in torch {torch.__version__}"
    try:
        torch_orders(name, stages, m)
    except (ValueError, AssertionError, RuntimeError) as e:
        return f"torch {name}: {' '.join(str(e).split())}"
    return None


# ---- one rank's runs -----------------------------------------------------------------------

def _steady_step_s(ends_ns: list, per: int = 1) -> float:
    """Seconds per step from a stream's step ends (ns): the median interval between consecutive
    ends, the last one (the drain of a continuous stream) left out; ``per`` ends make one step
    (pipedream: m). The median, because on a shared machine a burst of outside load only ever
    lengthens some intervals."""
    intervals = [(b - a) / 1e9 for a, b in zip(ends_ns, ends_ns[1:])]
    if len(intervals) > 2:
        intervals = intervals[:-1]
    if per > 1:  # whole steps of m ends each
        intervals = [sum(intervals[i:i + per]) for i in range(0, len(intervals) - per + 1, per)]
    return statistics.median(intervals)


def run_ours(schedule, stages, m, costs_ms, steps, warmup, spin_s) -> dict:
    blocks = make_blocks(stages, costs_ms, spin_s)
    modules = [nn.Sequential(*blocks[BLOCKS_PER_RANK * s:BLOCKS_PER_RANK * (s + 1)]) for s in range(stages)]
    per = m if schedule == "pipedream" else 1  # pipedream: one microbatch per step, m of them count as one
    mm = 1 if schedule == "pipedream" else m
    began = time.monotonic()
    pipe = Pipeline(modules, loss_fn=nn.functional.mse_loss, optimizer=adamw, schedule=schedule,
                    microbatches=mm, track_memory=True, timeout_s=RUN_TIMEOUT_S)
    data = batches(mm)
    setup = time.monotonic() - began
    for _ in pipe.train(data, warmup * per):
        pass
    warm = time.monotonic() - began - setup
    timed_from = len(pipe.trace)
    dist.barrier()
    start = time.monotonic_ns()
    for _ in pipe.train(data, steps * per):
        pass
    wall = (time.monotonic_ns() - start) / 1e9
    dist.barrier()
    ends = sorted(e[5] for e in pipe.trace[timed_from:] if e[0] == "optimizer_step")
    mem = pipe.host.memory_report()
    return {"steady_step_s": _steady_step_s(ends, per), "stream_step_s": wall / steps, "setup_s": setup, "warmup_s": warm,
            "memory": {"weights": mem["weights"], "weight_versions": mem["weight_versions"], "grads": mem["grads"],
                       "optimizer_state": mem["optimizer_state"], "activations": mem["peak_activations"]}}


def run_torch(name, stages, m, costs_ms, steps, warmup, spin_s) -> dict:
    from torch.distributed.pipelining import PipelineStage

    rank = dist.get_rank()
    blocks = make_blocks(stages, costs_ms, spin_s)
    cls = _torch_class(name)
    if PEERS[name] == "single":
        module = nn.Sequential(*blocks[BLOCKS_PER_RANK * rank:BLOCKS_PER_RANK * (rank + 1)])
        modules = [module]
        stage = PipelineStage(module, rank, stages, torch.device("cpu"))
        sched = cls(stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
        first, last = rank == 0, rank == stages - 1
    else:
        idx = torch_stage_indices(name, stages, rank)
        modules = [blocks[i] for i in idx]
        pstages = [PipelineStage(blocks[i], i, 2 * stages, torch.device("cpu")) for i in idx]
        sched = cls(pstages, n_microbatches=m, loss_fn=nn.functional.mse_loss)
        first, last = 0 in idx, 2 * stages - 1 in idx
    holder = nn.ModuleList(modules)
    opt = adamw(holder)
    params = list(holder.parameters())
    meter = ActivationMeter(exclude=params)
    data = batches(m)
    grads_bytes = [0]

    def one_step():
        x, y = next(data)
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        with meter.track():
            sched.step(*args, **kwargs)
        grads_bytes[0] = tensor_bytes(p.grad for p in params if p.grad is not None)
        opt.step()
        opt.zero_grad()

    began = time.monotonic()
    for _ in range(warmup):
        one_step()
    warm = time.monotonic() - began
    ends = []
    dist.barrier()
    start = time.monotonic_ns()
    for _ in range(steps):
        one_step()
        ends.append(time.monotonic_ns())
    wall = (time.monotonic_ns() - start) / 1e9
    dist.barrier()
    # every step flushes, so every interval is a whole step
    return {"steady_step_s": statistics.median((b - a) / 1e9 for a, b in zip(ends, ends[1:])),
            "stream_step_s": wall / steps, "setup_s": 0.0, "warmup_s": warm,
            "memory": {"weights": tensor_bytes(params), "weight_versions": 1, "grads": grads_bytes[0],
                       "optimizer_state": optimizer_state_bytes(opt), "activations": meter.peak}}


def worker(stages, plan, repeats, costs_ms, steps, warmup, out_prefix):
    """Every (m, runtime, schedule) of ``plan`` in this one process group, ``repeats`` times
    round-robin (so a burst of outside load hits every run alike)."""
    torch.set_num_threads(1)
    rank, _ = init_distributed(RUN_TIMEOUT_S)
    spin_s = spin_for(stages)
    results = []
    for repeat in range(repeats):
        for m, impl, name in plan:
            fn = run_ours if impl == "ours" else run_torch
            began = time.monotonic()
            results.append({"m": m, "impl": impl, "schedule": name, "repeat": repeat,
                            **fn(name, stages, m, costs_ms, steps, warmup, spin_s)})
            results[-1]["run_s"] = time.monotonic() - began
    with open(f"{out_prefix}-{rank}.json", "w") as fh:
        json.dump(results, fh)
