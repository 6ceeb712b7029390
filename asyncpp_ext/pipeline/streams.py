"""How a `Pipeline` runs its ``train`` calls: each one continuous instruction stream.

A stream is the C++ executor running the schedule's program for ``steps`` steps in a worker thread
(stream_worker.py) while the caller's thread receives each step's `StepStats` as it completes
(step_feed.py). A stream cannot stop part-way -- every rank runs all of it and a 2bw step has no
drain -- so the rules for a caller who leaves the loop, is interrupted, or closes the pipeline
while a stream runs live here, beside the minibatch feed the executor pulls from.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .._ext import MAX_COUNT, C
from .arguments import is_int, split_minibatch
from .data_parallel import replica_share
from .devices import to_device
from .handshake import agree
from .stage import StageError
from .step_feed import StepFeed
from .stream_worker import (PEER_LOSS_GRACE_S, STOP_TIMEOUT_S, UNCANCELLABLE_STOP_S, LeftStream, StreamWorker,
                            outside_stacklevel)
from .transport import TransportError

@dataclass
class StepStats:
    step: int                 # global step index (0-based)
    loss: float | None        # mean microbatch loss over all replicas; only last stages know it
    tokens: int               # tokens consumed by this step (all replicas)
    elapsed_s: float          # since the start of this train() call
    stage: int
    skipped: bool = False     # the update was skipped (non-finite values, --on-nonfinite skip)
    # time.perf_counter() as the step completed on this rank: the stats reach the caller in bursts
    # (the stream runs ahead of them), so their arrival does not time the steps
    done_at: float | None = None


class StreamControl:
    """The ``train`` streams of a `Pipeline` (its base class): starting one, the minibatches it
    pulls, leaving or stopping it, and the checks every other call makes against one still
    running (``_settle``). Uses the pipeline's host, transport, board, watchdog, progress,
    exchange and layout, which ``Pipeline.__init__`` sets up, and keeps a stream's state in
    ``_worker`` (the latest stream's thread), ``_left_stream`` (one the caller left, still
    running) and ``_stopped_part_way`` (why a stream ended before its last step)."""

    def _init_streams(self) -> None:
        # (op, step, microbatch, version, start_ns, end_ns) per executed instruction, newest last;
        # bounded so that long runs do not grow without limit.
        self.trace: list[tuple] = []
        self.trace_limit = 200_000
        self.tokens_per_microbatch = 0
        self.next_step = 0
        self._batches: Iterator | None = None
        self._pulled: dict[int, tuple] = {}
        self._pull_step = 0
        self._stopped_part_way: str | None = None
        self._worker: StreamWorker | None = None
        self._left_stream: LeftStream | None = None

    @property
    def next_step(self) -> int:
        """The step the next ``train`` call starts at (once a stream the caller left has run out)."""
        self._finish_left_stream()
        return self._next_step

    @next_step.setter
    def next_step(self, value: int) -> None:
        self._next_step = value

    def close(self, timeout_s: float = 30.0) -> None:
        """Release the transport: with NCCL, wait up to ``timeout_s`` for transfers in flight, then
        destroy the communicators (or abort them if transfers never finished), so that no rank
        is left waiting in a communicator teardown at exit. Call it (or use the pipeline as a
        context manager) once training on it is over; later calls do nothing. A stream the
        caller left runs to its end first (the other stages need it); leaving a ``with`` block
        on an exception stops it instead."""
        try:
            self._finish_left_stream()
        except BaseException:
            self._release(0.0)
            raise
        self._release(timeout_s)

    def _release(self, timeout_s: float) -> None:
        """Stop a stream still running (an interrupted caller's), then close the transport."""
        worker = self._worker
        if worker is not None and worker.thread.is_alive():
            self._stopped_part_way = self._stopped_part_way or "it was stopped by close()"
            if not worker.stop("the pipeline was closed while its stream ran"):
                return  # the thread may still use the transport (stop warned)
        close = getattr(self.transport, "close", None)
        if callable(close):
            close(timeout_s)

    def _cancel_stream(self, reason: str) -> None:
        """From another thread: the running stream's next forward and its transfers fail."""
        self.host.stop_reason = reason
        cancel = getattr(self.transport, "cancel", None)
        if callable(cancel):
            cancel(reason)

    def __enter__(self) -> StreamControl:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # leaving on an error: stop the stream, and abort transfers still in flight at once
            left, self._left_stream = self._left_stream, None
            if left is not None and left.worker.thread.is_alive():
                self._stopped_part_way = self._stopped_part_way or f"step {left.last + 1}: stopped by close()"
            self._release(timeout_s=0.0)

    # ---- data --------------------------------------------------------------------------------
    def _next_batch(self, step: int) -> tuple:
        while self._pull_step <= step:
            try:
                batch = next(self._batches)
            except StopIteration:
                raise StageError(f"stage {self.stage}: the batch iterator ran out before step "
                                 f"{self._pull_step}") from None
            inputs, targets = split_minibatch(batch, self.m)
            if self.dp > 1:
                inputs = [replica_share(x, self.replica, self.dp) for x in inputs]
                targets = [replica_share(y, self.replica, self.dp) for y in targets]
            if self.device.type != "cpu":
                inputs = [to_device(x, self.device) for x in inputs]
                targets = [to_device(y, self.device) for y in targets]
            self._pulled[self._pull_step] = inputs, targets
            self._pull_step += 1
        return self._pulled.pop(step)

    # ---- training ----------------------------------------------------------------------------
    def train(self, batches: Iterable, steps: int) -> Iterator[StepStats]:
        """Run ``steps`` steps as one continuous stream; yields each step's stats as it completes.

        ``batches`` yields one minibatch per step: ``(inputs, targets)`` with leading size m*B, or a
        list of m ``(inputs, targets)`` pairs. Stage 0 uses the inputs, the last stage the targets.
        A stream cannot stop part-way (every rank runs all of it, and a step has no drain):
        leaving the loop early runs the remaining steps to the end without their stats, with a
        warning -- to train fewer steps, ask for fewer. They run in the background; the
        pipeline's next call waits for them (so an exception in the loop's body surfaces at
        once), and leaving a ``with`` block on an exception stops them. A step that fails, or a
        KeyboardInterrupt while the stream runs, leaves this pipeline mid-step: later calls raise
        ``StageError`` (build a new Pipeline and load a checkpoint's state into it).
        """
        if not is_int(steps) or steps < 1 or self.next_step + steps > MAX_COUNT:
            raise ValueError(f"steps must be an integer >= 1 that keeps the run's steps within {MAX_COUNT} "
                             f"(the core's counts), got {steps!r} at step {self.next_step}")
        self._settle("train", check_whole=True)
        with self.watchdog.armed(f"training steps {self.next_step}..{self.next_step + steps - 1}"):
            yield from self._train(batches, steps)

    def _train(self, batches: Iterable, steps: int) -> Iterator[StepStats]:
        self._batches = iter(batches)
        self._pull_step = self.next_step
        if self.host.in_sig is None:
            first = self._next_batch(self.next_step) if self.host.is_first or self.host.is_last else None
            if first is not None:
                self._pulled[self.next_step] = first
            self.tokens_per_microbatch = agree(
                self.host, stage=self.stage, stages=self.stages, stage_ranks=self.stage_ranks,
                core_schedule=self.core_schedule, microbatches=self.m, partition=self.partition,
                device=self.device, first_input=first[0][0] if self.host.is_first else None)
        first_step, feed = self.next_step, StepFeed()
        start = time.monotonic()
        tokens_per_step = self.m * self.tokens_per_microbatch * self.dp

        def on_step(step: int, loss: float | None, skipped: bool = False) -> None:
            feed.put(StepStats(step, loss, tokens_per_step, time.monotonic() - start, self.stage, skipped,
                               time.perf_counter()))

        self.host.on_step = on_step
        done = object()

        host = self.host
        wait_timeout_s = 2 * self.timeout_s  # the watchdog reports a stall first
        # Programs are materialised per call; a very long call runs as a few long streams (one
        # drain per MAX_SCHEDULE_WORK / (S*m) steps) to bound the program's memory.
        chunk = max(1, C.MAX_SCHEDULE_WORK // (self.stages * self.m))

        # OpenMP's thread count is per thread: without this the executor thread would run its
        # torch ops on one thread per core whatever the rank set (seconds per step when ranks
        # share cores).
        intra_op_threads = torch.get_num_threads()

        def worker() -> None:
            try:
                torch.set_num_threads(intra_op_threads)
                if self.device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(self.device)
                for stream_start in range(first_step, first_step + steps, chunk):
                    n = min(chunk, first_step + steps - stream_start)
                    trace = self.transport.run_stage(self.core_schedule, self.stages, self.m, n, self.stage,
                                                     stream_start, host, self.board, recv_ahead=self.recv_ahead,
                                                     max_inflight_sends=8, timeout_s=wait_timeout_s,
                                                     progress=self.progress)
                    self.trace.extend(trace)
                    if len(self.trace) > self.trace_limit:
                        del self.trace[:len(self.trace) - self.trace_limit]
                feed.finish(done)
            except BaseException as e:  # handed to the caller's thread
                if isinstance(e, TransportError) and not stream.interrupted.wait(PEER_LOSS_GRACE_S):
                    # On record like a stalled rank's state; the error itself is this rank's next
                    # line (its exit) -- not repeated in the block. A rank stopped (Ctrl-C,
                    # SIGTERM), even a moment after its peer, says why itself.
                    self.watchdog.dump_state("lost a peer: this rank's state as its transport failed")
                feed.finish(e)

        if self.host.exchange is not None:
            self.exchange.begin_segment(first_step, steps)
        # The caller's thread interrupted (stream.interrupted): the worker goes on alone until
        # close() or the exit hook stops it (stream_worker.py).
        stop_s = STOP_TIMEOUT_S if getattr(self.transport, "cancels_waits", False) else UNCANCELLABLE_STOP_S
        stream = self._worker = StreamWorker(worker, self.stage, self._cancel_stream, stop_s)
        stream.start()
        last = first_step - 1
        try:
            for item in feed.items():
                if item is done:
                    break
                if isinstance(item, BaseException):
                    stream.join()
                    self._stopped_part_way = _why(last + 1, item)
                    raise item
                last = item.step
                yield item
        except GeneratorExit:  # the caller left the loop (a break, or an exception in its body)
            if stream.interrupted.is_set():  # close() or the exit hook stopped the stream first
                self._stopped_part_way = self._stopped_part_way or f"step {last + 1}: stopped by close()"
                return
            # The other stages need this one to the stream's end, so it runs on; the pipeline's
            # next call waits for it. Not here: an exception leaving the loop's body closes this
            # generator on its way out, and would surface only after the whole stream.
            stream.left = f"Pipeline.train was left after step {last} of {first_step}..{first_step + steps - 1}"
            self._left_stream = LeftStream(stream, feed, first_step, steps, last)
            return
        except BaseException as exc:  # KeyboardInterrupt: the worker goes on in the background
            stream.interrupted.set()
            self._stopped_part_way = self._stopped_part_way or _why(last + 1, exc)
            raise
        self._end_stream(stream, first_step, steps)

    def _end_stream(self, stream: StreamWorker, first_step: int, steps: int) -> None:
        stream.join()
        if self.host.exchange is not None:  # the segment drains: tied copies equal, norms known
            self.exchange.end_segment(self.host.buffer_for)
        self.next_step = first_step + steps

    def _finish_left_stream(self) -> None:
        """Wait for the rest of a stream the caller left (every call that reads or changes the
        pipeline's state, and close(), start here). A failure there is named by the next call;
        a Ctrl-C while waiting leaves the stream running, as in train."""
        left, self._left_stream = self._left_stream, None
        if left is None:
            return
        with self.watchdog.armed(f"the rest of training steps {left.first_step}..{left.first_step + left.steps - 1}"):
            try:
                failure = left.run_out()
            except BaseException as exc:
                self._stopped_part_way = _why(left.last + 1, exc)
                raise
        if failure is not None:
            self._stopped_part_way = _why(left.last + 1, failure)
            return
        self._end_stream(left.worker, left.first_step, left.steps)
        warnings.warn(f"{left.worker.left}: its remaining steps ran to the end now (a stream cannot stop "
                      "part-way); ask for fewer steps to train fewer", stacklevel=outside_stacklevel())

    def _settle(self, call: str, check_whole: bool = False) -> None:
        """Every call that reads or changes the run's state starts here: a stream the caller left
        runs out first, and one still running (its loop not finished, or interrupted) refuses."""
        self._finish_left_stream()
        if check_whole:
            self._check_whole()
        worker = self._worker
        if worker is not None and worker.thread.is_alive():
            raise StageError(f"stage {self.stage}: {call}() was called while a train() stream of this Pipeline "
                             "still runs: finish or leave its loop first (after a Ctrl-C, close() stops it)")

    def _check_whole(self) -> None:
        """StageError once a stream stopped part-way: the weights, the optimizer and the other
        ranks are mid-step, and a new stream would start from an inconsistent state."""
        if self._stopped_part_way is not None:
            raise StageError(f"stage {self.stage}: this Pipeline stopped part-way through a stream "
                             f"({self._stopped_part_way}); build a new Pipeline (load_state_dict a "
                             "checkpoint into it to go on)")

def _why(step: int, exc: BaseException) -> str:
    """What stopped a stream, for ``_check_whole``: the step and the exception's first line."""
    line = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"step {step}: {type(exc).__name__}" + (f": {line}" if line else "")

