"""Process start-up: join a torch.distributed world (torchrun's, or one this module spawns).

`spawn(fn, nprocs)` starts local ranks rendezvousing on 127.0.0.1 (or the user's MASTER_ADDR):
the rendezvous store and gloo's sockets listen on that address only, never on every interface.
When one rank fails, the others get a grace period to report their own view (e.g. "peer exited")
and are then killed, so no orphan is ever left behind; children also die with the launcher
(PR_SET_PDEATHSIG, and a watch on the launcher's pid where a forkserver is the parent). Each
failing rank prints one line (a stalled one its watchdog report) and tells the launcher why it
failed, so the launcher's error names the root cause.

How ranks start (a forkserver with torch imported, or fresh interpreters): start_method.py.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Sequence

import torch.distributed as dist

from ..stop_signals import Stopped, die_with_parent, notes_early, signals_handled, stop_signals_raise
from .devices import check_spawned_ranks, usable_cores
from .peer_errors import TransportError, peer_gone
from .start_method import START_METHOD_ENV, _context, _stdout_and_stderr_open
from .stream_worker import join_left_streams, quiet_running_streams
from .watchdog import EXIT_PEER_LOST, EXIT_STALLED, check_timeout, default_timeout_s


EXIT_FAILED = 1        # the rank itself failed
# EXIT_PEER_LOST (3): the rank stopped because a peer failed or stalled (a consequence, not a cause)
# EXIT_STALLED (4): the rank's own instruction never completed (its watchdog fired)
EXIT_SPAWN_AT_IMPORT = 5  # the rank, importing the script, reached its spawn() call (no __main__ guard)
_SPAWN_AT_IMPORT = ("the script calls spawn() when it is imported, which each rank does as it starts; put the "
                    "call under `if __name__ == \"__main__\":`")
_SPAWNED_ENV = "ASYNCPP_LOCAL_SPAWN"
STOP_GRACE_S = 5.0  # seconds the ranks have to stop after the launcher passes its SIGTERM on
INTERRUPT_GRACE_S = 2.0  # seconds the ranks have to end on a Ctrl-C by themselves
_failure_channel = None  # a spawned rank's line back to the launcher
_store_listener = None  # rank 0 of a spawned run: the store's socket, bound by the launcher


class LaunchError(RuntimeError):
    """A rank failed; the message names the first one."""


def _listening_socket(addr: str, port: int, backlog: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(sockaddr)
    listener.listen(backlog)
    return listener


def check_local_address(environ=os.environ) -> str:
    """The address a local launch's ranks meet on (MASTER_ADDR, default 127.0.0.1), checked to name
    this machine: ValueError naming the variable when it does not resolve or cannot be bound here.
    ``spawn`` binds it again; calling this first lets a launcher refuse before it writes anything."""
    addr = environ.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    try:
        _listening_socket(addr, 0, 1).close()
    except OSError as exc:  # socket.gaierror (no such name) or EADDRNOTAVAIL (not this machine's)
        raise ValueError(f"MASTER_ADDR={addr!r} is not an address of this machine ({exc.strerror or exc}); "
                         "unset it for a one-machine run (ranks then meet on 127.0.0.1) or start the ranks "
                         "with torchrun") from None
    return addr


def under_launcher() -> bool:
    """True when torchrun (or our spawn) set up the rendezvous environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))


def spawned_locally() -> bool:
    """True in a rank started by ``spawn`` (its LOCAL_RANK is its rank; the world is this machine)."""
    return os.environ.get(_SPAWNED_ENV) == "1"


def launcher() -> str:
    """Which launcher started this process's run: "torchrun" in a process torchrun started, else
    "spawn" (a rank ``spawn`` started, the process that spawns them, or a run of one process);
    ``devices.local_world_size`` counts this machine's ranks by it."""
    return "torchrun" if under_launcher() and not spawned_locally() else "spawn"


def init_distributed(timeout_s: float | None = None, backend: str = "gloo") -> tuple[int, int]:
    """Join the world described by the environment; returns (rank, world_size).

    ``timeout_s`` bounds every collective (barriers, the start-up handshake); default
    ``ASYNCPP_TIMEOUT`` or 300 s. ``backend`` is the default group's: it must carry CPU tensors,
    so "gloo", or "cpu:gloo,cuda:nccl" where CUDA tensors need NCCL too (devices.py). Ranks
    started by ``spawn`` rendezvous through a store that listens on MASTER_ADDR only (127.0.0.1
    unless the user set it)."""
    timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s, f"timeout_s={timeout_s!r}")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        timeout = datetime.timedelta(seconds=timeout_s)
        if os.environ.get(_SPAWNED_ENV) == "1":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_local_store(rank, world, timeout), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _local_store(rank: int, world: int, timeout: datetime.timedelta):
    """The rendezvous store of a local run. torch's TCPStore server listens on every interface;
    handing it a socket bound to MASTER_ADDR keeps a local run unreachable from the network."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout=timeout)
    # The launcher bound and listens on the port already and handed the socket over, so no other
    # process can take the port between choosing it and serving on it.
    listener = _store_listener or _listening_socket(addr, port, max(64, world))
    fd = listener.detach()
    try:
        return dist.TCPStore(addr, port, world, True, timeout=timeout, master_listen_fd=fd)
    except RuntimeError as exc:
        if "listen fd" not in str(exc):
            raise
    # torch 2.5's libuv server cannot start from a listening socket, and its legacy server can
    # leave a rank hanging in destroy_process_group: release the port and let the server bind it
    # (another process could take it in between; a failed bind then names the port).
    os.close(fd)
    return dist.TCPStore(addr, port, world, True, timeout=timeout)


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), None)


def tell_launcher(message: str) -> None:
    """Hand this rank's one-line failure reason to ``spawn`` (no-op outside spawned ranks)."""
    if _failure_channel is not None:
        try:
            _failure_channel.put((int(os.environ.get("RANK", -1)), message))
        except (OSError, ValueError):
            pass  # the launcher is gone; stderr still has the line


def _die_with_parent() -> None:
    """SIGKILL when the parent exits: the launcher, or the forkserver, which exits when the
    launcher does once no rank holds the server's "launcher alive" pipe (each forked process
    inherits its write end so that it could start processes of its own; a rank never does)."""
    server = mp.forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with_parent(os.getppid(), EXIT_FAILED)


def _die_with_launcher(launcher: int) -> None:
    """SIGKILL when the launcher exits, where it is not this rank's parent (a forkserver's rank):
    the death signal set by ``_die_with_parent`` fires only once the forkserver has exited too,
    which takes it a second or more (its interpreter tears torch down), time in which the ranks
    would train on and write files. A thread waits on the launcher's pidfd instead."""
    if launcher == os.getppid() or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:  # the launcher was gone before this rank started
        os._exit(EXIT_FAILED)
    except OSError:  # a kernel without pidfds (before Linux 5.3): the forkserver's exit ends the rank
        return

    def wait_then_die() -> None:
        select.select([pidfd], [], [])  # readable once the launcher has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_then_die, name="asyncpp-launcher-watch", daemon=True).start()


class _LauncherStdio:
    """The launcher's standard output and error as they are at launch time, handed to a
    forkserver's rank, which would otherwise write where the server's went (multiprocessing
    passes the file descriptors along with the rank, as it does sockets)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _launcher_stdio_in_rank, (reduction.DupFd(1), reduction.DupFd(2))


def _launcher_stdio_in_rank(out, err) -> tuple:
    return out.detach(), err.detach()


def _child(fn: Callable, rank: int, nprocs: int, port: int, args: tuple, channel=None,
           listener: socket.socket | None = None, environ: dict | None = None,
           stdio: tuple | None = None, launcher: int | None = None, interruptible: bool = True,
           forward: Sequence[str] = ()) -> None:
    global _failure_channel, _store_listener
    _die_with_parent()
    if interruptible:  # a forkserver's ranks start with SIGINT ignored (forkserver_start.py)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if launcher is not None:
        _die_with_launcher(launcher)
    if environ is not None and environ != dict(os.environ):  # the launcher's at launch time
        os.environ.clear()
        os.environ.update(environ)
    if stdio is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(stdio, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
    _failure_channel, _store_listener = channel, listener
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      MASTER_PORT=str(port), **{_SPAWNED_ENV: "1"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    loopback = _loopback_interface()
    if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost") and loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # gloo's sockets on loopback too
    try:
        # SIGTERM: a line and a clean end, as a Ctrl-C gives; a signal the launcher passes on
        # (``forward``) is noted until fn's own handling takes it (stop_request.noting)
        with stop_signals_raise(), notes_early(forward):
            fn(*args)
            # A stream fn left (a break) runs on and may use the groups destroyed below.
            join_left_streams("before the rank ends")
    except BaseException as e:  # report one line per rank; tracebacks only when debugging
        quiet_running_streams()  # a stream left running (its loop's body raised) says nothing more
        tell_launcher(report_rank_failure(rank, e))
        os._exit(EXIT_PEER_LOST if lost_a_peer(e) else EXIT_FAILED)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def report_rank_failure(rank: int, e: BaseException) -> str:
    """Write rank ``rank``'s one line for ``e`` ("asyncpp: rank R: ...", the traceback too with
    ASYNCPP_DEBUG set) and return its message."""
    if os.environ.get("ASYNCPP_DEBUG"):
        traceback.print_exception(type(e), e, e.__traceback__)
    msg = ("interrupted" if type(e) is KeyboardInterrupt else  # Ctrl-C; Stopped names its signal
           str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    sys.stderr.write(f"asyncpp: rank {rank}: {msg}\n")
    sys.stderr.flush()
    return msg


# What a signal that killed a rank most often means, where its name alone does not say.
_SIGNAL_CAUSES = {
    "SIGKILL": "the kernel's out-of-memory killer sends it, as does kill -9",
    "SIGBUS": "a memory-mapped file, such as a token file, was cut short while the rank read it",
}


def killed_by(signum: int) -> str:
    """"signal N (NAME: what it usually means)" for a rank's death by ``signum``."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    cause = _SIGNAL_CAUSES.get(name)
    return f"signal {signum} ({name}: {cause})" if cause else f"signal {signum} ({name})"


def lost_a_peer(e: BaseException) -> bool:
    """Whether ``e`` stopped this rank because a peer failed (a consequence, not a cause): a
    transport's error, or a collective whose peer's connection went away."""
    return isinstance(e, TransportError) or peer_gone(e)


def spawn(fn: Callable, nprocs: int, args: tuple = (), *, grace_s: float = 10.0,
          forward: Sequence[str] = ()) -> None:
    """Run ``fn(*args)`` in ``nprocs`` local ranks; raise LaunchError if any rank fails
    (ValueError, before anything starts, if ``ASYNCPP_START_METHOD`` is not a valid choice).
    The signals named in ``forward`` ("SIGUSR1", ...), sent to this process, are passed on to
    every rank still running instead of taking their effect here (``--stop-on-signal``).
    A forkserver started here imports ``fn``'s module where it is part of this package, so a rank
    starts with nothing left to import (a Ctrl-C then finds no import of a rank in progress);
    other modules, which could resolve differently from another working directory, are imported
    by each rank. More ranks than ``devices.MAX_RANKS_PER_CORE`` per core are refused (DeviceError,
    a ValueError) before any starts."""
    if getattr(mp.process.current_process(), "_inheriting", False):  # a rank importing the main script
        sys.stderr.write(f"asyncpp: a starting rank: {_SPAWN_AT_IMPORT}\n")  # it would start ranks of its own
        sys.stderr.flush()
        os._exit(EXIT_SPAWN_AT_IMPORT)  # not an exception: multiprocessing would print its own traceback
    check_spawned_ranks(nprocs, usable_cores(), what="spawn's nprocs", fewer="start fewer")
    ctx = _context((fn.__module__,) if fn.__module__.startswith(__package__.split(".")[0] + ".") else ())
    listener = _listening_socket(os.environ.get("MASTER_ADDR", "127.0.0.1"), 0, max(64, nprocs))
    port = listener.getsockname()[1]
    channel = ctx.SimpleQueue()
    reasons: dict[int, str] = {}
    environ = dict(os.environ)
    stdio = _LauncherStdio() if ctx.get_start_method() == "forkserver" and _stdout_and_stderr_open() else None
    interruptible = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # a background job's is not
    procs = [ctx.Process(target=_child, args=(fn, r, nprocs, port, args, channel, listener if r == 0 else None,
                                              environ, stdio, os.getpid(), interruptible, tuple(forward)),
                         daemon=False)
             for r in range(nprocs)]
    started = []  # a Ctrl-C can come between two starts: the ranks already started stop too
    deadline = None

    def pass_on(signum, frame):
        for p in started:
            if p.is_alive():
                os.kill(p.pid, signum)

    with signals_handled(pass_on, [getattr(signal, name) for name in forward]):
        try:
            try:
                for p in procs:
                    p.start()  # rank 0 gets its own duplicate of the listening socket
                    started.append(p)
            finally:
                listener.close()
            while any(p.is_alive() for p in procs):
                while not channel.empty():
                    r, message = channel.get()
                    reasons.setdefault(r, message)
                if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
                    deadline = time.monotonic() + grace_s
                if deadline is not None and time.monotonic() > deadline:
                    break
                # woken at once by a rank's end (a short run's launch is a tenth of a second:
                # a fixed sleep would add up to its own length to each); the timeout paces the
                # reading of failure reasons and the grace deadline
                mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.05)
        except Stopped:
            # A stop request to this process alone (SIGTERM, SIGHUP; Ctrl-C reaches the whole process
            # group): passed on as SIGTERM, which each rank answers with its line (not SIGINT: a run
            # started in the background of a script inherits SIGINT ignored), and a moment for it.
            for p in started:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
            for p in started:
                p.join(STOP_GRACE_S)
            raise
        except KeyboardInterrupt:
            # A Ctrl-C reaches the whole process group: each rank ends on it with its own line
            # ("interrupted"). A moment for that before the ones left (a SIGINT to this process alone)
            # are stopped below: a SIGTERM landing in a rank as it handles its SIGINT replaces its line.
            end = time.monotonic() + INTERRUPT_GRACE_S
            for p in started:
                p.join(max(0.0, end - time.monotonic()))
            raise
        finally:
            exit_codes = [p.exitcode for p in procs]  # before any rank is stopped by us
            ended_by_us = [r for r, p in enumerate(procs) if p in started and p.is_alive()]
            for p in started:
                if p.is_alive():
                    p.terminate()
            for p in started:
                p.join(2.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    while not channel.empty():
        r, message = channel.get()
        reasons.setdefault(r, message)
    channel.close()
    failed = [(r, c) for r, c in enumerate(exit_codes) if c not in (None, 0)]
    # Root causes first: a rank killed by a signal, then one that failed by itself; ranks that
    # lost a peer only react.
    first_failure = min(failed, key=lambda f: (f[1] >= 0, f[1] == EXIT_PEER_LOST, f[0])) if failed else None
    if first_failure is not None:
        rank, code = first_failure
        for r in ended_by_us:
            if r not in reasons:  # blocked where no Python runs (a rendezvous, a native call): its line
                sys.stderr.write(f"asyncpp: rank {r}: stopped by the launcher {grace_s:g} s after rank {rank} "
                                 "failed, without a line of its own\n")
        sys.stderr.flush()
        how = (f"was killed by {killed_by(-code)}" if code < 0 else
               f"stalled (exit code {code})" if code == EXIT_STALLED else
               f"could not start: {_SPAWN_AT_IMPORT}" if code == EXIT_SPAWN_AT_IMPORT else f"exited with code {code}")
        why = f" ({reasons[rank]})" if rank in reasons else ""
        hint = ""
        if "forked subprocess" in why and ctx.get_start_method() == "forkserver":  # torch's bad-fork refusal
            hint = f"; set {START_METHOD_ENV}=spawn to start ranks from fresh interpreters"
        raise LaunchError(f"rank {rank} {how}{why}; all ranks have stopped{hint}")
