"""SIGTERM to ``asyncpp-train``'s launcher alone (a scheduler's stop, ``kill PID``) ends the run as
Ctrl-C does: each rank prints its line and stops, the launcher says so and exits 128 + 15, and no
rank trains on after it."""
import os
import signal
import subprocess
import sys
import time

from asyncpp_ext.training.run_files import read_metrics


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_to_the_launcher_stops_every_rank_with_a_line(tmp_path):
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "asyncpp_ext.train", "--model", "tiny", "--seq-len", "32", "--stages", "2",
         "--schedule", "2bw", "--steps", "100000", "--ckpt-every", "5", "--threads", "1", "--no-progress",
         "--out", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # as a script's background job runs (and CI's): SIGINT ignored, inherited by every rank
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 3:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
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
    launcher = subprocess.Popen(
        [sys.executable, "-m", "asyncpp_ext.train", "--model", "tiny", "--seq-len", "32", "--stages", "2",
         "--schedule", "2bw", "--steps", "100000", "--ckpt-every", "5", "--threads", "1", "--no-progress",
         "--out", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "ASYNCPP_START_METHOD": "forkserver"})
    servers = []
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 3:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
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
