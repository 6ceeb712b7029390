"""``--async-checkpoints``: a checkpoint written to disk while training goes on.

A checkpoint of a large model is gigabytes per stage; written in the step loop, every rank waits
for its write (and a pipeline for the slowest stage's) before the next step. Here the loop only
takes a copy of the state in memory -- on a GPU that is the device-to-host copy a written
checkpoint needs anyway; on the CPU a second copy -- and a background thread writes it: the
shard, its SHA-256, and (on the process that seals the checkpoint) ``meta.json`` and the rename
into place once every stage's shard is there. The checkpoint is the same file for file as one
written in the loop; it becomes the latest once sealed, as before, and until then the previous
one is.

Each stage's thread marks its shard done with a file beside it (``stage-NN.pt.done``, holding the
shard's size and hash, so the sealing process reads them instead of hashing every shard again);
the sealing process waits for every mark (no collective: the ranks train on meanwhile) and
removes them before it writes ``meta.json``. One write at a time: a checkpoint waits for the one
before (and the run's end for the last); a write that failed is raised there, as the run's error.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

DONE_SUFFIX = ".done"
POLL_S = 0.05  # how often the sealing process looks for the other stages' marks


def take_snapshot(stage: int, state: dict) -> tuple[dict, dict]:
    """(a copy of stage ``stage``'s ``state``, the RNG states now): what a background write writes.
    NaN/Inf weights are refused here, where a write in the loop refuses them."""
    from .checkpoint import capture_rng_state, check_finite_weights, to_cpu

    check_finite_weights(stage, state)
    return to_cpu(state, copy=True), capture_rng_state()


def mark_done(shard: Path, size: int, sha256: str) -> None:
    """The mark that ``shard`` is complete: written to a temporary name, then renamed."""
    mark = shard.with_name(shard.name + DONE_SUFFIX)
    tmp = mark.with_name(mark.name + ".tmp")
    tmp.write_text(json.dumps({"bytes": size, "sha256": sha256}))
    os.replace(tmp, mark)


def wait_for_marks(tmp_dir: Path, shards: list[str], timeout_s: float) -> dict:
    """{shard name: its mark} once every shard of ``shards`` is marked done in ``tmp_dir``, the marks
    removed; TimeoutError when none came for ``timeout_s`` (a stage's process is gone)."""
    found, last_news = {}, time.monotonic()
    while len(found) < len(shards):
        for name in shards:
            mark = tmp_dir / (name + DONE_SUFFIX)
            if name not in found and mark.exists():
                found[name] = json.loads(mark.read_text())
                last_news = time.monotonic()
        if len(found) < len(shards):
            if time.monotonic() - last_news > timeout_s:
                missing = ", ".join(n for n in shards if n not in found)
                raise TimeoutError(f"no shard was finished for {timeout_s:g} s; still missing: {missing}")
            time.sleep(POLL_S)
    for name in shards:
        (tmp_dir / (name + DONE_SUFFIX)).unlink()
    return found


class BackgroundWriter:
    """Runs one checkpoint write at a time in a thread of its own."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_write_s = 0.0
        """How long the latest finished write took (0 before the first)."""
        self._began = 0.0  # when the write in flight started

    def write_s(self) -> float:
        """How long a write takes, as known now: the latest finished write's time, or the time so far
        of the one in flight where that is longer. What a stop's checkpoint, which waits for its
        write, needs kept in reserve (--time-limit), read when the next segment is sized: a write
        that finished during the segment before already counts."""
        thread = self._thread
        running = time.perf_counter() - self._began if thread is not None and thread.is_alive() else 0.0
        return max(self.last_write_s, running)

    def start(self, write: Callable[[], None]) -> None:
        """Wait for the write before (raising its error), then run ``write`` in the background."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 -- handed to the training thread by wait()
                self._error = exc
            self.last_write_s = time.perf_counter() - self._began

        self._began = time.perf_counter()

        # a daemon: a run that fails or is stopped does not wait for a checkpoint it will not use
        self._thread = threading.Thread(target=run, name="asyncpp-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight is done; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


__all__ = ["BackgroundWriter", "take_snapshot", "mark_done", "wait_for_marks", "DONE_SUFFIX"]
