"""The ipc transport (pipeline/ipc.py): its protocol driven in one process (both ends, a dict as
the key-value store), the shared counters of the extension, and real stage processes against the
simulation. The CUDA path runs in `make gpu-check` (ipc vs gloo on one GPU, bitwise)."""
from __future__ import annotations

import json
import os
import pickle
import sys

import pytest
import torch

from asyncpp_ext import _C as C
from asyncpp_ext.pipeline.ipc import IPC_SLOTS_ENV, IpcTransport, _Segment, slots_from_env
from asyncpp_ext.pipeline.stage import ACTIVATION, GRADIENT
from asyncpp_ext.pipeline.transport import TransportError
from asyncpp_ext.training.cli import main


class DictStore:
    """torch.distributed.Store's set / check / get, in memory."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class Host:
    def __init__(self, stage):
        self.stage = stage


_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_transports():
    """Every transport a test made is closed after it (its owner's shared files unlinked)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _pair(slots, store=None):
    store = DictStore() if store is None else store
    ends = [IpcTransport(Host(s), [0, 1], run_id="t", slots=slots, store=store, timeout_s=5.0) for s in (0, 1)]
    _OPEN.extend(ends)
    return ends, store


def _drive(requests, seconds=5.0):
    """Test every (end, request) until all are done: both ends live in this one process, so each
    moves only when called, as each rank's executor calls its own."""
    import time
    left, deadline = list(requests), time.monotonic() + seconds
    while left:
        assert time.monotonic() < deadline, [end.describe_request(r) for end, r in left]
        left = [(end, r) for end, r in left if not end.test(r)]


def _messages(n, shape=(3, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_messages_arrive_intact_and_in_order_whatever_the_slot_count(slots):
    (a, b), _ = _pair(slots)
    sent = _messages(7)
    sends = [a.post_send(ACTIVATION, 0, mb, 1, t) for mb, t in enumerate(sent)]
    # With `slots` free slots the sender writes that many messages before the receiver frees one.
    assert [a.test(r) for r in sends[:slots]] == [True] * slots and not a.test(sends[slots])
    bufs = [torch.full((3, 5), float("nan")) for _ in sent]
    recvs = [b.post_recv(ACTIVATION, 0, mb, 0, buf) for mb, buf in enumerate(bufs)]
    _drive([(b, r) for r in recvs] + [(a, r) for r in sends[slots:]])
    for got, want in zip(bufs, sent):
        assert torch.equal(got, want)
    files = [seg.name for ch in a._channels.values() for seg in ch.segments]
    assert len(files) == 2 and not any(map(os.path.exists, files))  # unlinked once the receiver mapped them


def test_both_kinds_and_both_directions_at_once_in_bf16():
    (a, b), _ = _pair(2)
    act, grad = _messages(4, dtype=torch.bfloat16), _messages(4, dtype=torch.bfloat16)
    got_act, got_grad = [torch.empty(3, 5, dtype=torch.bfloat16) for _ in act], [torch.empty(3, 5, dtype=torch.bfloat16) for _ in grad]
    reqs = []
    for mb in range(4):  # interleaved the way a 1F1B steady state interleaves them
        reqs += [(a, a.post_send(ACTIVATION, 0, mb, 1, act[mb])), (b, b.post_recv(ACTIVATION, 0, mb, 0, got_act[mb])),
                 (b, b.post_send(GRADIENT, 0, mb, 0, grad[mb])), (a, a.post_recv(GRADIENT, 0, mb, 1, got_grad[mb]))]
    _drive(reqs)
    assert all(torch.equal(x, y) for x, y in zip(got_act + got_grad, act + grad))


def test_a_receive_posted_before_the_sender_exists_completes_once_it_writes():
    (a, b), _ = _pair(3)
    buf = torch.zeros(3, 5)
    r = b.post_recv(ACTIVATION, 0, 0, 0, buf)
    assert not b.test(r)  # nothing published yet: no slots to map
    msg = _messages(1)[0]
    a.wait(a.post_send(ACTIVATION, 0, 0, 1, msg), 5.0)
    b.wait(r, 5.0)
    assert torch.equal(buf, msg)


def test_a_message_of_another_shape_is_one_clear_error():
    (a, _), _ = _pair(2)
    a.post_send(ACTIVATION, 0, 0, 1, torch.zeros(3, 5))
    with pytest.raises(TransportError, match=r"stage 0: a activation of shape \(3, 6\) torch.float32 for stage 1, "
                                             r"but the link's slots hold \(3, 5\) torch.float32"):
        a.post_send(ACTIVATION, 0, 1, 1, torch.zeros(3, 6))


def test_a_silent_peer_times_out_naming_the_message():
    (_, b), _ = _pair(2)
    r = b.post_recv(GRADIENT, 4, 2, 0, torch.zeros(3, 5))
    with pytest.raises(TransportError, match=r"stage 1: gradient recv from stage 0 .*step 4, microbatch 2.*"
                                             r"no progress for 0.05 s"):
        b.wait(r, 0.05)
    assert b.pending() == [b.describe_request(r)]


def test_a_dead_peer_process_ends_the_wait_within_a_moment():
    import subprocess
    import time
    (a, b), store = _pair(2)
    a.wait(a.post_send(ACTIVATION, 3, 0, 1, torch.zeros(3, 5)), 5.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped: its pid names no process now
    key = next(k for k in store.data if k.endswith("/offer"))
    store.data[key] = pickle.dumps({**pickle.loads(store.data[key]), "pid": dead.pid})  # as if stage 0 were it
    b.wait(b.post_recv(ACTIVATION, 3, 0, 0, torch.zeros(3, 5)), 5.0)
    r = b.post_recv(ACTIVATION, 3, 1, 0, torch.zeros(3, 5))
    begin = time.monotonic()
    with pytest.raises(TransportError, match=rf"stage 1: activation recv from stage 0 .*step 3, microbatch 1.* "
                                             rf"failed -- the peer has probably exited \(rank 0, process {dead.pid}, "
                                             r"is gone\)"):
        b.wait(r, 30.0)
    assert time.monotonic() - begin < 2.0


def test_a_store_that_has_gone_is_one_line():
    class GoneStore(DictStore):
        def check(self, keys):
            raise RuntimeError("Connection reset by peer\nmore")
    (_, b), _ = _pair(2, store=GoneStore())
    with pytest.raises(TransportError, match=r"^stage 1: waiting for the handles of rank 0 failed -- a peer has "
                                             r"probably exited \(the rendezvous store is gone: Connection reset"):
        b.wait(b.post_recv(ACTIVATION, 0, 0, 0, torch.zeros(3, 5)), 1.0)


def test_a_peer_on_another_host_is_refused(monkeypatch):
    (a, b), store = _pair(2)
    a.post_send(ACTIVATION, 0, 0, 1, torch.zeros(3, 5))
    key = next(k for k in store.data if k.endswith("/offer"))
    offer = pickle.loads(store.data[key])
    store.data[key] = pickle.dumps({**offer, "host": "elsewhere"})
    with pytest.raises(TransportError, match="transport 'ipc' needs its peer on this host .* runs on elsewhere; "
                                             "use --transport gloo"):
        b.wait(b.post_recv(ACTIVATION, 0, 0, 0, torch.zeros(3, 5)), 1.0)


def test_shared_files_are_gone_once_both_ends_have_them_mapped():
    owner = _Segment(64)
    assert os.path.exists(owner.name)
    peer = _Segment(name=owner.name)
    assert not os.path.exists(owner.name)  # the mapping stays; nothing left behind if a process dies
    a, b = owner.view(torch.int64, (8,)), peer.view(torch.int64, (8,))
    a[3] = 7
    assert int(b[3]) == 7
    del a, b
    owner.release(), peer.release()
    lonely = _Segment(64)  # a peer that never came: the owner unlinks at release
    name = lonely.name
    lonely.release()
    assert not os.path.exists(name)


def test_counters_load_and_store_and_refuse_a_misaligned_address():
    t = torch.zeros(4, dtype=torch.int64)
    C.counter_store(t.data_ptr() + 16, 1234567890123)
    assert C.counter_load(t.data_ptr() + 16) == 1234567890123 == int(t[2])
    with pytest.raises(ValueError, match="address must be a non-null, 8-byte aligned address"):
        C.counter_load(t.data_ptr() + 4)
    with pytest.raises(ValueError, match="address must be a non-null"):
        C.counter_store(0, 1)


def test_slots_from_the_environment():
    assert slots_from_env({}) == 3 and slots_from_env({IPC_SLOTS_ENV: " 5 "}) == 5
    for bad in ("0", "65", "abc"):  # a slot holds a whole message in shared memory: at most 64
        with pytest.raises(ValueError, match=f"{IPC_SLOTS_ENV}='{bad}' is not an integer from 1 to 64"):
            slots_from_env({IPC_SLOTS_ENV: bad})
    assert slots_from_env({IPC_SLOTS_ENV: "64"}) == 64


@pytest.mark.multiproc
def test_real_stage_processes_over_ipc_equal_the_simulation(tmp_path, monkeypatch):
    # Three stages (both kinds on two links), one slot per channel: every message past the first
    # waits for the receiver to free the slot.
    monkeypatch.setenv(IPC_SLOTS_ENV, "1")
    flags = ["--model", "llama-tiny", "--micro-batch-size", "2", "--seq-len", "16", "--no-progress", "--threads",
             "1", "--optimizer", "muon", "--eval-every", "0", "--stages", "3", "--microbatches", "4", "--steps", "5"]
    assert main(flags + ["--transport", "ipc", "--out", str(tmp_path / "real")]) == 0
    assert main(flags + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    real, sim = ([json.loads(line)["loss"] for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                 for r in ("real", "sim"))
    assert real == sim  # the same bytes: the same bits


@pytest.mark.cuda
@pytest.mark.multiproc
def test_two_stages_sharing_one_gpu_over_ipc_equal_gloo_bitwise(tmp_path):
    # eager: compiled blocks (the CUDA default) sum the embedding's gradient with atomic adds, in no
    # fixed order, so two compiled runs need not agree bit for bit whatever the transport
    flags = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "32", "--no-progress", "--optimizer",
             "muon", "--ns-dtype", "fp32", "--dtype", "fp32", "--eval-every", "0", "--stages", "2", "--steps", "6",
             "--device", "cuda", "--no-compile"]
    for transport in ("ipc", "gloo"):
        assert main(flags + ["--transport", transport, "--out", str(tmp_path / transport)]) == 0
    ipc, gloo = ([json.loads(line)["loss"] for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                 for r in ("ipc", "gloo"))
    assert ipc == gloo
