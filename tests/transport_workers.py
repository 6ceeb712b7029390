"""Worker functions for the transport tests (importable by spawned ranks)."""
import json
import os

import torch
import torch.nn as nn

import pipeline_workers as w
from asyncpp_ext.pipeline import Pipeline, init_distributed
from asyncpp_ext.pipeline.transport import GlooTransport


def staged_train_worker(transport: str, force_staging: bool, steps: int, out_dir: str) -> None:
    """2bw on the shared 4-block model; ``force_staging`` sends every CPU tensor through the host
    staging path a CUDA tensor takes (a receive lands in a separate host tensor and is copied into
    the stage's buffer when its completion is seen)."""
    init_distributed(60)
    torch.set_num_threads(1)
    if force_staging:
        GlooTransport._staged = lambda self, tensor: True
    m = 2
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("adamw"),
                    schedule="2bw", microbatches=m, transport=transport, timeout_s=60)
    losses = [s.loss for s in pipe.train(w.batches(steps, m), steps)]
    if pipe.host.is_last:
        name = f"losses_{transport}_{'staged' if force_staging else 'direct'}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(losses, f)


def peer_exits_worker(transport: str) -> None:
    """Stage 1 leaves after one step; stage 0's transfers must fail naming the peer."""
    init_distributed(30)
    m = 2
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("sgd"),
                    schedule="2bw", microbatches=m, transport=transport, timeout_s=30)
    steps = 1 if pipe.stage == 1 else 20
    for _ in pipe.train(w.batches(steps, m), steps):
        pass
    if pipe.stage == 1:
        os._exit(0)


class _SlotHost:
    """A stage host for a bare MessageBoard: receive slots of a fixed number of float32 elements."""

    def __init__(self, numel: int):
        self.numel = numel

    def new_recv_buffer(self, kind: int) -> torch.Tensor:
        return torch.empty(self.numel)


def socket_mismatch_worker(out_dir: str) -> None:
    """Stage 0 sends 4 floats where stage 1 expects 5: stage 1 must fail naming both sizes, and
    stage 0 (waiting for a gradient that never comes) must fail because stage 1 closed the link."""
    from asyncpp_ext import _C as C
    from asyncpp_ext.pipeline.sockets import create_socket_transport

    rank, _ = init_distributed(30)
    board = C.MessageBoard(_SlotHost(4 if rank == 0 else 5))
    t = create_socket_transport(board, rank, 2, [0, 1], run_id="mismatch", timeout_s=30)
    try:
        if rank == 0:
            board.put_send(0, 0, 0, torch.ones(4))
            t.impl.wait(t.impl.post_send(0, 0, 0, 1), 20.0)
            t.impl.wait(t.impl.post_recv(1, 0, 0, 1), 20.0)
        else:
            t.impl.wait(t.impl.post_recv(0, 0, 0, 0), 20.0)
        message = None
    except RuntimeError as e:
        message = str(e)
    with open(os.path.join(out_dir, f"mismatch{rank}.json"), "w") as f:
        json.dump(message, f)


def socket_slots_worker(out_dir: str) -> None:
    """A 2bw run over the socket transport: receive slots stop growing once the pipeline is full."""
    init_distributed(60)
    torch.set_num_threads(1)
    m = 4
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("sgd"),
                    schedule="2bw", microbatches=m, transport="socket", timeout_s=60)
    data = w.batches(12, m)
    counts = []
    for steps in (3, 9):
        for _ in pipe.train(data, steps):
            pass
        counts.append([pipe.board.slot_count(0), pipe.board.slot_count(1), pipe.board.send_hold_count()])
    with open(os.path.join(out_dir, f"slots{pipe.stage}.json"), "w") as f:
        json.dump(counts, f)


def socket_spin_worker(out_dir: str, spin_us: int) -> None:
    """Receives with ``spin_us`` of polling before blocking. Stage 1 waits for an activation stage
    0 sends 0.3 s late (data arriving while the receive spins, or after it has blocked); stage 0
    then waits 0.2 s for a gradient that never comes: the wait must end at its own deadline, not
    at the end of the spin."""
    import time

    import torch.distributed as dist
    from asyncpp_ext import _C as C
    from asyncpp_ext.pipeline.sockets import create_socket_transport

    rank, _ = init_distributed(30)
    board = C.MessageBoard(_SlotHost(4))
    t = create_socket_transport(board, rank, 2, [0, 1], run_id=f"spin{spin_us}", timeout_s=30, spin_us=spin_us)
    if rank == 0:
        time.sleep(0.3)
        board.put_send(0, 0, 0, torch.arange(4.0))
        t.impl.wait(t.impl.post_send(0, 0, 0, 1), 20.0)
        start = time.monotonic()
        try:
            t.impl.wait(t.impl.post_recv(1, 0, 0, 1), 0.2)
            result = {"error": None}
        except RuntimeError as e:
            result = {"error": str(e)}
        result["waited_s"] = time.monotonic() - start
    else:
        t.impl.wait(t.impl.post_recv(0, 0, 0, 0), 20.0)
        result = {"received": board.received(0, 0, 0).tolist()}
    with open(os.path.join(out_dir, f"spin{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # stage 1 keeps its end open until stage 0's wait has timed out


def socket_inline_worker(out_dir: str, inline_bytes: int) -> None:
    """Stage 0 posts a receive of a small gradient, then waits for its send of a 64 MiB activation
    (more than the sockets buffer, so the send completes only as stage 1 reads it). Stage 1 sends
    the gradient 0.2 s in, then reads the activation. The gradient must have arrived by the time
    stage 0's send wait returns, read during that wait (inline) or by the progress thread."""
    import time

    import torch.distributed as dist
    from asyncpp_ext import _C as C
    from asyncpp_ext.pipeline.sockets import create_socket_transport

    big = 16 * 1024 * 1024  # float32 elements: 64 MiB

    class Host:
        def new_recv_buffer(self, kind: int) -> torch.Tensor:
            return torch.empty(big if kind == 0 else 4)

    rank, _ = init_distributed(30)
    board = C.MessageBoard(Host())
    t = create_socket_transport(board, rank, 2, [0, 1], run_id=f"inline{inline_bytes}", timeout_s=30,
                                inline_bytes=inline_bytes)
    if rank == 0:
        grad = t.impl.post_recv(1, 0, 0, 1)
        board.put_send(0, 0, 0, torch.arange(float(big)))
        t.impl.wait(t.impl.post_send(0, 0, 0, 1), 20.0)
        result = {"gradient_done_after_send_wait": t.impl.test(grad)}
        t.impl.wait(grad, 20.0) if not result["gradient_done_after_send_wait"] else None
        result["gradient"] = board.received(1, 0, 0).tolist()
    else:
        time.sleep(0.2)
        board.put_send(1, 0, 0, torch.tensor([1.0, 2.0, 3.0, 4.0]))
        t.impl.wait(t.impl.post_send(1, 0, 0, 0), 20.0)
        t.impl.wait(t.impl.post_recv(0, 0, 0, 0), 20.0)
        got = board.received(0, 0, 0)
        result = {"activation_ok": bool(torch.equal(got, torch.arange(float(big))))}
    with open(os.path.join(out_dir, f"inline{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


def break_and_return_worker(transport: str, out_dir: str) -> None:
    """Every rank leaves a 2000-step stream after its second step and returns at once: the rank's
    end must wait for the stream, which uses the process groups the rank's end destroys. A thread
    of its own writes how the stream ended, once it has."""
    import threading

    rank, _ = init_distributed(60)
    torch.set_num_threads(1)
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("adamw"),
                    schedule="2bw", microbatches=2, transport=transport, timeout_s=60)
    for stats in pipe.train(w.batches(2000, 2), 2000):
        if stats.step == 1:
            break
    left = pipe._left_stream

    def report() -> None:  # not a daemon: the interpreter waits for it
        left.worker.thread.join()
        final = left.feed._final
        with open(os.path.join(out_dir, f"left{rank}.json"), "w") as f:
            json.dump(repr(final) if isinstance(final, BaseException) else "ran to the end", f)

    threading.Thread(target=report).start()
