"""How local ranks start: from a forkserver with torch already imported, or from fresh interpreters.

Where the platform has one (Linux), ranks start from a forkserver with torch (and torch._dynamo,
which every optimizer's creation imports) already imported, so a launch costs a fork instead of a
fresh interpreter importing torch per rank (seconds each); ``ASYNCPP_START_METHOD=spawn`` starts
every rank from a fresh interpreter instead. The server is kept across launches while what its
imports could have depended on stays the same (``_forkserver_for_this_environment``), and is
checked once to be ready, and free to give its children the GPU, before ranks fork from it.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import sys
from typing import Callable

START_METHOD_ENV = "ASYNCPP_START_METHOD"
START_METHODS = ("auto", "forkserver", "spawn")
# torch._dynamo: torch.optim.Optimizer.add_param_group is wrapped by torch._disable_dynamo, which
# imports torch._dynamo on its first call -- 1.9-2.2 s in every rank that builds an optimizer.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
# Preloaded too where a server starts: every rank's entry point (launch._child) is in it, so each
# rank would import it, and the ~70 modules of asyncpp_ext.pipeline with it, before anything else
# (0.05-0.1 s a rank; more where no bytecode is cached). Not part of the base preload above: a
# server whose children cannot use CUDA with it is started again with torch's imports alone.
_RANK_ENTRY = "asyncpp_ext.pipeline.launch"
# Imported by every forkserver before its preload: the server and its ranks' start-up ignore
# Ctrl-C, which is the launcher's to handle (otherwise each prints an import's traceback).
_SERVER_SETUP = "asyncpp_ext.forkserver_start"
# Variables that change from one launch to the next without meaning anything to a rank's imports:
# pytest's per-test bookkeeping (PYTEST_CURRENT_TEST is rewritten for every test; xdist's worker
# ids). A change of one does not restart the forkserver; the rank still sees the launcher's value.
_PER_LAUNCH_ENV_PREFIXES = ("PYTEST_",)
# The same for the package's own knobs that a rank reads only when it uses them, after its imports:
# the transports' (pipeline/sockets.py and pipeline/ipc.py read them as a rank builds its transport;
# tests/test_launch.py holds these names to theirs) and the start method (the launcher's to read).
_PER_LAUNCH_ENV_NAMES = ("ASYNCPP_RECV_SPIN_US", "ASYNCPP_INLINE_RECV_BYTES", "ASYNCPP_SOCKET_HOST",
                         "ASYNCPP_IPC_SLOTS", START_METHOD_ENV)
_forkserver_started_under: tuple | None = None  # what the forkserver we use started under (_server_key)
_forkserver_checked_pid: int | None = None  # the server whose children were seen to start (and use CUDA)
_forkserver_refused_under: tuple | None = None  # the environment whose server's children could not use CUDA


def start_method() -> str:
    """How ``spawn`` starts ranks: ``ASYNCPP_START_METHOD`` (auto, forkserver, spawn); auto is
    forkserver where the platform has it, else spawn. ValueError naming the variable otherwise."""
    raw = os.environ.get(START_METHOD_ENV, "").strip().lower()
    available = mp.get_all_start_methods()
    if raw not in ("",) + START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={raw!r} is not one of {', '.join(START_METHODS)}; "
                         "unset it or use spawn")
    if raw in ("", "auto"):
        return "forkserver" if "forkserver" in available else "spawn"
    if raw not in available:
        raise ValueError(f"{START_METHOD_ENV}={raw}: this platform has no {raw} start method; use spawn")
    return raw


def _context(preload: tuple = ()):
    method = start_method()
    if method == "forkserver" and not _forkserver_ready(preload):
        method = "spawn"
    return mp.get_context(method)


def _set_preload(modules: list) -> None:
    """What the next forkserver started imports: ``_SERVER_SETUP``, then ``modules``."""
    mp.set_forkserver_preload([_SERVER_SETUP] + modules)


def _server_preload(extra: tuple = ()) -> list:
    """What a server started now imports: the base preload, then ``_RANK_ENTRY`` and ``extra``."""
    added = dict.fromkeys(m for m in (_RANK_ENTRY, *extra) if m not in _FORKSERVER_PRELOAD)
    return _FORKSERVER_PRELOAD + list(added)


def _forkserver_ready(preload: tuple = ()) -> bool:
    """Whether a forkserver for this environment runs, or can be started, with children free to use
    CUDA; one started now imports ``_RANK_ENTRY`` and ``preload``'s modules too (a running one keeps
    its imports)."""
    if not _forkserver_for_this_environment():
        return False
    global _forkserver_checked_pid
    if preload and mp.forkserver._forkserver._forkserver_pid is None:
        _set_preload(_server_preload(preload))
    if not _forkserver_children_can_use_cuda():
        return False
    pid = mp.forkserver._forkserver._forkserver_pid
    if pid is None or pid != _forkserver_checked_pid:
        # One child first, which the server forks once its imports are done (a probed server was
        # ready when its probe ran): the ranks are then started at once, so a Ctrl-C cannot leave
        # a rank's start queued at a server whose launcher is gone (it would fork the rank,
        # which finds the launcher's queue removed: a traceback).
        _fork_one_child()
        _forkserver_checked_pid = mp.forkserver._forkserver._forkserver_pid
    return True


def _stdout_and_stderr_open() -> bool:
    try:
        os.fstat(1), os.fstat(2)
    except OSError:
        return False
    return True


def _server_key() -> tuple:
    """What a forkserver's ranks get from the server rather than from the launcher at launch
    time: the environment the server imported torch under (read at import by torch, OpenMP, MKL,
    CUDA, the dynamic loader, and by any module a rank's function lives in, which the rank imports
    before ``_child`` runs). Per-launch variables (_PER_LAUNCH_ENV_PREFIXES, _PER_LAUNCH_ENV_NAMES)
    are left out: no import reads them, and ``_child`` gives the rank the launcher's environment of the
    moment. multiprocessing hands each rank the launcher's sys.path and working directory, and
    ``spawn`` the launcher's stdout and stderr where both are open (pytest's capfd, for one,
    points them at a new file per test); where one is closed, the server is restarted whenever
    that changes and its ranks inherit the server's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_PER_LAUNCH_ENV_PREFIXES) and k not in _PER_LAUNCH_ENV_NAMES}
    if _stdout_and_stderr_open():
        return env, None
    return env, tuple(_stdio_identity(fd) for fd in range(3))


def _stdio_identity(fd: int):
    """What a file descriptor is open on (device, inode); None where it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _forkserver_for_this_environment() -> bool:
    """A forkserver's ranks inherit what the server started with (``_server_key``), not the
    launcher's at launch time; restart the server when that differs, so that ranks see what a
    fresh interpreter would (and torch is imported under the same environment). A server is
    reused across launches otherwise: starting one imports torch (seconds).
    False if it cannot be restarted."""
    global _forkserver_started_under
    now = _server_key()
    server = mp.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None and now != _forkserver_started_under:
        stop = getattr(server, "_stop", None)
        if stop is None:
            return False
        stop()
    _set_preload(_server_preload())  # also what multiprocessing restarts a dead server with
    _forkserver_started_under = now
    return True


def start_forkserver_early(preload: tuple = ()) -> bool:
    """Start now the forkserver the next ``spawn`` would start (its imports take seconds), so that
    a process waiting for its turn -- a benchmark's next run, say -- has it ready, with ``preload``'s
    modules imported too (what its ranks will import: their function's module, inductor's; not
    where their import kept its children from using the GPU, see
    ``_forkserver_children_can_use_cuda``); returns once it is ready. The launch reuses it while
    the environment stays as it is now (``_forkserver_for_this_environment``). True if a
    forkserver runs; False where ranks start another way."""
    return start_method() == "forkserver" and _forkserver_ready(preload)


def _exit_code_for_fork_state() -> None:
    """A forkserver child's report: exit code 3 when torch refuses CUDA in it ("Cannot re-initialize
    CUDA in forked subprocess"), as it does in every process forked after the server touched CUDA
    -- initialised it, or only asked ``torch.cuda.is_available()``, which an import may do."""
    import torch
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)  # absent from builds without CUDA
    sys.exit(3 if in_bad_fork is not None and in_bad_fork() else 0)


def _fork_one_child(target: Callable = int) -> int:
    """Fork one child from the forkserver (started now if it is not running), wait for it and return
    its exit code. (Like every process started from a forkserver, the child imports the caller's
    __main__ module where it has a file: a script calling this needs the usual
    `if __name__ == "__main__":` guard.)"""
    child = mp.get_context("forkserver").Process(target=target, daemon=True)
    child.start()
    child.join()
    return child.exitcode


def _forkserver_children_can_use_cuda() -> bool:
    """Whether the forkserver's children can use the GPU, by one probe child: not where the server
    touched CUDA (an import in its preload may, see ``_exit_code_for_fork_state``), nor where the
    probe failed otherwise. Where they cannot, a server with more than torch's imports preloaded is
    started again with those only, and probed again; if its children cannot either, False (ranks
    then start from fresh interpreters), with one line, and False at once for later launches in
    the same environment. A server that passes is not probed again; nothing is probed where torch
    sees no GPU."""
    global _forkserver_checked_pid, _forkserver_refused_under
    import torch
    if not torch.cuda.is_available():
        return True
    if _forkserver_refused_under is not None and _forkserver_refused_under == _forkserver_started_under:
        return False
    server = mp.forkserver._forkserver
    stop = getattr(server, "_stop", None)
    while True:
        if server._forkserver_pid is not None and server._forkserver_pid == _forkserver_checked_pid:
            return True
        code = _fork_one_child(_exit_code_for_fork_state)
        if code == 0:
            _forkserver_checked_pid = server._forkserver_pid
            return True
        why = "cannot use CUDA" if code == 3 else f"fail to start (a probe exited with code {code})"
        preloaded = list(getattr(server, "_preload_modules", ()))
        extra = [m for m in preloaded if m not in _FORKSERVER_PRELOAD and m != _SERVER_SETUP]
        if stop is not None:
            stop()
        if not extra or stop is None:
            break
        print(f"asyncpp: children of the forkserver {why} with {', '.join(extra)} preloaded: started again "
              f"with {', '.join(_FORKSERVER_PRELOAD)} only", file=sys.stderr, flush=True)
        _set_preload(_FORKSERVER_PRELOAD)
    print(f"asyncpp: children of the forkserver {why} with {', '.join(_FORKSERVER_PRELOAD)} preloaded: ranks "
          f"start from fresh interpreters (set {START_METHOD_ENV}=spawn to skip the forkserver)",
          file=sys.stderr, flush=True)
    _forkserver_refused_under = _forkserver_started_under
    return False
