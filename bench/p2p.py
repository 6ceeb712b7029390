"""Point-to-point latency and bandwidth: asyncpp's transport vs plain torch.distributed isend/irecv.

Two local processes play ping-pong: rank 0 sends an activation-sized message, rank 1 receives it
and sends one of the same size back. Time is one-way (round trip / 2), algbw = bytes / time, as
nccl-tests reports it. After timing, every received buffer is compared with what the peer sent
("check" column). Backends:
  socket  CPU tensors: asyncpp's C++ socket transport (the CPU default) vs dist.isend/irecv over gloo.
  gloo    CPU tensors: asyncpp's Python GlooTransport vs dist.isend/irecv on the same process group.
  nccl    CUDA tensors (needs 2 GPUs): the C++ NCCL transport vs dist.isend/irecv on an NCCL group.
  ipc     CPU tensors: asyncpp's shared-memory transport vs dist.isend/irecv over gloo.
  ipc-cuda  both ranks on GPU 0: the ipc transport through CUDA IPC vs what gloo needs for CUDA
          tensors (a copy to the host, isend/irecv, a copy back to the GPU).
Our side is driven the way the executor drives it: payloads through the stage's MessageBoard (a
send's tensor handed over, receives into reused slots), post, then wait.

    python bench/p2p.py [--backend socket|gloo|nccl|ipc|ipc-cuda] [--max-mib 64] [--iters 300] [--json]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from asyncpp_ext import _C as C
from asyncpp_ext.pipeline import init_distributed, spawn
from asyncpp_ext.pipeline.sockets import RECV_SPIN_ENV, recv_spin_of_local_launch
from asyncpp_ext.pipeline.stage import ACTIVATION, GRADIENT

KIB = 1024
BUFFERS_PER_MESSAGE = 8
"""Host copies of the largest message the two ranks hold at once, at most: per rank the payload,
the received tensor and, through the host, a wire buffer each way."""


def memory_mib() -> int:
    """This machine's physical memory in MiB."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (KIB * KIB)


class PingPong:
    """Our transport as the executor drives it, for one payload size: sends hand the payload to
    the board, receives land in board slots that are released once checked."""

    def __init__(self, backend: str, rank: int, payload: torch.Tensor):
        self.backend, self.rank, self.payload, self.peer = backend, rank, payload, 1 - rank
        self.stage = rank  # GlooTransport names its stage in messages
        self.board = C.MessageBoard(self)
        self.last_received = None
        run_id = f"p2p{payload.numel()}"
        # The Python transports (gloo, ipc) receive into a tensor of ours; the C++ ones into board slots.
        self.python = backend == "gloo" or backend.startswith("ipc")
        if backend == "gloo":
            from asyncpp_ext.pipeline.transport import GlooTransport

            self.transport = GlooTransport(self, [0, 1])
        elif backend.startswith("ipc"):
            from asyncpp_ext.pipeline.ipc import IpcTransport

            self.transport = IpcTransport(self, [0, 1], run_id=run_id)
        elif backend == "socket":
            from asyncpp_ext.pipeline.sockets import create_socket_transport

            self.transport = create_socket_transport(self.board, rank, 2, [0, 1], run_id=run_id)
        else:
            from asyncpp_ext.pipeline.nccl import create_nccl_transport

            self.transport = create_nccl_transport(self.board, rank, 2, [0, 1], payload.device, run_id=run_id)
        if self.python:
            self.slot = torch.empty_like(payload)
        self.impl = self.transport if self.python else self.transport.impl

    def new_recv_buffer(self, kind: int) -> torch.Tensor:
        return torch.empty_like(self.payload)

    def post_send(self, kind: int, step: int) -> int:
        if self.python:
            return self.impl.post_send(kind, step, 0, self.peer, self.payload)
        self.board.put_send(kind, step, 0, self.payload)
        return self.impl.post_send(kind, step, 0, self.peer)

    def post_recv(self, kind: int, step: int) -> int:
        if self.python:
            return self.impl.post_recv(kind, step, 0, self.peer, self.slot)
        return self.impl.post_recv(kind, step, 0, self.peer)

    def received(self, kind: int, step: int) -> None:
        """Keep what arrived (for the check) and free its slot, as a backward would."""
        if self.python:
            self.last_received = self.slot
        else:
            self.last_received = self.board.received(kind, step, 0)
            self.board.release(kind, step, 0)

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if callable(close):
            close(30.0)


def pattern(count: int, rank: int, device) -> torch.Tensor:
    """Data that differs per rank and per element, so a wrong or partial message is caught."""
    return ((torch.arange(count, dtype=torch.float32) % 997) + 1000 * (rank + 1)).to(device)


def iterations(nbytes: int, most: int = 300) -> int:
    """Timed round trips of an ``nbytes`` message: 256 MiB's worth, at least 5, at most ``most``."""
    return max(min(5, most), min(most, (256 << 20) // max(nbytes, 1)))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(ours: PingPong, rank: int, iters: int, device) -> tuple[float, bool]:
    out_kind, in_kind = (ACTIVATION, GRADIENT) if rank == 0 else (GRADIENT, ACTIVATION)
    wait = ours.impl.wait

    def one(step: int) -> None:
        if rank == 0:
            s = ours.post_send(out_kind, step)
            r = ours.post_recv(in_kind, step)
            wait(r, 60.0)
            ours.received(in_kind, step)
            wait(s, 60.0)
        else:
            r = ours.post_recv(in_kind, step)
            wait(r, 60.0)
            ours.received(in_kind, step)
            s = ours.post_send(out_kind, step)
            wait(s, 60.0)

    for step in range(2):  # warm-up
        one(step)
    sync(device)
    start = time.perf_counter()
    for step in range(2, 2 + iters):
        one(step)
    sync(device)
    elapsed = time.perf_counter() - start
    ok = bool(torch.equal(ours.last_received, pattern(ours.payload.numel(), 1 - rank, device)))
    return elapsed / iters / 2, ok


def time_torch(payload: torch.Tensor, rank: int, iters: int, device, group, via_host: bool = False) -> tuple[float, bool]:
    """dist.isend/irecv ping-pong; ``via_host``: CUDA tensors over gloo, copied to the host and back."""
    peer = 1 - rank
    received = torch.empty_like(payload)
    wire_out = payload.cpu() if via_host else payload
    wire_in = torch.empty_like(wire_out) if via_host else received

    def send():
        if via_host:
            wire_out.copy_(payload)  # waits for the GPU, as .cpu() does
        return dist.isend(wire_out, dst=peer, group=group)

    def recv():
        dist.irecv(wire_in, src=peer, group=group).wait()
        if via_host:
            received.copy_(wire_in)

    def one() -> None:
        if rank == 0:
            s = send()
            recv()
            s.wait()
        else:
            recv()
            send().wait()

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


def worker(backend: str, sizes: list, out_path: str, most_iters: int = 300) -> None:
    rank, _ = init_distributed(120)
    device = (torch.device("cuda", rank) if backend == "nccl" else torch.device("cuda", 0) if backend == "ipc-cuda"
              else torch.device("cpu"))
    group = dist.new_group(backend="nccl") if backend == "nccl" else None
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        payload = pattern(count, rank, device)
        ours = PingPong(backend, rank, payload)
        iters = iterations(nbytes, most_iters)
        ours_s, ours_ok = time_ours(ours, rank, iters, device)
        ours.close()
        dist.barrier()
        torch_s, torch_ok = time_torch(payload, rank, iters, device, group, via_host=backend == "ipc-cuda")
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
    return "socket"


def print_table(backend: str, rows: list, spin_us: int, spin_setting: str) -> None:
    spin = f", receive spin {spin_us} us ({RECV_SPIN_ENV}={spin_setting})" if backend == "socket" else ""
    print(f"# asyncpp p2p ping-pong, 2 local ranks, backend {backend}{spin}; time = one-way (round trip / 2)")
    theirs = "gloo isend/irecv via host" if backend == "ipc-cuda" else "torch.distributed isend/irecv"
    print(f"# {'':>28}{'asyncpp transport':^30}{theirs:^30}")
    print(f"# {'size(B)':>10} {'count':>10} {'type':>6} {'time(us)':>10} {'algbw(GB/s)':>12} {'check':>6} "
          f"{'time(us)':>10} {'algbw(GB/s)':>12} {'check':>6}")
    for r in rows:
        print(f"  {r['bytes']:>10} {r['count']:>10} {r['type']:>6} {r['asyncpp_us']:>10.1f} "
              f"{r['asyncpp_algbw_GBps']:>12.3f} {'ok' if r['asyncpp_check'] else 'WRONG':>6} {r['torch_us']:>10.1f} "
              f"{r['torch_algbw_GBps']:>12.3f} {'ok' if r['torch_check'] else 'WRONG':>6}")


def main(argv=None) -> int:
    from bench_command import ArgumentParser  # beside this script (its folder is on sys.path)

    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("socket", "gloo", "nccl", "ipc", "ipc-cuda"), default=None,
                        help="default: nccl with 2 GPUs and NCCL loadable, else socket")
    parser.add_argument("--min-kib", type=int, default=1, help="smallest message (KiB, default 1)")
    parser.add_argument("--max-mib", type=int, default=64, help="largest message (MiB, default 64)")
    parser.add_argument("--iters", type=int, default=300,
                        help="at most this many timed round trips per size (default 300; each size times "
                             "256 MiB's worth, at least 5)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    backend = args.backend or default_backend()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problem = None
    if args.min_kib < 1 or args.max_mib * 1024 < args.min_kib:
        problem = "need 1 <= --min-kib <= --max-mib * 1024"
    elif args.iters < 1:
        problem = f"--iters must be at least 1, got {args.iters}"
    elif BUFFERS_PER_MESSAGE * args.max_mib > memory_mib():
        problem = (f"--max-mib {args.max_mib}: the two ranks hold about {BUFFERS_PER_MESSAGE} buffers of the largest "
                   f"message, more than this machine's {memory_mib()} MiB of memory; use at most "
                   f"{memory_mib() // BUFFERS_PER_MESSAGE}")
    elif backend == "ipc-cuda" and gpus < 1:
        problem = "--backend ipc-cuda puts both ranks on one GPU, but torch sees none; use --backend ipc"
    elif backend == "nccl" and gpus < 2:
        problem = f"--backend nccl needs two GPUs (one per rank), torch sees {gpus}; use socket, gloo or ipc"
    if problem:
        print(f"p2p.py: error: {problem}", file=sys.stderr)
        return 2
    sizes, n = [], args.min_kib * KIB
    while n <= args.max_mib * KIB * KIB:  # powers of 4
        sizes.append(n)
        n *= 4
    spin_us, spin_setting = recv_spin_of_local_launch(2)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        spawn(worker, 2, (backend, sizes, out, args.iters))
        with open(out) as f:
            rows = json.load(f)
    if args.json:
        print(json.dumps({"backend": backend, "recv_spin_us": spin_us, "rows": rows}, indent=2))
    else:
        print_table(backend, rows, spin_us, spin_setting)
    return 0 if all(r["asyncpp_check"] and r["torch_check"] for r in rows) else 1


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
