"""asyncpp-prepare-data's helper processes and files: its tokenizer workers' start-up under Ctrl-C,
and what a run killed outright leaves behind (its workers, its temporary files)."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="signal masks and the parent-death signal are Linux's")


def _python(script: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.timeout(120)
def test_a_ctrl_c_while_a_worker_starts_prints_no_traceback_of_the_worker():
    """Each worker gets SIGINT as soon as it is started, while its interpreter imports: as a Ctrl-C
    at the terminal reaches it. It starts with SIGINT blocked and then ignores it, so it neither
    prints a KeyboardInterrupt traceback nor dies (the parent handles the Ctrl-C)."""
    proc = _python("""
        import os, signal, multiprocessing.context as context
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a background job ignores it)
        from asyncpp_ext.data.encode import ByteTokenizer, Task, ordered_encode

        start = context.SpawnProcess.start
        def start_then_interrupt(self):
            start(self)
            os.kill(self.pid, signal.SIGINT)
        context.SpawnProcess.start = start_then_interrupt
        tasks = [Task("text", [f"piece {i}\\n"], "x.txt", 0, [True]) for i in range(8)]
        print(sum(1 for _ in ordered_encode(iter(tasks), ByteTokenizer(), "bytes", "text", 2)))
    """)
    out, err = proc.communicate(timeout=100)
    assert (proc.returncode, out.strip(), err) == (0, "8", "")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_workers_end_when_the_command_is_killed_outright():
    """SIGKILL (or the out-of-memory killer) gives the command no chance to stop its workers; each
    would go on holding its tokenizer's memory, waiting on a queue it shares with no one."""
    proc = _python("""
        import multiprocessing, threading, time
        from asyncpp_ext.data.encode import ByteTokenizer, Task, ordered_encode

        class Sleeps:  # a task item whose unpickling keeps the worker busy
            def __reduce__(self):
                return time.sleep, (300,)

        def report():
            while len(multiprocessing.active_children()) < 2:
                time.sleep(0.05)
            time.sleep(1.0)  # the workers' start-up done
            print(*[p.pid for p in multiprocessing.active_children()], flush=True)

        threading.Thread(target=report, daemon=True).start()
        tasks = [Task("text", Sleeps(), "x.txt", 0, [True]) for i in range(2)]
        for _ in ordered_encode(iter(tasks), ByteTokenizer(), "bytes", "text", 2):
            pass
    """)
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(workers) >= 2 and all(_alive(pid) for pid in workers)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if _alive(pid)]
    finally:
        proc.kill()
    for pid in left:
        os.kill(pid, 9)
    assert left == []


def test_temporary_files_of_a_run_killed_outright_are_removed_by_the_next(tmp_path, capsys):
    """A run killed by SIGKILL leaves its hidden temporaries (each as large as the output it was
    becoming); the next run into the same directory removes those whose process is gone, and
    leaves a running process's alone."""
    from asyncpp_ext.data import prepare as prep
    from asyncpp_ext.data.sinks import temp_beside

    made = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from asyncpp_ext.data.sinks "
                           "import temp_beside; print(temp_beside(Path(sys.argv[1])))", str(tmp_path / "t.bin")],
                          capture_output=True, text=True, timeout=60, check=True)
    orphan = tmp_path / os.path.basename(made.stdout.strip())  # its process has exited
    live = temp_beside(tmp_path / "t.bin")  # this process's
    (tmp_path / "in.txt").write_text("text\n" * 10)
    assert orphan.exists() and orphan.name.startswith(".t.bin.") and orphan.name.endswith(".tmp")
    assert prep.main(["--tokenizer", "bytes", "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "t.bin")]) == 0
    assert "removed 1 temporary file(s) of a run killed before it ended" in capsys.readouterr().out
    assert not orphan.exists() and live.exists()


@pytest.mark.timeout(120)
def test_a_closed_or_full_stdout_after_the_outputs_are_in_place_is_no_traceback(tmp_path):
    """`asyncpp-prepare-data ... | head -c 0`: the reader is gone when the summary is printed; the
    outputs are complete, so the run ends as it would have (0), silently. A full stdout says so
    in one line, exit 1."""
    (tmp_path / "in.txt").write_text("text\n" * 10)
    argv = [sys.executable, "-m", "asyncpp_ext.data.prepare", "--tokenizer", "bytes", "--input",
            str(tmp_path / "in.txt"), "--out"]
    read, write = os.pipe()
    os.close(read)  # a reader that has gone
    closed = subprocess.run(argv + [str(tmp_path / "a.bin")], stdout=write, stderr=subprocess.PIPE, text=True,
                            timeout=100)
    os.close(write)
    assert (closed.returncode, closed.stderr) == (0, "") and (tmp_path / "a.bin").exists()
    with open("/dev/full", "w") as full:
        filled = subprocess.run(argv + [str(tmp_path / "b.bin")], stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=100)
    assert (filled.returncode, filled.stderr) == (1, "asyncpp-prepare-data: the outputs are complete, but the "
                                                     "summary could not be written (No space left on device)\n")
    assert (tmp_path / "b.bin").exists()
