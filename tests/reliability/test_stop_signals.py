"""SIGTERM to ``asyncpp-train``'s launcher alone (a scheduler's stop, ``kill PID``) ends the run as
Ctrl-C does: each rank prints its line and stops, the launcher says so and exits 128 + 15, and no
rank trains on after it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncpp_ext.training.checkpoint import list_checkpoints
from asyncpp_ext.training.run_files import read_metrics
from group_signals import ctrl_c, sigint_by_default


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _start_training(run, **popen) -> subprocess.Popen:
    """A 2-stage 2bw run of many steps (a checkpoint every 5) in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "asyncpp_ext.train", "--model", "tiny", "--seq-len", "32", "--stages", "2",
         "--schedule", "2bw", "--steps", "100000", "--ckpt-every", "5", "--threads", "1", "--no-progress",
         "--out", str(run)],
        stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)


def _wait_for_rows(launcher: subprocess.Popen, run, rows: int = 3) -> None:
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < rows:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.2)


def _wait_for_checkpoint(launcher: subprocess.Popen, run) -> None:
    """Rows, then the checkpoint written just after a segment's rows (a stop's --resume hint needs it)."""
    _wait_for_rows(launcher, run)
    deadline = time.monotonic() + 60
    while not list_checkpoints(run):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.1)


def test_sigterm_to_the_launcher_stops_every_rank_with_a_line(tmp_path):
    run = tmp_path / "run"
    launcher = _start_training(run, stdout=subprocess.PIPE,
                               # as a script's background job runs (and CI's): SIGINT ignored, inherited by every rank
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        _wait_for_checkpoint(launcher, run)
        family = {launcher.pid} | {c for p in _children(launcher.pid) for c in [p, *_children(p)]}
        os.kill(launcher.pid, signal.SIGTERM)  # to the launcher only, not its process group
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("asyncpp-train: stopped by SIGTERM; continue with --resume"), err
    assert sum(line.startswith("asyncpp: rank ") and line.endswith("stopped by SIGTERM") for line in lines) == 2, err
    rows = len(read_metrics(run))
    time.sleep(2)
    assert len(read_metrics(run)) == rows  # nothing trains on
    alive = [p for p in family if os.path.exists(f"/proc/{p}") and
             open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert alive == [], alive


def test_ranks_die_with_a_killed_launcher_at_once(tmp_path):
    """SIGKILL to the launcher (no handler runs): its forkserver's ranks die with it, before the
    forkserver itself has gone (it takes a second or more to exit, time in which a rank would train
    and write on). The forkserver is held stopped here, so a rank that waited for it lives on."""
    run = tmp_path / "run"
    launcher = _start_training(run, stdout=subprocess.DEVNULL, env={**os.environ, "ASYNCPP_START_METHOD": "forkserver"})
    servers = []
    try:
        _wait_for_rows(launcher, run)
        servers = [p for p in _children(launcher.pid) if len(_children(p)) == 2]
        assert len(servers) == 1, "expected one forkserver holding both ranks"
        ranks = _children(servers[0])
        os.kill(servers[0], signal.SIGSTOP)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_running(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(p) for p in ranks), "ranks outlived their launcher"
        rows = len(read_metrics(run))
        time.sleep(1)
        assert len(read_metrics(run)) == rows
    finally:
        for server in servers:
            for p in [server, *_children(server)]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _forkservers(launcher: int) -> list[int]:
    found = []
    for p in _children(launcher):
        try:
            if "forkserver" in open(f"/proc/{p}/cmdline").read():
                found.append(p)
        except FileNotFoundError:
            pass
    return found


def _importing_torch(pids: list[int]) -> bool:
    """Whether one of ``pids`` has mapped a file of torch's (its site module is imported by then)."""
    for p in pids:
        try:
            if "/torch/" in open(f"/proc/{p}/maps").read():
                return True
        except (FileNotFoundError, ProcessLookupError):
            pass
    return False


def test_ctrl_c_while_the_ranks_forkserver_starts_is_one_line(tmp_path):
    """Ctrl-C to the whole process group (a terminal's) while the forkserver imports torch: the
    launcher's line only; neither the server nor a rank whose start was queued there prints a
    traceback."""
    launcher = _start_training(tmp_path / "run", stdout=subprocess.DEVNULL, preexec_fn=sigint_by_default,
                               env={**os.environ, "ASYNCPP_START_METHOD": "forkserver"})
    try:
        deadline = time.monotonic() + 60
        while not _importing_torch(_forkservers(launcher.pid)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.01)
        # the server is importing torch (seconds); not earlier: a Ctrl-C while a new interpreter
        # imports its site module is Python's own fatal error, before any code of ours runs
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    time.sleep(1)  # anything a leftover process would still print has reached the pipe's end by now
    assert launcher.returncode == 130, err
    assert err.strip().splitlines() == ["asyncpp-train: interrupted"], err


def test_ctrl_c_mid_run_is_each_ranks_interrupted_line_and_the_launchers(tmp_path):
    """Ctrl-C to the whole process group (a terminal's) while the ranks train: each rank ends on
    its own SIGINT with "interrupted" (the launcher waits a moment before stopping any: a SIGTERM
    landing as a rank handles its SIGINT replaced its line), no rank reports the peer it then
    loses, and the launcher's line ends it."""
    run = tmp_path / "run"
    launcher = _start_training(run, stdout=subprocess.DEVNULL, preexec_fn=sigint_by_default)
    err = ctrl_c(launcher, lambda: _wait_for_checkpoint(launcher, run))
    assert launcher.returncode == 130, err
    lines = [line for line in err.strip().splitlines() if line]
    assert sorted(lines[:-1]) == ["asyncpp: rank 0: interrupted", "asyncpp: rank 1: interrupted"], err
    assert lines[-1] == f"asyncpp-train: interrupted; continue with --resume {run}", err


_SWALLOWING_IMPORT = """
import os, signal, sys, time
from asyncpp_ext.commands import _import_then_run

def load():  # an import that catches everything, as torch's import of numpy does
    try:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(5)
    except BaseException:
        pass
    return lambda argv: 0

raise SystemExit(_import_then_run("prog", load, []))
"""


def test_a_stop_signal_during_the_imports_ends_with_one_line_even_if_an_import_swallows_it():
    for name, code, line in [("SIGINT", 130, "prog: interrupted while starting"),
                             ("SIGTERM", 143, "prog: stopped by SIGTERM while starting")]:
        r = subprocess.run([sys.executable, "-c", _SWALLOWING_IMPORT, name], capture_output=True, text=True,
                           timeout=60, preexec_fn=sigint_by_default)
        assert (r.returncode, r.stderr.strip()) == (code, line), (name, r.returncode, r.stderr)
    # a process that ignores SIGINT (a background job) goes on ignoring it
    r = subprocess.run([sys.executable, "-c", _SWALLOWING_IMPORT, "SIGINT"], capture_output=True, text=True,
                       timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert (r.returncode, r.stderr) == (0, ""), r.stderr


def test_ctrl_c_during_asyncpp_trains_imports_is_one_line():
    r = subprocess.Popen([sys.executable, "-m", "asyncpp_ext.train", "--help"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=sigint_by_default)
    time.sleep(0.5)  # importing torch takes seconds
    r.send_signal(signal.SIGINT)
    _, err = r.communicate(timeout=60)
    assert (r.returncode, err.strip()) == (130, "asyncpp-train: interrupted while starting"), err


def test_a_stop_signal_the_process_ignores_stays_ignored():
    """nohup sets SIGHUP ignored so a closed terminal does not stop the run; a background job
    ignores SIGINT. The handlers set for a block leave those alone, and come back after it."""
    from asyncpp_ext.stop_signals import signals_handled, stop_signals_raise

    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (CI's job ignores it)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals_raise():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))  # not ignored: raised as Stopped
        with signals_handled(lambda *_: None):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
        assert {s: signal.getsignal(s) for s in before} == {**before, signal.SIGHUP: signal.SIG_IGN,
                                                             signal.SIGINT: signal.default_int_handler}
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)



DROPPED_STOP_SCRIPT = r"""
import signal, sys, time, weakref
from asyncpp_ext.stop_signals import stop_signals_raise
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever started this
number = getattr(signal, sys.argv[1])

class Thing:
    pass

def callback(ref):  # run by the interpreter, not the program: what it raises is dropped
    signal.raise_signal(number)
    for _ in range(1000):
        pass  # the handler runs in here

try:
    with stop_signals_raise():
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
        start = time.monotonic()
        while time.monotonic() - start < 10:
            time.sleep(0.01)
        print("ran on")
except KeyboardInterrupt as stop:
    print(f"stopped: {type(stop).__name__} after {time.monotonic() - start:.3f} s")
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_raised_where_python_drops_it_is_raised_again(name):
    """A signal handled inside a weakref callback (or a __del__ the garbage collector runs) raised
    its exception where Python drops it ("Exception ignored in ...") and the run went on: once,
    in CI, a rank that got the launcher's SIGTERM so trained on and reported its peer lost."""
    r = subprocess.run([sys.executable, "-c", DROPPED_STOP_SCRIPT, name], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("stopped: " + ("Stopped" if name == "SIGTERM" else "KeyboardInterrupt")), r.stdout
    assert float(r.stdout.split()[-2]) < 1.0
    assert "Exception ignored" not in r.stderr, r.stderr
