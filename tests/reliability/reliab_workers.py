"""Rank functions for the reliability tests (importable by spawned ranks)."""
import itertools
import os
import time

import torch
import torch.nn as nn

from asyncpp_ext.pipeline import Pipeline, init_distributed

from pipeline_workers import batches, make_blocks, optimizer_factory


class SleepAt(nn.Module):
    """Identity that sleeps forever on its n-th call (a stage stuck inside forward), first
    writing the wall-clock time the stall began to ``marker``."""

    def __init__(self, n: int, marker: str):
        super().__init__()
        self.n, self.calls, self.marker = n, 0, marker

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
            while True:
                time.sleep(3600)
        return x


def stalling_worker(stall_stage: int, m: int, timeout_s: float, marker: str, dp: int = 1,
                    optimizer: str = "sgd") -> None:
    """Block ``stall_stage`` (the block index) stalls in step 2 (with ``dp`` > 1: in the last replica only)."""
    rank, world = init_distributed(60)
    write_rendezvous(os.path.dirname(marker), rank)
    blocks = make_blocks()
    if rank >= world - world // dp:  # the last replica's ranks
        blocks[stall_stage] = nn.Sequential(blocks[stall_stage], SleepAt(2 * m + 1, marker))  # in step 2
    pipe = Pipeline(blocks, loss_fn=nn.functional.mse_loss, optimizer=optimizer_factory(optimizer),
                    schedule="2bw", microbatches=m, timeout_s=timeout_s, dp=dp)
    for _ in pipe.train(batches(50, m), 50):
        pass


def ignored_targets_worker(out_dir: str, step: int, row: int) -> None:
    """S = 2 x R = 2, cross entropy with ignored targets (-100), skip policy: at ``step`` row ``row``
    of the global batch has its target ignored -- the whole of one replica's share of a microbatch
    (micro-batch size 2 globally, 1 per replica), whose loss is then 0/0 = NaN with a zero gradient."""
    import torch.distributed as dist
    init_distributed(60)

    def targets(steps):
        for t, (x, y) in enumerate(batches(steps, 3)):
            target = y.argmax(-1)
            if t == step:
                target[row] = -100
            yield x, target
    pipe = Pipeline(make_blocks(), loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, ignore_index=-100),
                    optimizer=optimizer_factory("adamw"), schedule="2bw", microbatches=3, on_nonfinite="skip",
                    timeout_s=60, dp=2)
    stats = [(s.loss, s.skipped) for s in pipe.train(targets(5), 5)]
    torch.save({"params": dict(pipe.state_dict()["params"]), "skipped": pipe.host.nonfinite.skipped,
                "stats": stats}, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def dp_killed_worker(kill_rank: int, kill_after_steps: int) -> None:
    """S = 2 x R = 2; rank ``kill_rank`` (a last stage) kills itself with SIGKILL after that many steps."""
    import signal
    rank, _ = init_distributed(60)
    pipe = Pipeline(make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=optimizer_factory("sgd"),
                    schedule="2bw", microbatches=3, timeout_s=20, dp=2)
    for i, _ in enumerate(pipe.train(batches(10_000, 3), 10_000)):
        if rank == kill_rank and i + 1 == kill_after_steps:
            os.kill(os.getpid(), signal.SIGKILL)


def listening_addresses() -> list:
    """(address, port) of every TCP socket this process listens on, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/self/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":  # 0A = LISTEN
                hex_addr, hex_port = fields[1].split(":")
                found.append((_decode(hex_addr), int(hex_port, 16)))
    return found


def _decode(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]  # /proc prints each 32-bit word little-endian
    import ipaddress
    return str(ipaddress.IPv6Address(b"".join(words)))


def write_rendezvous(out_dir: str, rank: int) -> None:
    import json
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"MASTER_ADDR": os.environ.get("MASTER_ADDR"), "listening": listening_addresses()}, f)


# ---- non-finite values ---------------------------------------------------------------------------
class _ScaleWithPoisonedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, poison):
        ctx.save_for_backward(x, w)
        ctx.poison = poison
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = (grad * x).sum().reshape(1)
        if ctx.poison:
            grad_w = torch.full_like(grad_w, float("nan"))
        return grad * w, grad_w, None  # the input gradient stays finite


class PoisonGradAt(nn.Module):
    """y = x * w, whose weight gradient is NaN for the microbatches of step ``step`` (counted by
    forward calls, m per step) while the gradient it passes on stays finite."""

    _calls: dict = {}  # shared by the 2bw weight replicas (deep copies keep the same key)
    _keys = itertools.count()  # a fresh key per instance (an object's address can be reused at once)

    def __init__(self, step: int, m: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.step, self.m, self.key = step, m, next(PoisonGradAt._keys)

    def forward(self, x):
        if not torch.is_grad_enabled():  # the start-up shape probe is not a microbatch
            return x * self.w
        calls = self._calls[self.key] = self._calls.get(self.key, 0) + 1
        poison = self.step * self.m < calls <= (self.step + 1) * self.m
        return _ScaleWithPoisonedGrad.apply(x, self.w, poison)


def nan_blocks(m: int, nan_grad_block: int | None, nan_grad_step: int) -> list:
    blocks = make_blocks()
    if nan_grad_block is not None:
        blocks[nan_grad_block] = nn.Sequential(blocks[nan_grad_block], PoisonGradAt(nan_grad_step, m))
    return blocks


def nan_batches(steps: int, m: int, nan_input_step: int | None, nan_rows: tuple = (2, 4)):
    """pipeline_workers.batches with NaN input rows ``nan_rows`` (default: all of microbatch 1, at
    micro-batch size 2) in step ``nan_input_step``."""
    for t, (x, y) in enumerate(batches(steps, m)):
        if t == nan_input_step:
            x = x.clone()
            x[nan_rows[0]:nan_rows[1]] = float("nan")
        yield x, y


def nonfinite_worker(policy: str, m: int, steps: int, nan_input_step, nan_grad_block, nan_grad_step,
                     out_dir: str, dp: int = 1, nan_rows: tuple = (2, 4), bucket_bytes: int | None = None,
                     optimizer: str = "adamw", race_step: int | None = None) -> None:
    """``race_step`` (S = 2 x R = 2): at that step, replica 0's last stage starts its last backward
    0.3 s late and replica 1's first stage judges its gradients 1 s after its last backward, so
    that replica 1's last stage judges before its all-reduces can finish (it waits on replica 0's
    last stage) and replica 1's first stage after its own have finished (replica 0's first stage has
    long launched its part)."""
    import functools
    import json
    import time
    import torch.distributed as dist
    import asyncpp_ext.pipeline.stage as stage_module
    from asyncpp_ext.pipeline.nonfinite import NonFiniteGuard
    init_distributed(60)
    rank = dist.get_rank()
    if race_step is not None and rank == 1:
        backward = stage_module.StageHost.backward

        def late_backward(self, step, mb, *args, **kwargs):
            if step == race_step and mb == self.m - 1:
                time.sleep(0.3)
            return backward(self, step, mb, *args, **kwargs)
        stage_module.StageHost.backward = late_backward
    if race_step is not None and rank == 2:
        judge = NonFiniteGuard.after_backward

        def late_judge(self, step, mb, *args, **kwargs):
            if step == race_step and mb == self.m - 1:
                time.sleep(1.0)
            return judge(self, step, mb, *args, **kwargs)
        NonFiniteGuard.after_backward = late_judge
    averager = stage_module.GradientAverager
    if bucket_bytes is not None:  # several buckets for these tiny stages (the default fits one)
        stage_module.GradientAverager = functools.partial(averager, bucket_bytes=bucket_bytes)
    try:
        pipe = Pipeline(nan_blocks(m, nan_grad_block, nan_grad_step), loss_fn=nn.functional.mse_loss,
                        optimizer=optimizer_factory(optimizer), schedule="2bw", microbatches=m,
                        on_nonfinite=policy, timeout_s=60, dp=dp)
    finally:
        stage_module.GradientAverager = averager
    stats = list(pipe.train(nan_batches(steps, m, nan_input_step, nan_rows), steps))
    params = {n: t for n, t in pipe.state_dict()["params"].items()}
    torch.save({"params": params, "skipped": pipe.host.nonfinite.skipped},
               os.path.join(out_dir, f"stage{pipe.stage}" + (f"_replica{pipe.replica}" if dp > 1 else "") + ".pt"))
    if pipe.host.is_last and pipe.replica == 0:
        with open(os.path.join(out_dir, "stats.json"), "w") as f:
            json.dump([[s.loss, s.skipped] for s in stats], f)
