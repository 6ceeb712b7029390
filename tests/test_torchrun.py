"""asyncpp-train under torchrun (the multi-machine launcher): the same losses as the local launcher,
and a wrong process count or a missing --out ends every rank with one message (the refusals each
rank makes on its own are checked in this process, as a rank of torchrun's environment)."""
import json
import subprocess
import sys

import pytest

from asyncpp_ext.training.cli import main
from run_holder import run_dir_held

pytestmark = pytest.mark.multiproc

FLAGS = ["--model", "tiny", "--stages", "2", "--microbatches", "2", "--micro-batch-size", "2", "--seq-len", "16",
         "--steps", "4", "--eval-every", "2", "--ckpt-every", "4", "--optimizer", "muon", "--no-progress"]


def _torchrun(nproc, port, argv, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "asyncpp_ext.train", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_gives_the_local_launchers_losses(tmp_path, free_port):
    r = _torchrun(2, free_port, FLAGS + ["--out", str(tmp_path / "torchrun")])
    assert r.returncode == 0, r.stderr
    assert main(FLAGS + ["--out", str(tmp_path / "local")]) == 0
    got, want = _metrics(tmp_path / "torchrun"), _metrics(tmp_path / "local")
    assert [row["step"] for row in got] == [1, 2, 3, 4]
    for key in ("loss", "eval_loss"):
        assert [row.get(key) for row in got] == [row.get(key) for row in want]  # bitwise
    assert (tmp_path / "torchrun" / "ckpt-000004" / "meta.json").exists()
    assert (tmp_path / "torchrun" / "loss.png").stat().st_size > 0  # drawn by the rank that writes the metrics


def _as_torchrun_rank(monkeypatch, rank: int, world: int) -> None:
    """This process as rank ``rank`` of a torchrun of ``world`` (its environment variables)."""
    from asyncpp_ext.pipeline.launch import _SPAWNED_ENV

    monkeypatch.delenv(_SPAWNED_ENV, raising=False)
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank), ("MASTER_PORT", 29999)):
        monkeypatch.setenv(name, str(value))


def test_torchrun_with_the_wrong_process_count_stops_every_rank(tmp_path, monkeypatch, capsys):
    # Each rank refuses on its own once torchrun's process group has formed (every rank sees the
    # same count), before it writes anything; rank 0 of 3 here, its rendezvous stood in for (a
    # real torchrun's ranks: test_torchrun_gives_the_local_launchers_losses and the ones below).
    from asyncpp_ext.training import distributed

    _as_torchrun_rank(monkeypatch, 0, 3)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: (0, 3))
    assert main(FLAGS + ["--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "asyncpp-train: error: torchrun started 3 processes but --stages 2 x --dp 1 needs 2; start 2 processes in "
        "all (--nproc-per-node times --nnodes) or change --stages / --dp"]
    assert not (tmp_path / "run").exists()


def test_torchrun_without_out_is_refused(tmp_path, monkeypatch, capsys):
    # every rank would make a run directory of its own, named by its clock
    _as_torchrun_rank(monkeypatch, 1, 2)
    monkeypatch.chdir(tmp_path)
    assert main(FLAGS) == 2
    assert capsys.readouterr().err.splitlines() == [
        "asyncpp-train: error: under torchrun pass --out DIR: every rank must write to the same run directory"]
    assert list(tmp_path.iterdir()) == []


def test_a_rank_whose_peers_never_come_stops_after_timeout_in_one_line(tmp_path, free_port):
    # the environment torchrun gives rank 0 of 2, and no rank 1: the rendezvous waits --timeout,
    # not the default 300 s, and the rank says so in one line, having written nothing
    import os
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port))
    r = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", *FLAGS, "--timeout", "2",
                        "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncpp-train: error: torchrun's process group did not "
                                                   "form within --timeout 2 s ("), r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, what", [(["--simulate"], "--simulate runs in one process"),
                                        (["--stages", "1"], "--stages 1 x --dp 1 is one process")])
def test_a_one_process_run_under_a_torchrun_of_two_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, capsys, argv, what):
    # every rank would train the same run into the same --out; the environment torchrun gives
    # rank 0 of 2 (no rendezvous is needed to refuse)
    _as_torchrun_rank(monkeypatch, 0, 2)
    assert main(FLAGS + argv + ["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"asyncpp-train: error: {what}, but torchrun started 2; run it without torchrun (or with "
                   "--nproc-per-node 1), or give --stages / --dp for 2 processes"
                   + (" and drop --simulate" if "--simulate" in argv else "")], err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a torchrun of one runs it
    assert main(FLAGS + argv + ["--steps", "1", "--out", str(tmp_path / "one")]) == 0


def test_under_torchrun_a_rank_that_lost_its_peer_ends_with_one_line_and_exit_3(monkeypatch, capsys):
    # torchrun's ranks run the trainer in the command's own process: a transport error there (a peer
    # died) is its line "asyncpp: rank R: ..." and exit 3, as a spawned rank's, not a traceback;
    # other errors reach the command's own messages unchanged
    from asyncpp_ext.pipeline.peer_errors import TransportError
    from asyncpp_ext.pipeline.watchdog import EXIT_PEER_LOST
    from asyncpp_ext.training import distributed
    from asyncpp_ext.training.config import RunConfig

    _as_torchrun_rank(monkeypatch, 1, 2)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: (1, 2))
    monkeypatch.setattr(distributed.dist, "broadcast_object_list", lambda *args, **kwargs: None)  # from rank 0:
    cfg = RunConfig()                                                                           # its directory made
    cfg.pipeline.stages, cfg.train.out = 2, "unused"
    for error, outcome in ((TransportError("stage 1: recv failed -- stage 0 closed the connection\nmore"), "line"),
                           (ValueError("a bug"), ValueError)):
        def rank_main(*args, error=error):
            raise error
        monkeypatch.setattr(distributed, "rank_main", rank_main)
        if outcome == "line":
            with pytest.raises(SystemExit) as stop:
                distributed.launch(cfg, None, prepare=lambda: None)
            assert stop.value.code == EXIT_PEER_LOST
            assert capsys.readouterr().err == ("asyncpp: rank 1: stage 1: recv failed -- stage 0 closed the "
                                               "connection\n")
        else:
            with pytest.raises(outcome, match="a bug"):
                distributed.launch(cfg, None, prepare=lambda: None)


def test_a_failed_torchrun_rank_with_its_worker_running_leaves_without_the_teardown(tmp_path):
    # A stopped or failed rank's stage worker may still be inside the transport's native code; the
    # teardown would end that daemon thread under it (an abort: "terminate called without an active
    # exception"), so such a rank leaves with os._exit, as spawned ranks do. Seen here by an atexit
    # hook, which the teardown would run; the rank fails (a one-process run in a world of 2), with
    # a stand-in for the worker thread or without one (then it ends as usual, as does a rank that
    # ends well).
    import os

    worker = ("import threading, time; threading.Thread(target=time.sleep, args=(60,), name='asyncpp-stage0', "
              "daemon=True).start(); ")
    code = ("import atexit, runpy; atexit.register(print, 'teardown ran', flush=True); "
            "runpy.run_module('asyncpp_ext.train', run_name='__main__')")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    env.pop("ASYNCPP_LOCAL_SPAWN", None)
    argv = [*FLAGS, "--simulate", "--out", str(tmp_path / "run")]
    for prefix, world, status, torn_down in (("", "2", 2, True), (worker, "2", 2, False), (worker, "1", 0, True)):
        env["WORLD_SIZE"] = world
        r = subprocess.run([sys.executable, "-c", prefix + code, *argv], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == status and ("teardown ran" in r.stdout) == torn_down, (prefix, world, r.stdout,
                                                                                       r.stderr)
        if status:
            assert r.stderr.startswith("asyncpp-train: error: --simulate runs in one process"), r.stderr


def test_under_torchrun_an_out_in_use_ends_every_rank_with_rank_0s_reason(tmp_path, free_port):
    # rank 0 finds --out held by another run; the other ranks end with its reason at once (they
    # waited for torchrun to stop them, then pointed at the other run's --out with "--resume")
    run = tmp_path / "r"
    with run_dir_held(run) as holder:
        r = _torchrun(2, free_port, FLAGS + ["--out", str(run)])
    ours = sorted(line for line in r.stderr.splitlines() if line.startswith("asyncpp-train: "))
    reason = f"--out {run} is in use by another run (pid {holder} on "
    assert len(ours) == 2, r.stderr
    assert ours[0].startswith(f"asyncpp-train: error: {reason}"), ours
    assert ours[1].startswith(f"asyncpp-train: error: rank 0 could not start the run: {reason}"), ours
    # (torchrun may still stop rank 1 after its line, as it exits: a rank's end is not ours to time)
    assert "[rank" not in r.stderr and "stopped by SIGTERM" not in r.stderr
    assert not (run / "metrics.jsonl").exists()


def test_under_torchrun_its_sigterm_stops_every_rank_with_a_checkpoint(tmp_path, free_port):
    """torchrun passes a SIGTERM (a preemption's) on to its workers and waits for them: with
    --stop-on-signal TERM they stop at one step with a checkpoint. torchrun itself then exits
    non-zero with its own report of the signal."""
    import signal

    from group_signals import signal_once_training

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port), "-m", "asyncpp_ext.train", "--model", "tiny", "--stages", "2",
           "--steps", "1000000", "--eval-every", "50", "--ckpt-every", "1000", "--threads", "1", "--no-progress",
           "--stop-on-signal", "TERM", "--signal-response", "1s", "--timeout", "30", "--out", str(run)]
    _, out, err = signal_once_training(cmd, run, signal.SIGTERM)
    rows = _metrics(run)
    stopped = rows[-1]["step"]
    assert rows[-1]["stopped"] == "SIGTERM" and [r["step"] for r in rows] == list(range(1, stopped + 1))
    assert sorted(p.name for p in (run / f"ckpt-{stopped:06d}").glob("stage*")) == ["stage-00.pt", "stage-01.pt"]
    assert f"SIGTERM (--stop-on-signal): stopped at step {stopped} of 1000000" in out, (out, err)
    assert "asyncpp: rank" not in err, err  # no rank failed
