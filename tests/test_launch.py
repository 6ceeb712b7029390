"""How `spawn` starts ranks: forkserver (torch preloaded) or fresh interpreters, same environment."""
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import re
import sys

import pytest

from asyncpp_ext.pipeline import launch, spawn, start_method as starts
from asyncpp_ext.pipeline.ipc import slots_from_env


def report_environment(out_dir: str) -> None:
    rank = os.environ["RANK"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"value": os.environ.get("ASYNCPP_TEST_VALUE"), "parent": os.getppid(),
                   "per_launch": os.environ.get("PYTEST_ASYNCPP_PROBE"), "cwd": os.getcwd(),
                   "dynamo_loaded": "torch._dynamo" in sys.modules,
                   "training_loaded": "asyncpp_ext.training.distributed" in sys.modules,
                   "ipc_slots": slots_from_env()}, f)


def fail_beside_a_collective() -> None:
    """Rank 1 fails by itself; rank 0 is left in an all-reduce with it."""
    import torch
    import torch.distributed as dist
    launch.init_distributed(30)
    if dist.get_rank() == 1:
        raise ValueError("rank 1's own failure")
    dist.all_reduce(torch.ones(4))


def say(word: str) -> None:
    sys.stderr.write(f"rank {os.environ['RANK']} says {word}\n")
    sys.stderr.flush()


def read_a_file_cut_short(path: str) -> None:
    """Rank 1 memory-maps a token file, which is then cut short, and reads past the cut (SIGBUS)."""
    if os.environ["RANK"] != "1":
        return
    import numpy as np

    tokens = np.memmap(path, dtype="<u2", mode="r")
    os.truncate(path, 0)
    int(tokens[len(tokens) - 1])


def test_a_rank_killed_by_sigbus_is_named_with_the_likely_cause(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\1\0" * 100_000)
    with pytest.raises(launch.LaunchError, match=r"^rank 1 was killed by signal 7 \(SIGBUS: a memory-mapped "
                                                 r"file, such as a token file, was cut short while the rank read it\)"):
        spawn(read_a_file_cut_short, 2, (str(path),))


def die_before_the_rendezvous() -> None:
    """Rank 0, which serves the rendezvous, dies first; rank 1 waits in torch's store client,
    native code where no Python signal handler runs, so it cannot say anything itself."""
    import signal

    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    launch.init_distributed(120)


def test_a_rank_the_launcher_has_to_end_gets_a_line_all_the_same(capfd):
    with pytest.raises(launch.LaunchError, match=r"^rank 0 was killed by signal 9"):
        spawn(die_before_the_rendezvous, 2, grace_s=1)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("asyncpp: ")]
    assert lines == ["asyncpp: rank 1: stopped by the launcher 1 s after rank 0 failed, without a line of its own"]


def _launch_and_read(tmp_path, name: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    spawn(report_environment, 2, (str(out),))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_see_the_launchers_environment_at_each_launch(method, tmp_path, monkeypatch):
    if method not in mp.get_all_start_methods():
        pytest.skip(f"no {method} on this platform")
    monkeypatch.setenv(starts.START_METHOD_ENV, method)
    monkeypatch.setenv("ASYNCPP_TEST_VALUE", "first")
    first = _launch_and_read(tmp_path, "first")
    server_pid = mp.forkserver._forkserver._forkserver_pid
    # a second launch with the same environment matters for a forkserver only (it is reused)
    again = _launch_and_read(tmp_path, "again") if method == "forkserver" else []
    assert [r["value"] for r in first + again] == ["first"] * (len(first) + len(again))
    monkeypatch.setenv("ASYNCPP_TEST_VALUE", "second")  # a forkserver must not hand out the old value
    second = _launch_and_read(tmp_path, "second")
    assert [r["value"] for r in second] == ["second", "second"]
    if method == "forkserver":
        # ranks are the server's children; the server is reused while the environment stays the
        # same and restarted when it changes
        assert {r["parent"] for r in first + again} == {server_pid}
        assert {r["parent"] for r in second} == {mp.forkserver._forkserver._forkserver_pid} != {server_pid}
    else:
        assert {r["parent"] for r in first + second} == {os.getpid()}


@pytest.mark.parametrize("value, expected", [("", None), ("auto", None), (" Spawn ", "spawn"),
                                             ("forkserver", "forkserver")])
def test_start_method_from_the_environment(value, expected, monkeypatch):
    monkeypatch.setenv(starts.START_METHOD_ENV, value)
    if expected == "forkserver" and "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    auto = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    assert starts.start_method() == (expected or auto)


def test_unknown_start_method_is_refused_before_any_rank_starts(monkeypatch, tmp_path):
    monkeypatch.setenv(starts.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="ASYNCPP_START_METHOD='fork' is not one of auto, forkserver, spawn"):
        spawn(report_environment, 2, (str(tmp_path),))
    assert list(tmp_path.iterdir()) == []


def test_ranks_write_to_the_launchers_current_stderr(tmp_path):
    """A launcher that points its stderr elsewhere between launches gets its ranks' lines there,
    as ranks started from fresh interpreters would (a forkserver hands them the launcher's
    stderr of the moment, and is kept: pytest's capfd points stderr at a new file per test)."""
    spawn(say, 2, ("before",))
    server_pid = mp.forkserver._forkserver._forkserver_pid
    saved = os.dup(2)
    try:
        with open(tmp_path / "stderr.txt", "w") as log:
            os.dup2(log.fileno(), 2)
            spawn(say, 2, ("after",))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    lines = sorted((tmp_path / "stderr.txt").read_text().splitlines())
    assert lines == ["rank 0 says after", "rank 1 says after"], lines
    if starts.start_method() == "forkserver":
        assert mp.forkserver._forkserver._forkserver_pid == server_pid


def test_a_per_test_variable_keeps_the_forkserver_and_still_reaches_the_ranks(tmp_path, monkeypatch):
    """pytest rewrites PYTEST_CURRENT_TEST before every test: the server (and its torch import)
    is kept across such changes, while each rank still gets the launcher's environment and
    working directory of the moment."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    monkeypatch.setenv("PYTEST_ASYNCPP_PROBE", "one")
    first = _launch_and_read(tmp_path, "first")
    server_pid = mp.forkserver._forkserver._forkserver_pid
    monkeypatch.setenv("PYTEST_ASYNCPP_PROBE", "two")
    monkeypatch.chdir(tmp_path / "first")
    second = _launch_and_read(tmp_path, "second")
    assert {r["parent"] for r in first + second} == {server_pid}
    assert [r["per_launch"] for r in first + second] == ["one"] * 2 + ["two"] * 2
    assert [r["cwd"] for r in second] == [str(tmp_path / "first")] * 2


def test_a_transport_knob_keeps_the_forkserver_and_still_reaches_the_ranks(tmp_path, monkeypatch):
    """The transports' variables are read by a rank as it builds its transport, after its imports:
    a change of one between launches keeps the server (and its imports), and each rank reads the
    launcher's value of the moment. The names the launcher treats so are those the transports read."""
    from asyncpp_ext.pipeline import ipc, sockets

    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    assert set(starts._PER_LAUNCH_ENV_NAMES) == {sockets.RECV_SPIN_ENV, sockets.INLINE_RECV_ENV, sockets.HOST_ENV,
                                                 ipc.IPC_SLOTS_ENV, starts.START_METHOD_ENV}
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    monkeypatch.setenv(ipc.IPC_SLOTS_ENV, "2")
    first = _launch_and_read(tmp_path, "first")
    monkeypatch.setenv(ipc.IPC_SLOTS_ENV, "5")
    second = _launch_and_read(tmp_path, "second")
    assert len({r["parent"] for r in first + second}) == 1
    assert [r["ipc_slots"] for r in first + second] == [2, 2, 5, 5]


def test_forkserver_ranks_find_torch_dynamo_and_their_entry_module_imported(tmp_path, monkeypatch):
    """Creating any torch optimizer imports torch._dynamo (seconds); the server has done it, and
    imported the module of every rank's entry point (launch._child), which a rank would otherwise
    import first thing, whatever its function."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    ranks = _launch_and_read(tmp_path, "ranks")
    assert [r["dynamo_loaded"] for r in ranks] == [True, True]
    # the entry module imports the package's extension: the server (the ranks' parent) holds it
    maps = f"/proc/{ranks[0]['parent']}/maps"
    if os.path.exists(maps):
        with open(maps) as f:
            assert "asyncpp_ext/_C" in f.read()


def test_a_forkserver_started_early_is_the_one_the_launch_forks_from(tmp_path, monkeypatch):
    """start_forkserver_early: a process waiting for its turn has the server (and its imports)
    ready; the launch that follows in the same environment forks its ranks from it."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    monkeypatch.setenv("ASYNCPP_TEST_VALUE", "early")  # an environment no earlier test's server started under
    assert starts.start_forkserver_early(preload=("asyncpp_ext.training.distributed",))
    early = mp.forkserver._forkserver._forkserver_pid
    assert early is not None
    ranks = _launch_and_read(tmp_path, "ranks")
    assert {r["parent"] for r in ranks} == {early} and [r["value"] for r in ranks] == ["early"] * 2
    # the server's own preload, with the module asked for (which nothing else here imports)
    assert all(r["dynamo_loaded"] and r["training_loaded"] for r in ranks)
    monkeypatch.setenv(starts.START_METHOD_ENV, "spawn")
    assert not starts.start_forkserver_early()  # ranks would not start from a server


def report_bad_fork(out_dir: str) -> None:
    import torch
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", lambda: False)()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"bad_fork": in_bad_fork, "parent": os.getppid()}, f)


@pytest.fixture
def gpu_seen_and_fresh_servers(monkeypatch):
    """torch "sees" a GPU in the launcher (so the forkserver's children are checked), and no
    forkserver outlives the test (its preload is the test's)."""
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(starts, "_forkserver_checked_pid", None)  # both restored afterwards
    monkeypatch.setattr(starts, "_forkserver_refused_under", None)
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    monkeypatch.setenv("ASYNCPP_TEST_VALUE", "poisoned")  # no earlier test's server is reused
    # the server imports its preload from a fresh interpreter's path: tests/cuda_in_forkserver.py on it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                     os.environ.get("PYTHONPATH")])))
    yield
    mp.forkserver._forkserver._stop()


def _bad_fork_reports(tmp_path, name: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    spawn(report_bad_fork, 2, (str(out),))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _counting_probes(monkeypatch, readiness: list | None = None) -> list:
    """The probe children forked from now on (and, into ``readiness``, the readiness forks)."""
    probes = []
    real = starts._fork_one_child
    def counting(target=int):
        (probes if target is not int else readiness if readiness is not None else []).append(target)
        return real(target)
    monkeypatch.setattr(starts, "_fork_one_child", counting)
    return probes


def _asyncpp_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("asyncpp: ")]


@pytest.mark.parametrize("probe", ["bad-fork", "fails"])
def test_a_forkserver_whose_preload_keeps_its_children_from_cuda_is_started_again_without_it(
        tmp_path, capfd, monkeypatch, gpu_seen_and_fresh_servers, probe):
    """An import in the early server's preload that touches CUDA there would make every rank fail
    ("Cannot re-initialize CUDA in forked subprocess"), and a probe that fails says nothing good:
    the server is started again with torch's imports only, named in one line, and the ranks fork
    from that one, free to use CUDA; that server is not probed again."""
    if probe == "fails":
        monkeypatch.setenv("ASYNCPP_TEST_FORKSERVER_PROBE", "fails")
    readiness = []
    probes = _counting_probes(monkeypatch, readiness)
    assert starts.start_forkserver_early(preload=("cuda_in_forkserver",))
    assert readiness == []  # the passing probe showed the server ready: no second child for that
    why = "cannot use CUDA" if probe == "bad-fork" else "fail to start (a probe exited with code 1)"
    assert _asyncpp_lines(capfd.readouterr().err) == [
        f"asyncpp: children of the forkserver {why} with asyncpp_ext.pipeline.launch, cuda_in_forkserver "
        "preloaded: started again with torch, torch.distributed, torch._dynamo only"]
    server = mp.forkserver._forkserver._forkserver_pid
    ranks = _bad_fork_reports(tmp_path, "ranks")
    assert [r["bad_fork"] for r in ranks] == [False, False] and {r["parent"] for r in ranks} == {server}
    _bad_fork_reports(tmp_path, "again")
    assert len(probes) == 2  # the first server's, the second's; none at the launches that followed


def test_a_forkserver_whose_own_preload_keeps_its_children_from_cuda_gives_way_to_fresh_interpreters(
        tmp_path, capfd, monkeypatch, gpu_seen_and_fresh_servers):
    """Where even the server with only the base preload (here with an import that touches CUDA)
    has children that cannot use CUDA, ranks start from fresh interpreters instead (one line says
    so, after the one of the restart without the rank's entry module; no restart of a server like
    it), not from a server whose children cannot use CUDA."""
    monkeypatch.setattr(starts, "_FORKSERVER_PRELOAD", starts._FORKSERVER_PRELOAD + ["cuda_in_forkserver"])
    probes = _counting_probes(monkeypatch)
    ranks = _bad_fork_reports(tmp_path, "ranks")
    assert _asyncpp_lines(capfd.readouterr().err) == [
        "asyncpp: children of the forkserver cannot use CUDA with asyncpp_ext.pipeline.launch preloaded: started "
        "again with torch, torch.distributed, torch._dynamo, cuda_in_forkserver only",
        "asyncpp: children of the forkserver cannot use CUDA with torch, torch.distributed, torch._dynamo, "
        f"cuda_in_forkserver preloaded: ranks start from fresh interpreters (set {starts.START_METHOD_ENV}=spawn "
        "to skip the forkserver)"]
    assert len(probes) == 2
    assert [r["bad_fork"] for r in ranks] == [False, False]
    assert {r["parent"] for r in ranks} == {os.getpid()}  # started by the launcher itself
    # the next launch in the same environment goes straight to fresh interpreters, saying nothing
    ranks = _bad_fork_reports(tmp_path, "again")
    assert [r["bad_fork"] for r in ranks] == [False, False] and {r["parent"] for r in ranks} == {os.getpid()}
    assert capfd.readouterr().err.count("asyncpp: ") == 0 and len(probes) == 2


def test_no_probe_where_torch_sees_no_gpu(tmp_path, monkeypatch):
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    monkeypatch.setenv("ASYNCPP_TEST_VALUE", "no probe")  # no earlier test's server is reused
    readiness = []
    probes = _counting_probes(monkeypatch, readiness)
    _launch_and_read(tmp_path, "ranks")
    assert probes == [] and len(readiness) == 1  # the ranks start once the server is ready
    _launch_and_read(tmp_path, "again")
    assert probes == [] and len(readiness) == 1  # a server seen ready is not waited for again
    monkeypatch.setenv("ASYNCPP_TEST_VALUE", "a server of its own")  # started early, then: readied by one child
    assert starts.start_forkserver_early() and probes == [] and len(readiness) == 2
    mp.forkserver._forkserver._stop()


def fail_as_torch_in_a_bad_fork() -> None:
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                       "you must use the 'spawn' start method")


def test_a_rank_refused_cuda_in_a_fork_gets_the_way_out_named(monkeypatch):
    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no forkserver on this platform")
    monkeypatch.setenv(starts.START_METHOD_ENV, "forkserver")
    with pytest.raises(launch.LaunchError, match=r"forked subprocess.*all ranks have stopped; set "
                                                 r"ASYNCPP_START_METHOD=spawn to start ranks from fresh interpreters"):
        spawn(fail_as_torch_in_a_bad_fork, 2)


def test_a_collective_that_loses_its_peer_names_the_peers_failure_not_its_own(capfd):
    # rank 0's all-reduce fails when rank 1's process goes (gloo: the connection closed or reset by
    # the peer, depending on when the socket is read): rank 0
    # exits as one that lost a peer, so the launcher names rank 1's failure though both exit
    with pytest.raises(launch.LaunchError, match=r"rank 1 exited with code 1 \(rank 1's own failure\)"):
        spawn(fail_beside_a_collective, 2, grace_s=20)
    err = capfd.readouterr().err
    rank0 = next(line for line in err.splitlines() if line.startswith("asyncpp: rank 0: "))
    assert "Connection closed by peer" in rank0 or "Connection reset by peer" in rank0, rank0


def test_what_counts_as_losing_a_peer():
    from asyncpp_ext.pipeline.transport import TransportError
    assert launch.lost_a_peer(TransportError("recv failed"))
    assert launch.lost_a_peer(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert not launch.lost_a_peer(RuntimeError("CUDA out of memory"))
    assert not launch.lost_a_peer(ValueError("Connection closed by peer"))


def test_a_blocking_call_that_times_out_is_not_said_to_have_lost_its_peer():
    # gloo's timeout while the peer lives on (slow, or waiting elsewhere) is no answer in time; a
    # closed connection is a peer that has probably exited
    import torch
    from asyncpp_ext.pipeline.handshake import p2p
    from asyncpp_ext.pipeline.transport import TransportError

    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                           "30000ms for recv operation to complete")
    closed = RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    for error, words in ((timeout, "the peer did not answer in time (stalled, slow, waiting elsewhere, or "
                                   "failed): Timed out waiting 30000ms for recv operation to complete"),
                         (closed, "the peer has probably exited: Connection closed by peer [127.0.0.1]:1")):
        def send(tensor, dst, tag, error=error):  # stands in for dist.send
            raise error
        with pytest.raises(TransportError) as info:
            p2p(send, torch.zeros(1), stage=1, stage_ranks=[0, 1], peer=0, what="evaluation")
        assert str(info.value) == f"stage 1: evaluation with stage 0 (rank 0) failed -- {words}"


def test_spawn_refuses_more_ranks_than_the_cores_hold_before_starting_one(tmp_path):
    from asyncpp_ext.pipeline import devices

    too_many = devices.MAX_RANKS_PER_CORE * devices.usable_cores() + 1
    with pytest.raises(devices.DeviceError, match=f"spawn's nprocs is {too_many} ranks to start on this machine"):
        spawn(os.mkdir, too_many, (str(tmp_path / "started"),))
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize("timeout_s", [-5, 0, "soon", float("nan"), True])
def test_init_distributed_names_a_timeout_it_cannot_use(timeout_s):
    # before any rendezvous: a negative one failed inside torch's store after a C++ stack trace
    from asyncpp_ext.pipeline import init_distributed

    with pytest.raises(ValueError, match=re.escape(f"timeout_s={timeout_s!r} is not a positive number of seconds")):
        init_distributed(timeout_s)


@pytest.mark.multiproc
def test_a_script_that_spawns_when_imported_is_named_with_the_fix(tmp_path):
    # Without `if __name__ == "__main__":` each rank, importing the script as it starts, reaches the
    # spawn() call again: multiprocessing's "bootstrapping phase" traceback per rank and a launcher
    # line without a cause, until the rank names the fix itself.
    import subprocess

    script = tmp_path / "script.py"
    script.write_text("from asyncpp_ext.pipeline import spawn\n\n\ndef fn():\n    pass\n\n\nspawn(fn, 2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    fix = "put the call under `if __name__ == \"__main__\":`"
    assert done.returncode == 1 and "bootstrapping phase" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncpp_ext.pipeline.launch.LaunchError: rank 0 could not start: the script calls "
                           "spawn() when it is imported") and fix in last, done.stderr
    ranks = [line for line in done.stderr.splitlines() if line.startswith("asyncpp: a starting rank: ")]
    assert ranks and all(fix in line for line in ranks), done.stderr
