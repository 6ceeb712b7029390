"""Stopping a stream that its caller left running (pipeline/stream_worker.py): the transports'
``cancel``, the C++ socket transport's close while a wait runs, and a library user's script
interrupted mid-stream, which must end with no worker thread left for the interpreter's teardown
(a thread ended there inside native code aborts the process)."""
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import transport_workers as tw
from asyncpp_ext import _C as C
from asyncpp_ext.pipeline.stream_worker import StreamWorker

TESTS = os.path.dirname(os.path.abspath(__file__))


def _socket_pair():
    """Stage 0 and stage 1 of a two-stage pipeline, connected over 127.0.0.1 in this process."""
    listeners = [C.SocketListener("127.0.0.1"), C.SocketListener("127.0.0.1")]
    channels = [[(0, True, 1, 1, "127.0.0.1", listeners[1].port), (1, False, 1, 1, "", 0)],
                [(0, False, 0, 0, "", 0), (1, True, 0, 0, "127.0.0.1", listeners[0].port)]]
    boards = [C.MessageBoard(tw._SlotHost(4)) for _ in range(2)]
    made = {}

    def make(stage):  # each constructor blocks until its channels are connected
        made[stage] = C.SocketTransport(stage, listeners[stage], channels[stage], 7, 10.0, boards[stage])

    threads = [threading.Thread(target=make, args=(stage,)) for stage in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made[0], made[1], boards


def _wait_in_thread(transport, request):
    """Wait for ``request`` on a thread of its own (as the executor does); the outcome and the
    time it took land in the returned dict once the thread ends."""
    result = {}

    def run():
        start = time.monotonic()
        try:
            transport.wait(request, 20.0)
            result["error"] = None
        except RuntimeError as e:
            result["error"] = str(e)
        result["waited_s"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_cancel_ends_a_socket_wait_at_once_and_fails_later_requests():
    stage0, stage1, _ = _socket_pair()
    waiter, result = _wait_in_thread(stage0, stage0.post_recv(1, 0, 0, 1))  # a gradient that never comes
    time.sleep(0.3)
    stage0.cancel("the pipeline was closed")
    waiter.join(5)
    assert not waiter.is_alive()
    assert result["error"].startswith("stage 0: socket transport: the pipeline was closed")
    assert result["waited_s"] < 2.0  # not its 20 s deadline
    with pytest.raises(RuntimeError, match="the pipeline was closed"):
        stage0.post_recv(1, 1, 0, 1)
    # Posted until retired: a report written as the failure unwinds still names the transfer.
    assert stage0.pending_descriptions() == [
        "stage 0: recv gradient (step 0, microbatch 0) from stage 1 (rank 1, 16 bytes) (failed with the transport)"]
    # The sockets are shut down: the neighbour's wait fails as for a peer that exited.
    with pytest.raises(RuntimeError, match="closed the connection"):
        stage1.wait(stage1.post_recv(0, 0, 0, 0), 5.0)
    stage0.close()
    stage1.close()


def test_close_while_a_wait_runs_fails_the_wait_before_the_sockets_go():
    stage0, stage1, _ = _socket_pair()
    waiter, result = _wait_in_thread(stage0, stage0.post_recv(1, 0, 0, 1))
    time.sleep(0.3)
    stage0.close()  # returns once the waiting thread has left its poll
    waiter.join(5)
    assert not waiter.is_alive()
    assert result["error"].startswith("stage 0: socket transport: closed while recv gradient (step 0, microbatch 0) from stage 1")
    assert result["waited_s"] < 2.0
    with pytest.raises(RuntimeError, match="closed while"):
        stage0.post_send(0, 0, 0, 1)
    stage1.close()


def test_a_cancelled_socket_transport_still_delivers_what_was_done():
    """Cancel fails only what is pending: a transfer completed before it is retired normally."""
    stage0, stage1, boards = _socket_pair()
    boards[0].put_send(0, 0, 0, torch.arange(4.0))
    stage0.wait(stage0.post_send(0, 0, 0, 1), 5.0)
    stage1.wait(stage1.post_recv(0, 0, 0, 0), 5.0)
    assert boards[1].received(0, 0, 0).tolist() == [0.0, 1.0, 2.0, 3.0]
    stage1.cancel("stopped")
    assert stage1.pending() == 0
    stage0.close()
    stage1.close()


def test_stop_cancels_and_joins_the_worker():
    cancelled = threading.Event()
    reasons = []

    def cancel(reason):
        reasons.append(reason)
        cancelled.set()

    worker = StreamWorker(lambda: cancelled.wait(20), 0, cancel)
    worker.start()
    assert worker.stop("closing") is True
    assert reasons == ["closing"] and worker.interrupted.is_set() and not worker.thread.is_alive()
    assert worker.stop("again") is True and reasons == ["closing"]  # an ended worker is left alone


def test_stop_warns_when_the_worker_does_not_end():
    release = threading.Event()
    worker = StreamWorker(lambda: release.wait(20), 3, lambda reason: None, stop_timeout_s=0.2)
    worker.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert worker.stop("closing") is False
    assert [str(w.message) for w in caught] == [
        "stage 3: the stream's worker thread did not stop within 0.2 s of being cancelled (it waits on a peer); "
        "its transport is left open"]
    release.set()
    worker.join()


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["socket", "ipc", "gloo"])
@pytest.mark.parametrize("mode", ["with", "bare"])
def test_a_script_interrupted_mid_stream_ends_without_its_worker(mode, transport, free_port):
    """Rank 0 is interrupted at step 5 of a stream of 10**7 steps; rank 1 runs on. Rank 0's
    worker is stopped by close() (``with``) or by the exit hook (``bare``); stopping it ends its
    transport, so rank 1's stream fails naming its lost peer. Neither process may keep a worker
    into its teardown, abort, or run on."""
    _interrupt_rank_0(mode, transport, "cpu", free_port)


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["with", "bare"])
def test_a_script_interrupted_mid_stream_on_a_gpu_ends_without_its_worker(mode, free_port):
    """The same with both stages on GPU 0 over the ipc transport (the stream's waits poll while
    the device computes)."""
    _interrupt_rank_0(mode, "ipc", "cuda", free_port)


def _interrupt_rank_0(mode: str, transport: str, device: str, port: int) -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(TESTS, "interrupted_stream_script.py")
    ranks = [subprocess.Popen([sys.executable, script, mode, transport, device], env=dict(env, RANK=str(rank)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
             for rank in (0, 1)]
    try:
        errors = [p.communicate(timeout=180)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for rank, (p, err) in enumerate(zip(ranks, errors)):
        assert "terminate called" not in err, f"rank {rank} aborted:\n{err}"
        assert err.rstrip().endswith("after the exit hooks: worker running=False"), f"rank {rank}:\n{err[-3000:]}"
    assert ranks[0].returncode == -signal.SIGINT, errors[0][-3000:]
    assert "KeyboardInterrupt" in errors[0]
    assert ranks[1].returncode == 1, errors[1][-3000:]
    assert "TransportError" in errors[1] and "rank 0" in errors[1], errors[1][-3000:]


@pytest.mark.multiproc
@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_ranks_that_leave_their_stream_and_return_run_it_out_before_they_end(transport, tmp_path):
    import json

    from asyncpp_ext.pipeline import spawn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spawn(tw.break_and_return_worker, 2, (transport, str(tmp_path)))  # raises LaunchError if a rank failed
    for rank in (0, 1):
        assert json.loads((tmp_path / f"left{rank}.json").read_text()) == "ran to the end"
