"""A row of bench/gpu_throughput.py as a process: its own process group (killed whole on timeout
and when the bench stops), its output in files, the peak memory of a multi-process row sampled,
and the start of a row's process ahead of its turn (``--prestart``): it imports while the row
before it runs and waits at a gate (``wait_for_turn``) until the bench gives it its turn. Also
``timeline``: where a row's wall time went, from the process's times and its steps' clock."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from proc_memory import tree_pss

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
# A row's process started ahead (RowProcess(gated=True)) finds GATE_ENV set: it imports what it
# needs, builds what the CPU alone can, prints READY_TAG and the time, and waits for its turn (a
# line on its stdin) before it touches the device -- a device context of its own would count in the
# running row's sampled memory, and its kernels in the running row's time. GATE_ENV's value
# "forkserver" has a pipeline's launcher start its forkserver first (pipeline/launch.py).
GATE_ENV = "GPU_THROUGHPUT_GATED"
READY_TAG = "GPU_THROUGHPUT_READY "


def child_env(gate: str | None = None) -> dict:
    env = dict(os.environ, **OFFLINE_ENV,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop(GATE_ENV, None)
    if gate:
        env.update({GATE_ENV: gate, "GPU_THROUGHPUT_BENCH_DIR": str(BENCH)})
    return env


def wait_for_turn() -> None:
    """In a row's process started ahead (GATE_ENV): say it is ready, then wait for its turn; leave
    at once if the bench went away or dropped the row (its stdin closed without a word)."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()  # its context counted in the running row
    print(READY_TAG + repr(time.time()) + (" cuda" if cuda else ""), flush=True)
    if not sys.stdin.readline():
        os._exit(3)


@contextlib.contextmanager
def signals_held():
    """SIGTERM and SIGINT held until the block ends, then handled as they would have been: a process
    started inside is registered (RowProcess.live) before a stopping bench looks for it, and a
    cleanup inside runs to its end. (In the main thread only, where Python handles signals.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held, which = [], {signal.SIGTERM, signal.SIGINT}
    # (blocked while the handlers change, so that no signal lands between two of them)
    signal.pthread_sigmask(signal.SIG_BLOCK, which)
    try:
        previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in which}
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, which)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, which)
        try:
            for s, handler in previous.items():  # None: a handler not set from Python; the default
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, which)
        for s in held:
            signal.raise_signal(s)


class MemorySampler:
    """Peak memory of a multi-process run, sampled: on CUDA the device memory in use (NVML, or
    nvidia-smi) minus what was in use before; on CPU the summed PSS (else RSS) of the process tree."""

    def __init__(self, device: str, root_pid_fn, interval: float = 0.2):
        self.device, self.root_pid_fn, self.interval = device, root_pid_fn, interval
        self.peak, self.kind, self._stop = None, None, threading.Event()
        self._read = self._gpu_reader() if device == "cuda" else self._tree_pss
        self.base = self._read(None) if device == "cuda" else 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _gpu_reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.kind = "nvml"
            return lambda _: sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)
        except Exception:  # no pynvml: nvidia-smi, slower
            if shutil.which("nvidia-smi") is None:
                return lambda _: None
            self.kind = "nvml"

            def smi(_):
                q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True)
                try:
                    return sum(int(x) for x in q.stdout.split()) * 2 ** 20
                except ValueError:
                    return None
            return smi

    def _tree_pss(self, _):
        root = self.root_pid_fn()
        if root is None:
            return None
        self.kind = "pss"
        return tree_pss(root)

    def _loop(self):
        while not self._stop.is_set():
            value = self._read(None)
            if value is not None:
                value -= self.base or 0
                self.peak = value if self.peak is None else max(self.peak, value)
            self._stop.wait(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


class RowProcess:
    """A row's process: its own process group (killed whole on timeout, and when this process is
    stopped: SIGTERM, Ctrl-C), output to files. ``gated``: started ahead, it waits after its imports
    (wait_for_turn) until ``finish`` gives it its turn. (A process group of its own keeps a row's ranks
    together; nothing else would stop them with the bench, and an orphaned row would go on using the
    GPU the next rows measure.)"""

    live: list = []  # started and not yet finished or dropped: what a stopping bench drops (drop_live)

    def __init__(self, cmd: list, gated: str | None = None):
        self.cmd, self.started = cmd, time.time()
        self.gated = bool(gated)
        # Output to files, not pipes: the row ends when its first process does. What it leaves
        # behind in its group (a launcher's fork server, inductor's compile workers) would hold a pipe
        # open until it exits by itself; it is killed instead, its work being done.
        # (errors="replace": a process killed mid-write may cut a character in two)
        self.out = tempfile.TemporaryFile("w+", errors="replace")
        self.err = tempfile.TemporaryFile("w+", errors="replace")
        with signals_held():  # a SIGTERM mid-Popen would leave the child running, unknown to drop_live
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(gated), stdout=self.out, stderr=self.err,
                                         stdin=subprocess.PIPE if gated else subprocess.DEVNULL, text=True,
                                         start_new_session=True)
            RowProcess.live.append(self)

    def finish(self, timeout: float, sampler_device: str | None = None) -> dict:
        """Give the process its turn and wait for it (``timeout`` seconds from now): stdout,
        stderr, rc (None on timeout), seconds (from the turn), sampled_peak/kind (``sampler_device``),
        the wall-clock times: started, turn, ready (a gated process's, from its READY_TAG line),
        ended; and notes (a gated process that initialised CUDA before its turn)."""
        turn, start = time.time(), time.monotonic()
        sampler = MemorySampler(sampler_device, lambda: self.proc.pid) if sampler_device else None
        timed_out = False
        try:
            if self.gated:
                try:
                    self.proc.stdin.write("go\n")
                    self.proc.stdin.close()
                except OSError:  # it has already exited (an import failed): its output says why
                    pass
            if sampler:
                sampler.__enter__()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            self.kill()
        except BaseException:  # the bench is stopping (a Ctrl-C, or SIGTERM raised as a KeyboardInterrupt)
            self.kill()
            raise
        finally:
            if sampler:
                sampler.__exit__(None, None, None)
        ended = time.time()
        stdout, stderr = self._read()
        self._forget()
        ready = [ln[len(READY_TAG):].split() for ln in stdout.splitlines() if ln.startswith(READY_TAG)]
        notes = ["initialised CUDA before its turn: its context was in device memory beside the row before"
                 for fields in ready if "cuda" in fields[1:]]
        return dict(rc=None if timed_out else self.proc.returncode, stdout=stdout, stderr=stderr,
                    seconds=time.monotonic() - start, sampled_peak=sampler.peak if sampler else None,
                    sampled_kind=sampler.kind if sampler else None, notes=notes,
                    started=self.started, turn=turn, ready=float(ready[0][0]) if ready else None, ended=ended)

    def kill(self) -> None:
        """The process and whatever it left in its group."""
        _kill_process_group(self.proc)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def drop(self) -> None:
        """A process whose turn will not come or whose row is cut short (the bench is stopping)."""
        self.kill()
        self.out.close()
        self.err.close()
        self._forget()

    @classmethod
    def drop_live(cls) -> None:
        """Every process started and not finished: a stopping bench leaves none behind."""
        with signals_held():  # a second SIGTERM does not cut the cleanup short
            for proc in list(cls.live):
                proc.drop()

    def _forget(self) -> None:
        if self in RowProcess.live:
            RowProcess.live.remove(self)

    def _read(self) -> tuple[str, str]:
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read() or "")
            f.close()
        return texts[0], texts[1]


def run_process(cmd: list, timeout: float, sampler_device: str | None = None) -> dict:
    """Run ``cmd`` as a row's process (RowProcess), from start to end."""
    return RowProcess(cmd).finish(timeout, sampler_device)


def wall_times(res: dict, clock_start: float | None, clock_end: float | None = None) -> dict:
    """A row's process on the wall clock (Unix seconds): started, ready (started ahead), turn, its
    clock's start (and end, a row without steps), ended -- what ``timeline`` and ``beside_measured``
    read."""
    times = {k: res.get(k) for k in ("started", "ready", "turn", "ended")}
    times.update(clock_start=clock_start, clock_end=clock_end)
    return {k: round(v, 3) for k, v in times.items() if v is not None}


def timeline(times: dict, elapsed: list) -> dict:
    """Where a row's wall time went, in seconds, from its ``times`` (wall_times) and its steps'
    ``elapsed``: ``ahead`` (a process started ahead: from its start to its gate, overlapped with
    the row before), ``start`` (from its turn to its clock: imports, device and model set-up, a
    launcher's ranks), ``first_step`` (compiles, captures, warm-up allocations), ``steps`` (the
    rest of its steps), ``end`` (from the last step to the process's end). A row without steps
    (the head-loss pair) has ``work`` from its clock's start to its end instead."""
    t = {}
    if "ready" in times:  # what it did before its turn (a process ready late did the rest after)
        t["ahead"] = round(min(times["ready"], times["turn"]) - times["started"], 2)
    if "clock_start" not in times:
        return t
    clock = times["clock_start"]
    t["start"] = round(clock - times["turn"], 2)
    if elapsed:
        t.update(first_step=round(elapsed[0], 2), steps=round(elapsed[-1] - elapsed[0], 2),
                 end=round(times["ended"] - clock - elapsed[-1], 2))
    elif "clock_end" in times:
        t.update(work=round(times["clock_end"] - clock, 2), end=round(times["ended"] - times["clock_end"], 2))
    return t


def beside_measured(row: dict, later: dict, warmup: int) -> str | None:
    """A note for ``row`` when ``later``'s process, started ahead, was still importing while
    ``row``'s measured steps ran (on the CPU only: it waits for its turn before the device), or
    None. Both rows carry ``times`` (wall_times) and ``row`` its steps' ``elapsed_s``."""
    t, u, elapsed = row.get("times") or {}, later.get("times") or {}, row.get("elapsed_s") or []
    if "clock_start" not in t or "ready" not in u:
        return None
    if "clock_end" in t:  # a row without steps (the head-loss pair): all of its measuring
        first, last, what = t["clock_start"], t["clock_end"], "measuring"
    elif len(elapsed) > warmup >= 1:
        first, last, what = t["clock_start"] + elapsed[warmup - 1], t["clock_start"] + elapsed[-1], "measured steps"
    else:
        return None
    overlap = min(u["ready"], last) - max(u["started"], first)
    if overlap <= 0:
        return None
    return f"the next row's process imported beside {overlap:.1f} s of its {last - first:.1f} s of {what}"


def _kill_process_group(proc) -> None:
    from asyncpp_ext.gpu_check.runner import kill_process_group  # the package, once the root is on sys.path
    kill_process_group(proc)
