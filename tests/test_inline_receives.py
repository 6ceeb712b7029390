"""Receives of at most ASYNCPP_INLINE_RECV_BYTES are read only by the waiting executor thread
(never handed to the socket transport's progress thread): the setting, its refusals, that any
wait -- a send's too -- reads them, and that a pipeline gives bitwise the same losses either way."""
import json

import pytest

from asyncpp_ext import _C as C
from asyncpp_ext.pipeline import spawn
from asyncpp_ext.pipeline.sockets import DEFAULT_INLINE_RECV_BYTES, INLINE_RECV_ENV, inline_recv_bytes
from asyncpp_ext.training.cli import main

import transport_workers as tw


@pytest.mark.parametrize("environ,expected", [
    ({}, DEFAULT_INLINE_RECV_BYTES),
    ({INLINE_RECV_ENV: ""}, DEFAULT_INLINE_RECV_BYTES),
    ({INLINE_RECV_ENV: "0"}, 0),
    ({INLINE_RECV_ENV: " 1048576 "}, 1 << 20),
])
def test_inline_bytes_from_the_environment(environ, expected):
    assert inline_recv_bytes(environ) == expected


def test_the_default_matches_the_transports():
    assert DEFAULT_INLINE_RECV_BYTES == 64 * 1024


@pytest.mark.parametrize("value", ["big", "-1", "1.5", "64k"])
def test_a_bad_setting_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"{INLINE_RECV_ENV}=.*whole number of bytes"):
        inline_recv_bytes({INLINE_RECV_ENV: value})


def test_the_binding_refuses_a_negative_size():
    board = C.MessageBoard(tw._SlotHost(4))
    with pytest.raises(ValueError, match="inline_recv_bytes must be >= 0"):
        C.SocketTransport(0, C.SocketListener("127.0.0.1"), [], 1, 1.0, board, inline_recv_bytes=-1)


@pytest.mark.multiproc
@pytest.mark.parametrize("inline_bytes", [0, DEFAULT_INLINE_RECV_BYTES])  # progress thread / waiter reads it
def test_a_send_wait_reads_the_pending_small_receive(tmp_path, inline_bytes):
    spawn(tw.socket_inline_worker, 2, (str(tmp_path), inline_bytes))
    receiver = json.loads((tmp_path / "inline0.json").read_text())
    assert receiver == {"gradient_done_after_send_wait": True, "gradient": [1.0, 2.0, 3.0, 4.0]}
    assert json.loads((tmp_path / "inline1.json").read_text()) == {"activation_ok": True}


TINY = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "16", "--no-progress", "--n-layer", "2",
        "--schedule", "2bw", "--microbatches", "2", "--optimizer", "adamw", "--lr", "0.01", "--steps", "4",
        "--eval-every", "2", "--ckpt-every", "0", "--threads", "1", "--stages", "2"]


@pytest.mark.multiproc
def test_a_pipeline_gives_the_same_losses_with_every_receive_on_the_progress_thread(tmp_path, monkeypatch):
    assert main(TINY + ["--out", str(tmp_path / "inline")]) == 0
    monkeypatch.setenv(INLINE_RECV_ENV, "0")
    assert main(TINY + ["--out", str(tmp_path / "progress")]) == 0
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("inline", "progress")]
    assert len(rows[0]) == len(rows[1]) > 0
    for key in ("loss", "eval_loss"):
        assert [r.get(key) for r in rows[0]] == [r.get(key) for r in rows[1]]  # bitwise
