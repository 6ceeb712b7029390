"""A ``Pipeline.train`` stream ends consistently whatever the caller does: leaving the loop early
runs the stream's remaining steps (every rank runs all of them) and the pipeline goes on exactly,
and a stream that fails part-way leaves a pipeline that says so rather than one that replays the
failed batch or reports a version-rule error on the next call."""
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.optim import build_optimizer
from asyncpp_ext.pipeline import Pipeline, StageError


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _pipeline(loss_fn=GPT.loss):
    torch.manual_seed(0)
    return Pipeline(GPT(preset_config("tiny")), loss_fn=loss_fn, microbatches=2, schedule="2bw",
                    optimizer=lambda m: build_optimizer(m, "adamw", lr=1e-3), timeout_s=60)


def _batches(first, count):
    """Minibatch k of a fixed sequence (4 sequences of 8 tokens), for k in first..first+count-1."""
    out = []
    for k in range(first, first + count):
        g = torch.Generator().manual_seed(k)
        x = torch.randint(0, 256, (4, 9), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def test_leaving_the_loop_early_runs_the_stream_out_and_training_goes_on_exactly(one_rank):
    whole = [s.loss for s in _pipeline().train(_batches(0, 8), steps=8)]
    p = _pipeline()
    for stats in p.train(_batches(0, 6), steps=6):
        if stats.step == 1:
            break
    with pytest.warns(UserWarning, match=r"^Pipeline.train was left after step 1 of 0..5: its remaining steps "
                                         r"ran to the end now") as warned:
        assert p.next_step == 6  # waits for the rest of the stream
    assert warned[0].filename == __file__  # the line that waited, not the package's
    after = [s.loss for s in p.train(_batches(6, 2), steps=2)]
    assert after == whole[6:]  # the same arithmetic as one uninterrupted stream


def test_a_ctrl_c_while_the_rest_of_a_left_stream_runs_is_named_on_the_next_call(one_rank):
    import ctypes
    import threading
    import time

    def slow_loss(out, targets):  # about 2 s of stream left after the first step
        time.sleep(0.1)
        return GPT.loss(out, targets)

    p = _pipeline(slow_loss)
    stream = p.train(_batches(0, 10), steps=10)
    next(stream)
    start = time.monotonic()
    stream.close()  # leaves the loop: the rest runs on, and the next call waits for it
    assert time.monotonic() - start < 0.5
    # A KeyboardInterrupt raised in this thread (under pytest-xdist it is not the main thread,
    # which _thread.interrupt_main would reach).
    me = ctypes.c_ulong(threading.get_ident())
    ctrl_c = threading.Timer(0.3, lambda: ctypes.pythonapi.PyThreadState_SetAsyncExc(
        me, ctypes.py_object(KeyboardInterrupt)))
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            p.evaluate(_batches(0, 1))  # waits for the rest of the stream: interrupted there
    finally:
        ctrl_c.cancel()
    with pytest.raises(StageError, match=r"stopped part-way through a stream \(step \d+: KeyboardInterrupt\)"):
        list(p.train(_batches(0, 1), steps=1))
    for worker in threading.enumerate():  # the stream's worker finishes in the background
        if worker.name.startswith("asyncpp-stage"):
            worker.join(60)


def test_a_stream_that_failed_part_way_is_named_on_the_next_call(one_rank):
    calls = []

    def loss_failing_on_step_2(out, targets):
        calls.append(1)
        if len(calls) == 5:  # two microbatches a step: the first of step 2
            raise ValueError("the loss cannot be computed")
        return GPT.loss(out, targets)

    p = _pipeline(loss_failing_on_step_2)
    with pytest.raises(ValueError, match="the loss cannot be computed"):
        list(p.train(_batches(0, 4), steps=4))
    for again in (lambda: list(p.train(_batches(0, 1), steps=1)), lambda: p.evaluate(_batches(0, 1))):
        with pytest.raises(StageError, match=r"this Pipeline stopped part-way through a stream \(step 2: "
                                             r"ValueError: the loss cannot be computed\); build a new "
                                             r"Pipeline"):
            again()


def test_an_iterator_that_runs_out_is_named_and_not_a_version_error_next(one_rank):
    p = _pipeline()
    with pytest.raises(StageError, match="the batch iterator ran out before step 2"):
        list(p.train(_batches(0, 2), steps=4))
    with pytest.raises(StageError, match="stopped part-way"):
        list(p.train(_batches(0, 4), steps=4))


def test_breaking_out_of_many_streams_then_exiting_is_a_clean_exit(tmp_path):
    script = textwrap.dedent("""
        import torch, torch.distributed as dist, warnings
        from asyncpp_ext.models import GPT, preset_config
        from asyncpp_ext.optim import build_optimizer
        from asyncpp_ext.pipeline import Pipeline
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        x = torch.randint(0, 256, (4, 8))
        for _ in range(5):
            p = Pipeline(GPT(preset_config("tiny")), loss_fn=GPT.loss, microbatches=2, schedule="2bw",
                         optimizer=lambda m: build_optimizer(m, "adamw"), timeout_s=60)
            for stats in p.train([(x, x)] * 20, steps=20):
                break
        print("done", p.next_step)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout.split()) == (0, ["done", "20"]), r.stderr[-2000:]
    assert "terminate called" not in r.stderr


def test_a_rank_stopped_by_its_caller_does_not_report_the_peer_it_then_loses(one_rank):
    # A Ctrl-C / SIGTERM reaches every rank: the first to leave closes its connections, and the
    # worker of a rank already stopped then finds its peer gone. That rank said why it stopped; a
    # "lost a peer" state block after it would point at the wrong cause. Unstopped, it is on record.
    import ctypes
    import threading

    from asyncpp_ext.pipeline.peer_errors import TransportError

    release = threading.Event()

    class PeerGoesAway:  # the stage's run: blocked until released, then its peer is gone
        def run_stage(self, *args, **kwargs):
            release.wait(30)
            raise TransportError("stage 0: recv from stage 1 failed -- stage 1 closed the connection")

    def run(interrupt):
        p = _pipeline()
        p.transport, dumps = PeerGoesAway(), []
        p.watchdog.dump_state = dumps.append
        stream = p.train(_batches(0, 4), steps=4)
        if interrupt:  # raised in this thread (under pytest-xdist it is not the main thread)
            me = ctypes.c_ulong(threading.get_ident())
            threading.Timer(0.3, lambda: ctypes.pythonapi.PyThreadState_SetAsyncExc(
                me, ctypes.py_object(KeyboardInterrupt))).start()
            with pytest.raises(KeyboardInterrupt):
                next(stream)
            release.set()
        else:
            with pytest.raises(TransportError, match="closed the connection"):
                next(stream)
        for worker in threading.enumerate():
            if worker.name.startswith("asyncpp-stage"):
                worker.join(30)
        return dumps

    assert run(interrupt=True) == []
    assert run(interrupt=False) == ["lost a peer: this rank's state as its transport failed"]


def _slow_pipeline():
    """At least 0.05 s per microbatch: a 40-step stream of 2 microbatches takes 4 s or more."""
    def slow_loss(out, targets):
        time.sleep(0.05)
        return GPT.loss(out, targets)

    return _pipeline(slow_loss)


def test_an_exception_in_the_loop_body_surfaces_at_once_and_the_next_call_finishes_the_stream(one_rank):
    p = _slow_pipeline()
    start = time.monotonic()
    with pytest.raises(NameError):
        for stats in p.train(_batches(0, 40), steps=40):
            raise NameError("a typo in the loop's body")
    assert time.monotonic() - start < 2.0  # not after the stream's 4 s or more
    with pytest.warns(UserWarning, match="left after step 0 of 0..39: its remaining steps ran to the end now") as warned:
        assert p.evaluate(_batches(0, 1)) is not None  # waits for the rest (through torch.no_grad's wrapper)
    assert warned[0].filename == __file__
    losses = [s.loss for s in p.train(_batches(10, 2), steps=2)]
    assert p.next_step == 42 and len(losses) == 2


def test_an_exception_leaving_a_with_block_stops_the_stream(one_rank):
    p = _slow_pipeline()
    start = time.monotonic()
    with pytest.raises(NameError), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ran to the end": nothing runs on
        with p:
            for stats in p.train(_batches(0, 40), steps=40):
                raise NameError("a typo in the loop's body")
    assert time.monotonic() - start < 2.0  # not after the stream's 4 s or more
    assert not any(t.name.startswith("asyncpp-stage") for t in threading.enumerate())
    with pytest.raises(StageError, match=r"stopped part-way through a stream \(step 1: stopped by close\(\)\)"):
        list(p.train(_batches(0, 1), steps=1))


_EXIT_SCRIPT = """
import sys, time, torch, torch.distributed as dist
from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.optim import build_optimizer
from asyncpp_ext.pipeline import Pipeline
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x = torch.randint(0, 256, (4, 8))
p = Pipeline(GPT(preset_config("tiny")), loss_fn=GPT.loss, microbatches=2, schedule="2bw",
             optimizer=lambda m: build_optimizer(m, "adamw"), timeout_s=60)
steps = int(sys.argv[2])
for stats in p.train([(x, x)] * steps, steps=steps):
    if stats.step == 1:
        print("left at", time.monotonic(), flush=True)
        if sys.argv[1] == "raise":
            raise NameError("a typo in the loop's body")
        break
"""


def test_a_script_that_breaks_and_exits_runs_its_stream_out_first():
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, "break", "30"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Pipeline.train was left after step 1 of 0..29: its remaining steps run to the end before the " \
           "process exits" in r.stderr
    assert "terminate called" not in r.stderr


def test_a_script_ending_on_an_exception_in_the_loop_body_does_not_run_its_stream_out():
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, "raise", str(10**7)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.rstrip().endswith("NameError: a typo in the loop's body"), \
        r.stderr[-2000:]
    assert time.monotonic() - start < 120  # 10**7 steps would take hours
    assert "run to the end" not in r.stderr and "terminate called" not in r.stderr


def test_calls_while_a_stream_runs_are_refused_and_the_stream_goes_on(one_rank):
    p = _pipeline()
    stream = p.train(_batches(0, 6), steps=6)
    first = next(stream)
    for call, name in ((lambda: list(p.train(_batches(6, 1), steps=1)), "train"),
                       (lambda: p.evaluate(_batches(0, 1)), "evaluate"),
                       (p.state_dict, "state_dict")):
        with pytest.raises(StageError, match=rf"^stage 0: {name}\(\) was called while a train\(\) stream of "
                                             r"this Pipeline still runs: finish or leave its loop first"):
            call()
    rest = [s.step for s in stream]
    assert [first.step] + rest == list(range(6)) and p.next_step == 6
    assert [s.step for s in p.train(_batches(6, 2), steps=2)] == [6, 7]


def _one_step_then_peer_gone(release: threading.Event):
    """A pipeline whose stage runs one step, waits for ``release``, then finds its peer gone;
    its stream (one step taken) and the state blocks its watchdog would have written."""
    from asyncpp_ext.pipeline.peer_errors import TransportError

    class OneStepThenPeerGoesAway:
        def run_stage(self, schedule, stages, m, n, stage, first_step, host, *args, **kwargs):
            host.on_step(first_step, 1.0)
            release.wait(30)
            raise TransportError("stage 0: recv from stage 1 failed -- stage 1 closed the connection")

    p = _pipeline()
    p.transport, dumps = OneStepThenPeerGoesAway(), []
    p.watchdog.dump_state = dumps.append
    stream = p.train(_batches(0, 4), steps=4)
    next(stream)
    return p, stream, dumps


@pytest.mark.parametrize("quieted", [True, False])
def test_a_left_stream_of_a_process_ending_on_its_own_failure_reports_nothing_more(one_rank, quieted):
    # A rank whose loop's body raised (a Ctrl-C landing there) writes its line and exits; its left
    # stream, still running meanwhile, may find the peer gone: launch.py quiets it first.
    from asyncpp_ext.pipeline.stream_worker import quiet_running_streams

    release = threading.Event()
    p, stream, dumps = _one_step_then_peer_gone(release)
    stream.close()  # left: its worker runs on
    if quieted:
        quiet_running_streams()
    release.set()
    p._worker.join()
    assert dumps == ([] if quieted else ["lost a peer: this rank's state as its transport failed"])


def test_a_caller_stopped_just_after_its_peer_left_reports_no_lost_peer(one_rank):
    # A Ctrl-C reaches every rank; the first to stop closes its connections a moment before this
    # rank has handled its own: its stream's failure waits PEER_LOSS_GRACE_S for that before it
    # blames the peer.
    from asyncpp_ext.pipeline.peer_errors import TransportError

    release = threading.Event()
    release.set()  # the peer is gone at once
    p, stream, dumps = _one_step_then_peer_gone(release)
    threading.Timer(0.1, p._worker.interrupted.set).start()  # this rank's own Ctrl-C, handled 0.1 s later
    with pytest.raises(TransportError):
        next(stream)
    assert dumps == []
