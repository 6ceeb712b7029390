"""Worker functions for the NCCL transport tests (importable by spawned ranks; CUDA only)."""
import json
import os

import torch
import torch.nn as nn

import pipeline_workers as w
from asyncpp_ext import _C as C
from asyncpp_ext.pipeline import Pipeline, init_distributed
from asyncpp_ext.pipeline.nccl import create_nccl_transport


def pipeline_worker(device_kind: str, schedule: str, m: int, steps: int, out_dir: str) -> None:
    """The shared 4-block model on 2 stages, on CPU with gloo or on cuda:<rank> with NCCL."""
    rank, _ = init_distributed(120)
    device = "cpu" if device_kind == "cpu" else f"cuda:{rank}"
    pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("adamw"),
                    schedule=schedule, microbatches=m, device=device, timeout_s=120)
    losses = [s.loss for s in pipe.train(w.batches(steps, m), steps)]
    if pipe.host.is_last:
        with open(os.path.join(out_dir, f"losses_{device_kind}.json"), "w") as f:
            json.dump(losses, f)
    if device_kind == "cuda":
        pipe.transport.close()


class Buffers:
    """A minimal stage host for the board: receive slots in the order the test asks for them (each
    receive in these tests takes a new slot), and the payload each (kind, step, microbatch) sends."""

    def __init__(self, device, shapes, dtypes):
        self.device, self.shapes, self.dtypes = device, shapes, dtypes
        self.slots_made = 0
        self.board = C.MessageBoard(self)

    def payload(self, kind: int, step: int, mb: int, dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * kind + 10 * step + mb)
        return (torch.randn(self.shapes[step], generator=g) * 100).to(dtype).to(self.device)

    def new_recv_buffer(self, kind: int) -> torch.Tensor:
        step, self.slots_made = self.slots_made, self.slots_made + 1
        return torch.empty(self.shapes[step], dtype=self.dtypes[step], device=self.device)


def transfer_worker(out_dir: str) -> None:
    """Stage 0 sends activations of several dtypes and sizes; stage 1 checks them and answers with
    gradients; both check what arrived bit for bit."""
    rank, _ = init_distributed(120)
    device = torch.device("cuda", rank)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]
    shapes = [(3,), (64, 33), (1 << 20,), (5, 7, 11), (0,)]
    buffers = Buffers(device, shapes, dtypes)
    t = create_nccl_transport(buffers.board, rank, 2, [0, 1], device, run_id="transfer", timeout_s=60)
    out_kind, in_kind, peer = (0, 1, 1) if rank == 0 else (1, 0, 0)
    for step, dtype in enumerate(dtypes):
        buffers.board.put_send(out_kind, step, 0, buffers.payload(out_kind, step, 0, dtype))
    recvs = [t.impl.post_recv(in_kind, step, 0, peer) for step in range(len(dtypes))]
    sends = [t.impl.post_send(out_kind, step, 0, peer) for step in range(len(dtypes))]
    for r in recvs + sends:
        t.impl.wait(r, 60.0)
    assert t.impl.pending() == 0 and t.pending() == []
    ok = [bool(torch.equal(buffers.board.received(in_kind, s, 0).cpu(),
                           buffers.payload(in_kind, s, 0, dtypes[s]).cpu())) for s in range(len(dtypes))]
    t.close()
    with open(os.path.join(out_dir, f"transfer{rank}.json"), "w") as f:
        json.dump(ok, f)


def timeout_worker(out_dir: str) -> None:
    """Stage 1 never sends its gradient; stage 0's wait must fail naming the message, the peer's
    rank and the timeout, and the transport must refuse further use."""
    rank, _ = init_distributed(120)
    device = torch.device("cuda", rank)
    buffers = Buffers(device, [(4,)], [torch.float32])
    t = create_nccl_transport(buffers.board, rank, 2, [0, 1], device, run_id="timeout", timeout_s=60)
    if rank == 0:
        request = t.impl.post_recv(1, 0, 0, 1)
        described = t.pending()  # what the watchdog's stall report would list
        assert len(described) == 1 and "rank 1" in described[0] and "16 bytes" in described[0], described
        messages = []
        for action in (lambda: t.impl.wait(request, 2.0), lambda: t.impl.post_recv(1, 1, 0, 1)):
            try:
                action()
                messages.append(None)
            except RuntimeError as e:
                messages.append(str(e))
        with open(os.path.join(out_dir, "timeout.json"), "w") as f:
            json.dump(messages, f)
    torch.distributed.barrier()  # stage 1 stays alive until stage 0 has timed out
    if rank == 1:  # its communicators' peer aborted: leave without a (collective) NCCL teardown
        os._exit(0)


def cancel_worker(out_dir: str) -> None:
    """Stage 0 waits on another thread for a gradient stage 1 never sends; cancel() from this
    thread must end that wait within a second, with its reason, and refuse further use."""
    import threading
    import time

    rank, _ = init_distributed(120)
    device = torch.device("cuda", rank)
    buffers = Buffers(device, [(4,)], [torch.float32])
    t = create_nccl_transport(buffers.board, rank, 2, [0, 1], device, run_id="cancel", timeout_s=60)
    if rank == 0:
        request, result = t.impl.post_recv(1, 0, 0, 1), {}

        def wait() -> None:
            torch.cuda.set_device(device)
            start = time.monotonic()
            try:
                t.impl.wait(request, 30.0)
            except RuntimeError as e:
                result["error"] = str(e)
            result["waited_s"] = time.monotonic() - start

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
        t.cancel("the pipeline was closed")
        waiter.join(10)
        try:
            t.impl.post_recv(1, 1, 0, 1)
            result["later"] = None
        except RuntimeError as e:
            result["later"] = str(e)
        with open(os.path.join(out_dir, "cancel.json"), "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()  # stage 1 stays alive until stage 0's wait was cancelled
    if rank == 1:  # its communicators' peer aborted: leave without a (collective) NCCL teardown
        os._exit(0)
