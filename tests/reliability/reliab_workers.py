"""Rank functions for the reliability tests (importable by spawned ranks)."""
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


def stalling_worker(stall_stage: int, m: int, timeout_s: float, marker: str) -> None:
    init_distributed(60)
    blocks = make_blocks()
    blocks[stall_stage] = nn.Sequential(blocks[stall_stage], SleepAt(2 * m + 1, marker))  # in step 2
    pipe = Pipeline(blocks, loss_fn=nn.functional.mse_loss, optimizer=optimizer_factory("sgd"),
                    schedule="2bw", microbatches=m, timeout_s=timeout_s)
    for _ in pipe.train(batches(50, m), 50):
        pass


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


def rendezvous_worker(out_dir: str) -> None:
    import json
    import torch.distributed as dist

    rank, _ = init_distributed(30)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"MASTER_ADDR": os.environ.get("MASTER_ADDR"), "listening": listening_addresses()}, f)
    dist.barrier()
