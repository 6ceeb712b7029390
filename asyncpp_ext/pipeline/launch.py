"""Process start-up: join a torch.distributed world (torchrun's, or one this module spawns).

`spawn(fn, nprocs)` starts local ranks rendezvousing on 127.0.0.1. When one rank fails, the
others get a grace period to report their own view (e.g. "peer exited") and are then killed, so
no orphan is ever left behind; children also die with the launcher (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable

import torch.distributed as dist

from .transport import TransportError

DEFAULT_TIMEOUT_S = 300.0
EXIT_FAILED = 1        # the rank itself failed
EXIT_PEER_LOST = 3     # the rank stopped because a peer failed or stalled (a consequence, not a cause)


class LaunchError(RuntimeError):
    """A rank failed; the message names the first one."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    """True when torchrun (or our spawn) set up the rendezvous environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the world described by the environment (gloo); returns (rank, world_size)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _child(fn: Callable, rank: int, nprocs: int, port: int, args: tuple) -> None:
    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn(*args)
    except BaseException as e:  # report one line per rank; tracebacks only when debugging
        if os.environ.get("ASYNCPP_DEBUG"):
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"asyncpp: rank {rank}: {msg}\n")
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST if isinstance(e, TransportError) else EXIT_FAILED)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, args: tuple = (), *, grace_s: float = 10.0) -> None:
    """Run ``fn(*args)`` in ``nprocs`` local ranks; raise LaunchError if any rank fails."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, nprocs, port, args), daemon=False)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = None
    try:
        while any(p.is_alive() for p in procs):
            if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        exit_codes = [p.exitcode for p in procs]  # before any rank is stopped by us
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [(r, c) for r, c in enumerate(exit_codes) if c not in (None, 0)]
    # Root causes first: a rank killed by a signal, then one that failed by itself; ranks that
    # lost a peer only react.
    first_failure = min(failed, key=lambda f: (f[1] >= 0, f[1] == EXIT_PEER_LOST, f[0])) if failed else None
    if first_failure is not None:
        rank, code = first_failure
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise LaunchError(f"rank {rank} {how}; all ranks have stopped")
