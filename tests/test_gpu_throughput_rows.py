"""bench/throughput_rows.py and row_process.py: what a row keeps from its process -- the figures of
the steps it measured when it fails after them, and the package's own fallback warnings as notes
-- and its process: ended with whatever it left behind, started ahead of its turn and held there."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_throughput as gt  # noqa: E402
import row_process as rp  # noqa: E402
import throughput_rows as tr  # noqa: E402


def _process(run):
    """A stand-in for a row's process (row_process.RowProcess): ``run(cmd, timeout,
    sampler_device)`` writes what the process would and returns its result."""
    class FakeProcess:
        def __init__(self, cmd, gated=None):
            self.cmd, self.gated = cmd, gated

        def finish(self, timeout, sampler_device=None):
            res = run(self.cmd, timeout, sampler_device)
            return dict(dict(started=0.0, turn=0.0, ready=None, ended=res["seconds"]), **res)
    return FakeProcess


def test_a_row_that_fails_after_its_measured_steps_keeps_them(tmp_path, monkeypatch):
    # e.g. the profiler failing in the traced steps that come after the measured ones: the row's
    # figures stand, with a note; a row that fails before the last measured step is an error.
    def fake_run(steps_written):
        def run_process(cmd, timeout, sampler_device=None):
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            rows = [dict(step=k + 1, loss=5.0 - k / 10, elapsed_s=1.0 + k, tokens=64 * (k + 1)) for k in range(steps_written)]
            (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            return dict(rc=1, stdout="", stderr="RuntimeError: CUPTI failed\n", seconds=3.0, sampled_peak=None,
                        sampled_kind=None)
        return run_process
    args = SimpleNamespace(device="cpu", warmup=2, steps=3, threads=None, profile=True, row_timeout=60, keep=False)
    r = gt.row("ours sync adamw", "ours", "llama-tiny", 64, 2, 4, optimizer="adamw", compile=False, schedule="sync")
    monkeypatch.setattr(tr, "RowProcess", _process(fake_run(5)))
    kept = tr.run_ours(dict(r, notes=[]), args, dict(compile=True, head_loss=True), tmp_path / "a")
    assert kept["status"] == "ok" and kept["losses"] == [5.0, 4.9, 4.8, 4.7, 4.6]
    assert kept["notes"] == ["exited after its measured steps (error: RuntimeError: CUPTI failed)"]
    monkeypatch.setattr(tr, "RowProcess", _process(fake_run(4)))
    lost = tr.run_ours(dict(r, notes=[]), args, dict(compile=True, head_loss=True), tmp_path / "b")
    assert (lost["status"], lost["error"]) == ("error", "RuntimeError: CUPTI failed") and "losses" not in lost


def test_a_rows_fallback_warnings_become_its_notes(tmp_path, monkeypatch):
    # A variant whose feature fell back (capture, compile, the head's passes) ran as something other
    # than its name says: the package's "asyncpp: " lines in its stderr, each once, are its notes
    # (a head row gets its worker's); other stderr lines are not.
    stderr = []
    with warnings.catch_warnings(record=True) as caught:  # the messages as the package writes them
        warnings.simplefilter("always")
        warnings.warn("asyncpp: CUDA-graph capture failed (RuntimeError: x); this stage runs eagerly")
    # With this file's real path and line Python prints the warning's source line under it,
    # indented -- a line that holds "asyncpp: " too and must not become a second note.
    stderr.append(warnings.formatwarning(caught[0].message, caught[0].category, caught[0].filename, caught[0].lineno))
    assert "\n  warnings.warn(\"asyncpp: CUDA-graph" in stderr[0]
    stderr.append("asyncpp: torch.compile failed for layer blocks (boom); they run eagerly\n")  # logging's last resort
    stderr += [stderr[0], "W1126 torch/_inductor: some note of torch's own\n"]

    def run_process(cmd, timeout, sampler_device=None):
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(dict(step=k + 1, loss=5.0, elapsed_s=1.0 + k,
                                                                  tokens=64 * (k + 1))) + "\n" for k in range(5)))
        return dict(rc=0, stdout="", stderr="".join(stderr), seconds=3.0, sampled_peak=None, sampled_kind=None)
    monkeypatch.setattr(tr, "RowProcess", _process(run_process))
    args = SimpleNamespace(device="cpu", warmup=2, steps=3, threads=None, profile=False, row_timeout=60, keep=False)
    r = gt.row("ours sync adamw graphs", "ours", "llama-tiny", 64, 2, 4, optimizer="adamw", compile=True,
               schedule="sync")
    got = tr.run_ours(dict(r, notes=[]), args, dict(compile=True, head_loss=True), tmp_path)
    assert got["notes"] == ["warned: asyncpp: CUDA-graph capture failed (RuntimeError: x); this stage runs eagerly",
                            "warned: asyncpp: torch.compile failed for layer blocks (boom); they run eagerly"]
    worker = dict(status="ok", notes=got["notes"][:1], modes={"fused": dict(status="ok", head_seconds=0.01,
                                                                               peak_bytes=1, head_loss=1.0)})
    head = tr.head_row(dict(name="head-loss fused", head_mode="fused", notes=[]), worker)
    assert head["notes"] == got["notes"][:1]


def test_warnings_beyond_three_are_counted_not_listed():
    stderr = "".join(f"asyncpp: fallback {k}\n" for k in range(5))
    assert tr.package_warnings(stderr) == ["warned: asyncpp: fallback 0", "warned: asyncpp: fallback 1",
                                           "warned: asyncpp: fallback 2", "(+2 more in the row's stderr)"]


def test_a_row_ends_with_its_first_process_and_takes_what_it_left_behind(tmp_path):
    # a launcher's fork server or inductor's compile workers outliving the row's process would
    # hold its output open: the row ends when its own process does, and they are killed
    import time

    pid_file = tmp_path / "left.pid"
    script = f"import subprocess, sys; p = subprocess.Popen(['sleep', '120']); open({str(pid_file)!r}, 'w').write(str(p.pid)); print('done')"
    res = rp.run_process([sys.executable, "-c", script], timeout=100)
    assert res["rc"] == 0 and res["stdout"].strip() == "done", res
    assert res["seconds"] < 60  # not the leftover's 120 s
    left = int(pid_file.read_text())

    def alive():
        try:
            with open(f"/proc/{left}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 10  # SIGKILL is delivered, not awaited
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()
    res = rp.run_process([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
                         timeout=2)
    assert res["rc"] is None and res["stdout"].strip() == "started"


GATED_CHILD = ("import os, sys, time; sys.path.insert(0, os.environ['GPU_THROUGHPUT_BENCH_DIR']); "
               "from row_process import wait_for_turn; wait_for_turn(); print('turn at', repr(time.time()))")


def _written(f) -> str:
    """What a row's process has written to its output file so far (pread: the file's offset,
    which the writing child shares, stays where it is)."""
    return os.pread(f.fileno(), 1 << 16, 0).decode(errors="replace")


def test_a_process_started_ahead_waits_for_its_turn():
    # --prestart: the next row's process imports while the row before runs, but does nothing past
    # its gate (no device context, no kernels) until the bench gives it its turn
    import time

    proc = rp.RowProcess([sys.executable, "-c", GATED_CHILD], gated="1")
    deadline = time.monotonic() + 60
    while rp.READY_TAG not in _written(proc.out) and time.monotonic() < deadline:  # at its gate
        time.sleep(0.05)
    time.sleep(1.5)
    assert proc.proc.poll() is None  # still waiting
    res = proc.finish(timeout=60)
    assert res["rc"] == 0, res["stderr"]
    turn_seen = float(res["stdout"].split("turn at")[1])
    assert res["started"] < res["ready"] < res["turn"] <= turn_seen + 0.01 <= res["ended"] + 0.01
    assert res["turn"] - res["ready"] > 1.0  # it sat at the gate
    times = rp.wall_times(res, None)
    assert rp.timeline(times, []) == {"ahead": round(times["ready"] - times["started"], 2)}


def test_a_process_started_ahead_leaves_when_its_turn_never_comes():
    # the bench stopped, or a pipe closed without a word: the process goes, it does not run the row
    proc = rp.RowProcess([sys.executable, "-c", GATED_CHILD], gated="1")
    proc.proc.stdin.close()
    assert proc.proc.wait(timeout=60) == 3
    proc.drop()
    dropped = rp.RowProcess([sys.executable, "-c", GATED_CHILD], gated="1")
    assert proc not in rp.RowProcess.live and dropped in rp.RowProcess.live
    rp.RowProcess.drop_live()  # what a stopping bench does
    assert dropped.proc.poll() is not None and dropped.out.closed and dropped not in rp.RowProcess.live


def test_a_process_that_touches_the_device_before_its_turn_says_so():
    # its CUDA context would count in the running row's sampled memory: the row carries a note
    cuda = "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: {}))"
    child = ("import os, sys, types; sys.path.insert(0, os.environ['GPU_THROUGHPUT_BENCH_DIR']); {}; "
             "from row_process import wait_for_turn; wait_for_turn(); print('ran')")
    for initialised in (True, False):
        res = rp.RowProcess([sys.executable, "-c", child.format(cuda.format(initialised))], gated="1").finish(60)
        assert res["rc"] == 0 and "ran" in res["stdout"] and res["ready"] is not None
        assert res["notes"] == (["initialised CUDA before its turn: its context was in device memory beside the "
                                 "row before"] if initialised else [])


def test_a_row_timeline_splits_its_wall_time_at_its_clock():
    res = dict(started=100.0, ready=104.0, turn=110.0, ended=150.0)
    # the steps' clock started at 115 (5 s of set-up from the turn); steps ended at +20, +21, +22
    assert rp.timeline(rp.wall_times(res, 115.0), [20.0, 21.0, 22.0]) == dict(ahead=4.0, start=5.0, first_step=20.0,
                                                                               steps=2.0, end=13.0)
    # a row without steps (the head-loss pair): its work from clock start to end
    assert rp.timeline(rp.wall_times(dict(res, ready=None), 112.0, 140.0), []) == dict(start=2.0, work=28.0,
                                                                                      end=10.0)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # the process ended meanwhile
            pass
    return pids


@pytest.mark.multiproc
def test_a_stopped_bench_takes_its_running_row_with_it(tmp_path):
    # The runbook's `timeout` sends SIGTERM to the bench only: a row runs in a process group of its
    # own (its ranks stay together), which the bench must kill on the way out, or the orphaned row
    # goes on using the device the next runs measure.
    import signal
    import time

    # --prestart: the 2bw row's process, started ahead while the first row runs and waiting for its
    # turn, is the bench's to take with it too.
    work = tmp_path / "work"
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--device", "cpu",
                              "--smoke", "--threads", "1", "--only", "ours", "--prestart", "--workdir", str(work)],
                             cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def row_processes():  # the row's driver names its run directory under the workdir
        return [pid for pid in _processes_mentioning(str(work)) if pid != bench.pid]

    def in_group(pgid):  # the driver's process group: its ranks and their helpers too
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # pgrp; a zombie is already dead
                pids.append(int(stat.parent.name))
        return pids

    groups = None
    try:
        deadline = time.monotonic() + 120

        def groups_now():
            found = set()
            for pid in row_processes():
                try:
                    found.add(os.getpgid(pid))
                except ProcessLookupError:  # it ended meanwhile
                    pass
            return found
        groups = set()
        while len(groups) < 2 and time.monotonic() < deadline:  # the row and the one ahead started
            groups = groups_now()
            time.sleep(0.1)
        assert len(groups) == 2, "the running row and the one started ahead"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10  # SIGKILL is delivered, not awaited; an orphaned row would still run
        while (row_processes() or any(in_group(g) for g in groups)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert row_processes() == [] and all(in_group(g) == [] for g in groups)
    finally:
        bench.kill()
        for g in groups or ():
            if in_group(g):
                os.killpg(g, signal.SIGKILL)


def test_a_row_says_when_the_next_rows_start_up_ran_beside_its_measured_steps():
    # the row's steps' clock started at 100; warm-up 2 steps ended at +10, measured steps until +14
    row = dict(times=dict(started=90.0, turn=90.0, clock_start=100.0, ended=115.0),
               elapsed_s=[5.0, 10.0, 12.0, 14.0])
    later = dict(times=dict(started=90.0, ready=111.5, turn=115.0))  # importing until 111.5
    assert rp.beside_measured(row, later, warmup=2) == ("the next row's process imported beside 1.5 s of "
                                                       "its 4.0 s of measured steps")
    assert rp.beside_measured(row, dict(times=dict(started=90.0, ready=109.0, turn=115.0)), 2) is None  # ready before
    assert rp.beside_measured(row, dict(times=dict(started=115.0, turn=115.0)), 2) is None  # not started ahead
    res = dict(started=90.0, ready=None, turn=90.5, ended=115.0)
    assert rp.wall_times(res, 100.0) == dict(started=90.0, turn=90.5, ended=115.0, clock_start=100.0)
    # a row without steps (the head-loss pair): all of its measuring, clock start to end
    head = dict(times=rp.wall_times(res, 100.0, 106.0))
    assert rp.beside_measured(head, later, warmup=2) == ("the next row's process imported beside 6.0 s of its "
                                                        "6.0 s of measuring")


def test_a_signal_is_held_while_a_row_process_starts_and_handled_after():
    # a SIGTERM in the middle of Popen would leave a child the stopping bench does not know of
    import signal
    import time

    got, reached = [], []

    def handler(signum, frame):
        got.append(signum)
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(SystemExit):
            with rp.signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # delivered by now, and held
                reached.append(got == [])
        assert reached == [True] and got == [signal.SIGTERM]  # handled once, after the block
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
