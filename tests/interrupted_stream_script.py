"""A library user's script (run by test_stream_stop.py, one process per rank, rank and world in
the environment as torchrun sets them): a long 2bw stream; rank 0 gets a Ctrl-C (SIGINT) while
its loop waits for step 5, as a Ctrl-C almost always lands. argv: ``with`` (the pipeline is a
context manager) or ``bare`` (never closed), the transport, and optionally the device. After the exit hooks it
writes whether a stream's worker thread still runs."""
import atexit
import os
import signal
import sys
import threading
import time
import traceback


def _report_workers() -> None:
    """Registered before asyncpp_ext is imported, so it runs after the package's exit hook (exit
    hooks run last-registered first), just before the interpreter's teardown."""
    from asyncpp_ext.pipeline.stream_worker import stage_workers_running

    sys.stderr.write(f"after the exit hooks: worker running={stage_workers_running()}\n")


atexit.register(_report_workers)

import torch  # noqa: E402 (after the hook above)
import torch.nn as nn  # noqa: E402

import pipeline_workers as w  # noqa: E402
from asyncpp_ext.pipeline import Pipeline, init_distributed  # noqa: E402

use_with, transport = sys.argv[1] == "with", sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"  # "cuda": both ranks on GPU 0
torch.set_num_threads(1)
rank, _ = init_distributed(60)
pipe = Pipeline(w.make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=w.optimizer_factory("adamw"),
                schedule="2bw", microbatches=2, stages=2, transport=transport, timeout_s=60, device=device)


def interrupted_at_step_5(batches):
    """Stage 0's batches, pulled on the stream's worker thread. Before step 5's batch the stream
    holds still until the caller's thread waits in ``Pipeline.train`` for the next step, and the
    process gets its SIGINT there."""
    main = threading.main_thread().ident
    for step, batch in enumerate(batches):
        if step == 5:
            while "step_feed.py" not in "".join(traceback.format_stack(sys._current_frames()[main])):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
        yield batch


def train() -> None:
    batches = w.batches(10**7, 2)
    for _ in pipe.train(interrupted_at_step_5(batches) if rank == 0 else batches, 10**7):
        pass


if use_with:
    with pipe:
        train()
else:
    train()
