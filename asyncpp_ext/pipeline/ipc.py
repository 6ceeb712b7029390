"""The ``ipc`` transport: stages on one host hand boundary tensors over through shared memory.

Why: NCCL refuses two ranks on one GPU, and gloo moves host memory only, so two stages sharing a
GPU over gloo copy every activation and gradient to the host (the sender's host waiting for that
copy, and so for all the compute queued before it), push it through a TCP socket and copy it
back. Here each direction of a link, per message kind, is a *channel* with a ring of slots the
sender owns and the receiver maps: on CUDA through CUDA IPC (device memory: a message is one
device-to-device copy in and one out, ordered by interprocess CUDA events that no host waits on);
on CPU through POSIX shared memory. Two message counters in shared host memory (``full``, written
by the sender; ``free``, by the receiver; stored with release and loaded with acquire order by
the extension) are the whole control plane: no socket, no system call per message.

One channel, message n in slot i = n % slots:

    sender    once free > n - slots (n >= slots): its stream waits for R[i];
              slot[i] <- tensor; record W[i]; full = n + 1
    receiver  once full > n: its stream waits for W[i]; buffer <- slot[i]; record R[i];
              free = n + 1

Both ends see a link's messages of one kind in schedule order, so counting is all the matching
there is. The sender makes the control block, the slots and the W events at its first message and
publishes their handles in the default group's key-value store; the receiver maps them and
publishes its R events. A request completes without a host waiting on a device: a send once its
copy is queued and counted, a receive once its copy is queued (later work on the receiver's
stream runs after it). Every test or wait moves every channel on, so a stage blocked on one
message still frees the slots its peers wait for.

Exactness: the bytes move unchanged, so runs equal the other transports and ``--simulate``.
``ASYNCPP_IPC_SLOTS`` sets the slots per channel (default 3: the receiver posts its receives
ahead and frees a slot as soon as it has copied out, so a few suffice).
"""
from __future__ import annotations

import mmap
import os
import pickle
import socket
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from .._ext import C
from .rendezvous import default_store
from .transport import KIND_NAMES, GlooTransport, TransportError, peer_failure_reason

IPC_SLOTS_ENV = "ASYNCPP_IPC_SLOTS"
DEFAULT_SLOTS = 3
MAX_SLOTS = 64  # each slot holds a whole message in shared memory: more is a typo
_FULL, _FREE = 0, 8  # int64 offsets of the two counters: a cache line apart (two writers)
_CONTROL_BYTES = 128
_SPIN_S, _MAX_PAUSE_S = 200e-6, 250e-6  # how a wait polls (see IpcTransport.wait)
_STORE_POLL_S = 0.005  # how often a channel still waiting for its peer's handles asks the store
_LIVENESS_S = 0.2  # how often a waiting stage checks that its peers' processes still exist


def slots_from_env(environ=os.environ) -> int:
    value = environ.get(IPC_SLOTS_ENV, "").strip()
    if not value:
        return DEFAULT_SLOTS
    if not value.isdigit() or not 1 <= int(value) <= MAX_SLOTS:
        raise ValueError(f"{IPC_SLOTS_ENV}={value!r} is not an integer from 1 to {MAX_SLOTS}; unset it or give "
                         "the slots per channel, e.g. 3")
    return int(value)


class _Segment:
    """Shared memory: a file in /dev/shm (else the temporary directory) that both ends map. The
    owner creates it; the other end maps it by name and unlinks it at once, so once both have it
    mapped nothing is left to clean up, even if a process dies; the owner unlinks it at release
    if the peer never came."""

    def __init__(self, nbytes: int = 0, name: str | None = None):
        self.owner = name is None
        if self.owner:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            name = os.path.join(folder, f"asyncpp-ipc-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, max(1, nbytes))
        else:
            fd = os.open(name, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name
        self.views: list[torch.Tensor] = []
        if not self.owner:
            self._unlink()

    def view(self, dtype: torch.dtype, shape) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= int(n)
        t = torch.frombuffer(self.map, dtype=dtype, count=numel).view(tuple(shape))
        self.views.append(t)
        return t

    def _unlink(self) -> None:
        try:
            os.unlink(self.name)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        self.views.clear()
        if self.owner:
            self._unlink()
        try:
            self.map.close()
        except BufferError:  # a view is still referenced elsewhere: the mapping goes with it
            pass


def _events(device: torch.device, count: int) -> list:
    """Interprocess CUDA events, one per slot; none on CPU (a copy there is done on return)."""
    if device.type != "cuda":
        return []
    return [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(count)]


def _event_handles(events: list, device: torch.device) -> list:
    if not events:
        return []
    with torch.cuda.device(device):  # an event not recorded yet is created on the current device
        return [e.ipc_handle() for e in events]


def _open_events(device: torch.device, handles: list) -> list:
    return [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` (on this host) has exited: no such process, or a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists (another user's; not ours to signal)
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:  # no /proc (not Linux): os.kill's answer stands
        return False


def _stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


@dataclass
class _Request:
    desc: str
    tensor: torch.Tensor | None  # a send's payload until written, a receive's buffer until filled
    done: bool = False


@dataclass
class _Channel:
    """One direction of a link for one message kind, seen from one end."""
    key: str                  # the store key its handles go under
    peer_rank: int
    sending: bool
    device: torch.device
    slots: torch.Tensor | None = None  # (slots, *message shape)
    full: int = 0             # addresses of the shared counters
    free: int = 0
    own_events: list = field(default_factory=list)   # W on the sender, R on the receiver
    peer_events: list = field(default_factory=list)
    segments: list = field(default_factory=list)     # shared memory to release at close
    peer_pid: int | None = None  # the peer's process (from its handles)
    accepted: bool = False    # sender: the receiver's handles (its R events, its pid) are here
    count: int = 0            # messages written (sender) / read (receiver)
    queue: deque = field(default_factory=deque)      # requests waiting, oldest first
    next_look: float = 0.0    # when to ask the store again for the peer's handles


def _use_control(channel: _Channel, control: _Segment) -> None:
    """Point the channel's counters into the control block (its owner starts them at 0)."""
    counters = control.view(torch.int64, (_CONTROL_BYTES // 8,))
    if control.owner:
        counters.zero_()
    channel.segments.append(control)
    channel.full, channel.free = counters[_FULL:].data_ptr(), counters[_FREE:].data_ptr()


class IpcTransport(GlooTransport):
    """See the module docstring. ``run_id`` names this pipeline's store keys (equal on every
    rank); ``store`` defaults to the default process group's."""

    host_staging = False
    cancels_waits = True  # its waits poll, and look at cancel's flag each time

    def __init__(self, host, stage_ranks: list, *, run_id: str, slots: int | None = None, store=None,
                 watchdog=None, timeout_s: float = 300.0):
        super().__init__(host, stage_ranks, watchdog=watchdog)
        self.slots = slots_from_env() if slots is None else int(slots)
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots!r}")
        self.run_id, self.timeout_s = run_id, timeout_s
        self.store = default_store() if store is None else store
        self._channels: dict[tuple, _Channel] = {}
        self._requests: dict[int, _Request] = {}

    # ---- the executor's calls -------------------------------------------------------------------
    def post_send(self, kind: int, step: int, mb: int, peer: int, tensor: torch.Tensor) -> int:
        channel = self._channel(kind, peer, True, tensor)
        return self._queue(channel, _Request(self._describe(True, kind, step, mb, peer, tensor), tensor))

    def post_recv(self, kind: int, step: int, mb: int, peer: int, tensor: torch.Tensor) -> int:
        channel = self._channel(kind, peer, False, tensor)
        return self._queue(channel, _Request(self._describe(False, kind, step, mb, peer, tensor), tensor))

    def test(self, request: int) -> bool:
        self._progress()
        if self._requests[request].done:
            del self._requests[request]
            return True
        return False

    def wait(self, request: int, timeout_s: float) -> None:
        """Poll every channel until ``request`` is done: yielding the core for the first
        ``_SPIN_S`` (a message due now arrives within microseconds), then sleeping ever longer,
        up to ``_MAX_PAUSE_S`` (a stage waiting on its peer's compute)."""
        start = time.monotonic()
        deadline, pause, look = start + timeout_s, 10e-6, start + _LIVENESS_S
        while True:
            self._check_cancelled()  # cancel() from another thread (GlooTransport)
            self._progress()
            if self._requests[request].done:
                del self._requests[request]
                return
            now = time.monotonic()
            if now > deadline:
                raise TransportError(f"{self._requests[request].desc}: no progress for {timeout_s:g} s "
                                     "(the peer is stalled or has failed)")
            if now > look:
                self._check_peers(self._requests[request].desc)
                look = now + _LIVENESS_S
            if now - start < _SPIN_S:
                time.sleep(0)
                continue
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE_S)

    def _check_peers(self, desc: str) -> None:
        """Raise if the process of a peer some request waits on has exited (shared memory says
        nothing when a peer dies; the pids come with the handles, so this needs no store, which
        may have died with its host rank)."""
        for channel in self._channels.values():
            if channel.queue and channel.peer_pid is not None and _process_gone(channel.peer_pid):
                raise TransportError(f"{desc} failed -- the peer has probably exited (rank {channel.peer_rank}, "
                                     f"process {channel.peer_pid}, is gone)")

    def describe_request(self, request: int) -> str:
        return self._requests[request].desc

    def pending(self, confirm_sends: bool = False) -> list:
        return [r.desc for r in list(self._requests.values()) if not r.done]

    def close(self, timeout_s: float = 30.0) -> None:
        """Release the shared memory (the owner's segments are unlinked)."""
        if any(c.device.type == "cuda" for c in self._channels.values()):
            torch.cuda.synchronize()  # no copy of ours may still read or write a slot
        for channel in self._channels.values():
            channel.slots = None
            for segment in channel.segments:
                segment.release()
        self._channels.clear()

    # ---- channels -------------------------------------------------------------------------------
    def _channel(self, kind: int, peer: int, sending: bool, tensor: torch.Tensor) -> _Channel:
        channel = self._channels.get((kind, peer, sending))
        if channel is None:
            src, dst = (self.host.stage, peer) if sending else (peer, self.host.stage)
            key = f"asyncpp/ipc/{self.run_id}/{self.stage_ranks[src]}-{self.stage_ranks[dst]}/{kind}"
            channel = _Channel(key, self.stage_ranks[peer], sending, tensor.device)
            self._channels[(kind, peer, sending)] = channel
            if sending:
                self._offer(channel, tensor)
        want = channel.slots
        if want is not None and (tensor.shape != want.shape[1:] or tensor.dtype != want.dtype):
            raise TransportError(f"stage {self.host.stage}: a {KIND_NAMES[kind]} of shape {tuple(tensor.shape)} "
                                 f"{tensor.dtype} for stage {peer}, but the link's slots hold "
                                 f"{tuple(want.shape[1:])} {want.dtype}; every message of a link must keep "
                                 "the shape the run started with")
        return channel

    def _offer(self, channel: _Channel, like: torch.Tensor) -> None:
        """Sender: make the control block, the slots and the W events; publish their handles."""
        control = _Segment(_CONTROL_BYTES)
        _use_control(channel, control)
        shape = (self.slots, *like.shape)
        if like.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            channel.slots = torch.empty(shape, dtype=like.dtype, device=like.device)
            try:
                slots = ("cuda", reduce_tensor(channel.slots))
            except RuntimeError as e:  # e.g. an allocator configuration without IPC handles
                raise TransportError(f"stage {self.host.stage}: the ipc transport cannot share CUDA memory here "
                                     f"({peer_failure_reason(e)}); check PYTORCH_CUDA_ALLOC_CONF (expandable_segments) "
                                     "or use --transport gloo") from None
        else:
            segment = _Segment(like.element_size() * like.numel() * self.slots)
            channel.segments.append(segment)
            channel.slots = segment.view(like.dtype, shape)
            slots = ("host", segment.name, shape, like.dtype)
        channel.own_events = _events(like.device, self.slots)
        self._publish(channel.key + "/offer", {"control": control.name, "slots": slots,
                                               "events": _event_handles(channel.own_events, like.device)})

    def _publish(self, key: str, offer: dict) -> None:
        self.store.set(key, pickle.dumps({"host": socket.gethostname(), "pid": os.getpid(), **offer}))

    def _peer_offer(self, channel: _Channel, suffix: str) -> dict | None:
        """The peer's published handles, once there (the store is asked every few ms at most)."""
        now = time.monotonic()
        if now < channel.next_look:
            return None
        channel.next_look = now + _STORE_POLL_S
        key = channel.key + suffix
        try:
            if not self.store.check([key]):
                return None
            offer = pickle.loads(self.store.get(key))
        except RuntimeError as e:  # the store lives in a rank (or launcher) that has gone
            raise TransportError(f"stage {self.host.stage}: waiting for the handles of rank {channel.peer_rank} "
                                 "failed -- a peer has probably exited (the rendezvous store is gone: "
                                 f"{peer_failure_reason(e)})") from None
        if offer["host"] != socket.gethostname():
            raise TransportError(f"stage {self.host.stage}: transport 'ipc' needs its peer on this host "
                                 f"({socket.gethostname()}), but rank {channel.peer_rank} runs on "
                                 f"{offer['host']}; use --transport gloo (or nccl) across hosts")
        return offer

    def _accept(self, channel: _Channel) -> bool:
        """Receiver: map the sender's control block, slots and W events; publish our R events."""
        if channel.slots is not None:
            return True
        offer = self._peer_offer(channel, "/offer")
        if offer is None:
            return False
        _use_control(channel, _Segment(name=offer["control"]))
        if offer["slots"][0] == "cuda":
            rebuild, args = offer["slots"][1]
            try:
                slots = rebuild(*args)
            except RuntimeError as e:
                raise TransportError(f"stage {self.host.stage}: the ipc transport cannot map the CUDA memory of "
                                     f"rank {channel.peer_rank} ({peer_failure_reason(e)}); use --transport gloo") from None
        else:
            _, name, shape, dtype = offer["slots"]
            segment = _Segment(name=name)
            channel.segments.append(segment)
            slots = segment.view(dtype, shape)
        channel.peer_events = _open_events(channel.device, offer["events"])
        channel.peer_pid = offer["pid"]
        channel.own_events = _events(channel.device, slots.shape[0])
        self._publish(channel.key + "/accept", {"events": _event_handles(channel.own_events, channel.device)})
        channel.slots = slots
        return True

    # ---- moving messages ------------------------------------------------------------------------
    def _queue(self, channel: _Channel, request: _Request) -> int:
        rid = next(self._ids)
        self._requests[rid] = request
        channel.queue.append(request)
        self._progress()
        return rid

    def _progress(self) -> None:
        for channel in self._channels.values():
            if channel.sending:
                self._write(channel)
            else:
                self._read(channel)

    def _accepted(self, channel: _Channel) -> bool:
        """Sender: the receiver's handles, once published (its R events on CUDA, its pid)."""
        if not channel.accepted:
            accept = self._peer_offer(channel, "/accept")
            if accept is None:
                return False
            channel.peer_events = _open_events(channel.device, accept["events"])
            channel.peer_pid, channel.accepted = accept["pid"], True
        return True

    def _write(self, channel: _Channel) -> None:
        """Sender: write queued messages while slots are free."""
        slots = channel.slots.shape[0]
        if channel.count and not channel.accepted:  # learn the receiver's pid early (liveness)
            self._accepted(channel)
        while channel.queue:
            n, i = channel.count, channel.count % slots
            if n >= slots:
                if C.counter_load(channel.free) <= n - slots:
                    return
                if channel.own_events and not self._accepted(channel):  # CUDA: R events needed
                    return
                if channel.peer_events:
                    _stream(channel.device).wait_event(channel.peer_events[i])
            request = channel.queue.popleft()
            channel.slots[i].copy_(request.tensor, non_blocking=True)
            if channel.own_events:
                channel.own_events[i].record(_stream(channel.device))
            C.counter_store(channel.full, n + 1)
            channel.count += 1
            request.tensor, request.done = None, True

    def _read(self, channel: _Channel) -> None:
        """Receiver: copy out, in order, every message the sender has counted."""
        if not channel.queue or not self._accept(channel):
            return
        slots = channel.slots.shape[0]
        while channel.queue and C.counter_load(channel.full) > channel.count:
            n, i = channel.count, channel.count % slots
            if channel.peer_events:
                _stream(channel.device).wait_event(channel.peer_events[i])
            request = channel.queue.popleft()
            request.tensor.copy_(channel.slots[i], non_blocking=True)
            if channel.own_events:
                channel.own_events[i].record(_stream(channel.device))
            C.counter_store(channel.free, n + 1)
            channel.count += 1
            request.tensor, request.done = None, True


__all__ = ["IpcTransport", "IPC_SLOTS_ENV", "DEFAULT_SLOTS", "slots_from_env"]
