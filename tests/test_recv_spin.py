"""How long a waited-for socket receive polls before it sleeps (ASYNCPP_RECV_SPIN_US): the auto
rule, explicit values, refusals, and that a spinning receive still gets its data and still times
out at its own deadline."""
import json

import pytest

from asyncpp_ext import _C as C
from asyncpp_ext.pipeline import spawn
from asyncpp_ext.pipeline.sockets import AUTO_RECV_SPIN_US, MAX_RECV_SPIN_US, RECV_SPIN_ENV, recv_spin_us

import transport_workers as tw


@pytest.mark.parametrize("environ,cpus,expected", [
    ({"WORLD_SIZE": "2"}, 2, AUTO_RECV_SPIN_US),  # one core per rank: spin
    ({"WORLD_SIZE": "4"}, 2, 0),  # more ranks than cores: a spinning rank would starve another
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "8"}, 2, AUTO_RECV_SPIN_US),  # torchrun: this machine's ranks
    ({"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "3"}, 2, 0),
    ({}, 1, AUTO_RECV_SPIN_US),  # a single process
    ({RECV_SPIN_ENV: "auto", "WORLD_SIZE": "4"}, 2, 0),
    ({RECV_SPIN_ENV: " AUTO ", "WORLD_SIZE": "2"}, 2, AUTO_RECV_SPIN_US),
    ({RECV_SPIN_ENV: "0", "WORLD_SIZE": "2"}, 2, 0),
    ({RECV_SPIN_ENV: "250", "WORLD_SIZE": "8"}, 2, 250),  # explicit: whatever the machine
    ({RECV_SPIN_ENV: str(MAX_RECV_SPIN_US)}, 2, MAX_RECV_SPIN_US),
])
def test_spin_from_the_environment(environ, cpus, expected):
    assert recv_spin_us(environ, cpus=cpus) == expected


@pytest.mark.parametrize("value", ["fast", "-1", "1.5", "1e3", str(MAX_RECV_SPIN_US + 1)])
def test_a_bad_spin_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"{RECV_SPIN_ENV}=.*use auto or a whole number of microseconds"):
        recv_spin_us({RECV_SPIN_ENV: value}, cpus=2)


@pytest.mark.parametrize("spin", [-1, MAX_RECV_SPIN_US + 1])
def test_the_binding_refuses_a_spin_out_of_range(spin):
    board = C.MessageBoard(tw._SlotHost(4))
    with pytest.raises(ValueError, match=r"recv_spin_us must lie in \[0, 1000000\]"):
        C.SocketTransport(0, C.SocketListener("127.0.0.1"), [], 1, 1.0, board, recv_spin_us=spin)


@pytest.mark.multiproc
@pytest.mark.parametrize("spin_us", [0, 100_000, MAX_RECV_SPIN_US])  # blocks at once / spins, then blocks / spins
def test_a_spinning_receive_gets_its_data_and_times_out_at_its_deadline(tmp_path, spin_us):
    spawn(tw.socket_spin_worker, 2, (str(tmp_path), spin_us))
    assert json.loads((tmp_path / "spin1.json").read_text()) == {"received": [0.0, 1.0, 2.0, 3.0]}
    sender = json.loads((tmp_path / "spin0.json").read_text())
    assert sender["error"] is not None and "no progress for 0.2 s" in sender["error"], sender
    # A 1 s spin that ignored the wait's deadline would hold it for 1 s.
    assert sender["waited_s"] < 0.9, sender
