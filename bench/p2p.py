"""Point-to-point latency and bandwidth: asyncpp's transport vs plain torch.distributed isend/irecv.

Two local processes play ping-pong: rank 0 sends an activation-sized message, rank 1 receives it
and sends one of the same size back. Time is one-way (round trip / 2), algbw = bytes / time, as
nccl-tests reports it. After timing, every received buffer is compared with what the peer sent
("check" column). Backends:
  gloo  CPU tensors: asyncpp's GlooTransport driven directly (post_send/post_recv/wait) vs
        dist.isend/irecv on the same process group.
  nccl  CUDA tensors (needs 2 GPUs): the C++ NCCL transport vs dist.isend/irecv on an NCCL group.

    python bench/p2p.py [--backend gloo|nccl] [--max-mib 64] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from asyncpp_ext.pipeline import init_distributed, spawn
from asyncpp_ext.pipeline.stage import ACTIVATION, GRADIENT

KIB = 1024


class PingPongBuffers:
    """The stage-host side of the transport: one payload per direction, received into fresh tensors
    (as a real stage does)."""

    def __init__(self, stage: int, payload: torch.Tensor):
        self.stage, self.payload, self.last_received = stage, payload, None

    def take_send_buffer(self, kind: int, step: int, mb: int) -> torch.Tensor:
        return self.payload

    def recv_buffer(self, kind: int, step: int, mb: int) -> torch.Tensor:
        self.last_received = torch.empty_like(self.payload)
        return self.last_received


def pattern(count: int, rank: int, device) -> torch.Tensor:
    """Data that differs per rank and per element, so a wrong or partial message is caught."""
    return ((torch.arange(count, dtype=torch.float32) % 997) + 1000 * (rank + 1)).to(device)


def iterations(nbytes: int) -> int:
    return max(5, min(300, (256 << 20) // max(nbytes, 1)))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(transport, buffers, rank: int, iters: int, device) -> tuple[float, bool]:
    peer = 1 - rank
    out_kind, in_kind = (ACTIVATION, GRADIENT) if rank == 0 else (GRADIENT, ACTIVATION)
    wait = transport.wait

    def one(step: int) -> None:
        if rank == 0:
            s = transport.post_send(out_kind, step, 0, peer)
            r = transport.post_recv(in_kind, step, 0, peer)
            wait(r, 60.0)
            wait(s, 60.0)
        else:
            r = transport.post_recv(in_kind, step, 0, peer)
            wait(r, 60.0)
            s = transport.post_send(out_kind, step, 0, peer)
            wait(s, 60.0)

    for step in range(2):  # warm-up
        one(step)
    sync(device)
    start = time.perf_counter()
    for step in range(iters):
        one(step)
    sync(device)
    elapsed = time.perf_counter() - start
    ok = bool(torch.equal(buffers.last_received, pattern(buffers.payload.numel(), peer, device)))
    return elapsed / iters / 2, ok


def time_torch(payload: torch.Tensor, rank: int, iters: int, device, group) -> tuple[float, bool]:
    peer = 1 - rank
    received = torch.empty_like(payload)

    def one() -> None:
        if rank == 0:
            s = dist.isend(payload, dst=peer, group=group)
            r = dist.irecv(received, src=peer, group=group)
            r.wait()
            s.wait()
        else:
            dist.irecv(received, src=peer, group=group).wait()
            dist.isend(payload, dst=peer, group=group).wait()

    for _ in range(2):
        one()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        one()
    sync(device)
    elapsed = time.perf_counter() - start
    ok = bool(torch.equal(received, pattern(payload.numel(), peer, device)))
    return elapsed / iters / 2, ok


def make_transport(backend: str, rank: int, buffers, device):
    if backend == "gloo":
        from asyncpp_ext.pipeline.transport import GlooTransport

        return GlooTransport(buffers, [0, 1])
    from asyncpp_ext.pipeline.nccl import create_nccl_transport

    return create_nccl_transport(buffers, rank, 2, [0, 1], device, run_id=f"p2p{buffers.payload.numel()}").impl


def worker(backend: str, sizes: list, out_path: str) -> None:
    rank, _ = init_distributed(120)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    group = dist.new_group(backend="nccl") if backend == "nccl" else None
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        payload = pattern(count, rank, device)
        buffers = PingPongBuffers(rank, payload)
        transport = make_transport(backend, rank, buffers, device)
        iters = iterations(nbytes)
        ours_s, ours_ok = time_ours(transport, buffers, rank, iters, device)
        if backend == "nccl":
            transport.close(30.0)
        dist.barrier()
        torch_s, torch_ok = time_torch(payload, rank, iters, device, group)
        flags = torch.tensor([ours_ok, torch_ok], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # both ranks' checks must pass
        rows.append({"bytes": nbytes, "count": count, "type": "float32", "iters": iters,
                     "asyncpp_us": ours_s * 1e6, "asyncpp_algbw_GBps": nbytes / ours_s / 1e9,
                     "asyncpp_check": bool(flags[0]), "torch_us": torch_s * 1e6,
                     "torch_algbw_GBps": nbytes / torch_s / 1e9, "torch_check": bool(flags[1])})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def default_backend() -> str:
    if torch.cuda.device_count() >= 2:
        from asyncpp_ext.pipeline.nccl import NcclUnavailableError, require_nccl

        try:
            require_nccl(need_gpu=True)
            return "nccl"
        except NcclUnavailableError:
            pass
    return "gloo"


def print_table(backend: str, rows: list) -> None:
    print(f"# asyncpp p2p ping-pong, 2 local ranks, backend {backend}; time = one-way (round trip / 2)")
    print(f"# {'':>28}{'asyncpp transport':^30}{'torch.distributed isend/irecv':^30}")
    print(f"# {'size(B)':>10} {'count':>10} {'type':>6} {'time(us)':>10} {'algbw(GB/s)':>12} {'check':>6} "
          f"{'time(us)':>10} {'algbw(GB/s)':>12} {'check':>6}")
    for r in rows:
        print(f"  {r['bytes']:>10} {r['count']:>10} {r['type']:>6} {r['asyncpp_us']:>10.1f} "
              f"{r['asyncpp_algbw_GBps']:>12.3f} {'ok' if r['asyncpp_check'] else 'WRONG':>6} {r['torch_us']:>10.1f} "
              f"{r['torch_algbw_GBps']:>12.3f} {'ok' if r['torch_check'] else 'WRONG':>6}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl with 2 GPUs and NCCL loadable, else gloo")
    parser.add_argument("--min-kib", type=int, default=1, help="smallest message (KiB, default 1)")
    parser.add_argument("--max-mib", type=int, default=64, help="largest message (MiB, default 64)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.min_kib < 1 or args.max_mib * 1024 < args.min_kib:
        parser.error("need 1 <= --min-kib <= --max-mib * 1024")
    backend = args.backend or default_backend()
    sizes, n = [], args.min_kib * KIB
    while n <= args.max_mib * KIB * KIB:  # powers of 4
        sizes.append(n)
        n *= 4
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        spawn(worker, 2, (backend, sizes, out))
        with open(out) as f:
            rows = json.load(f)
    if args.json:
        print(json.dumps({"backend": backend, "rows": rows}, indent=2))
    else:
        print_table(backend, rows)
    return 0 if all(r["asyncpp_check"] and r["torch_check"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
