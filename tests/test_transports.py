"""The Python transports on CPU: ``torch`` (a gloo group per link and direction here, NCCL groups on
CUDA) gives bitwise the default transport's losses; the host-staged receive path of ``gloo`` on
CUDA, forced on CPU tensors, too; the torch transport's groups are created collectively in one
order on every rank; a lost peer is a TransportError naming it."""
import json

import pytest
import torch
import torch.distributed as dist

from asyncpp_ext.pipeline import LaunchError, spawn
from asyncpp_ext.pipeline import transport as tr
from asyncpp_ext.training.cli import main

import transport_workers as tw

TINY = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "16", "--no-progress", "--n-layer", "2",
        "--schedule", "2bw", "--microbatches", "2", "--optimizer", "muon", "--ef-beta", "0.5", "--lr", "0.01",
        "--eval-every", "2", "--ckpt-every", "0", "--threads", "1"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.parametrize("transport,layout", [  # 2x2 (slow): the dp all-reduce is covered by test_scale_out
    pytest.param("torch", ["--stages", "2"], id="torch-2x1"),
    pytest.param("gloo", ["--stages", "2"], id="gloo-2x1"),
    pytest.param("torch", ["--stages", "2", "--dp", "2"], id="torch-2x2", marks=pytest.mark.slow)])
def test_python_transports_give_the_default_transports_losses(tmp_path, transport, layout):
    steps = ["--steps", "4"] if "--dp" not in layout else ["--steps", "2"]
    assert main(TINY + layout + steps + ["--transport", transport, "--out", str(tmp_path / transport)]) == 0
    assert main(TINY + layout + steps + ["--out", str(tmp_path / "default")]) == 0  # socket on CPU
    got, want = _rows(tmp_path / transport), _rows(tmp_path / "default")
    assert len(got) == len(want) > 0
    for key in ("loss", "eval_loss"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want]  # bitwise
    config = json.loads((tmp_path / transport / "config.json").read_text())
    assert config["pipeline"]["transport"] == transport
    assert json.loads((tmp_path / "default" / "config.json").read_text())["pipeline"]["transport"] == "auto"


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_intra_op_thread")
def test_host_staged_receives_give_the_direct_losses(tmp_path):
    steps = 5
    for force in (True, False):
        spawn(tw.staged_train_worker, 2, ("gloo", force, steps, str(tmp_path)))
    staged = json.loads((tmp_path / "losses_gloo_staged.json").read_text())
    direct = json.loads((tmp_path / "losses_gloo_direct.json").read_text())
    assert len(staged) == steps and staged == direct


@pytest.mark.multiproc
@pytest.mark.parametrize("transport,payload", [("torch", "shape ("), ("socket", " bytes)")])
def test_a_lost_peer_is_named(tmp_path, capfd, transport, payload):
    with pytest.raises(LaunchError):
        spawn(tw.peer_exits_worker, 2, (transport,), grace_s=20)
    err = capfd.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith("asyncpp: rank 0:"))
    assert "stage 1 (rank 1" in line and "step " in line and "microbatch " in line and payload in line, err


@pytest.mark.multiproc
def test_socket_transport_size_disagreement_ends_both_ranks_with_a_message(tmp_path):
    spawn(tw.socket_mismatch_worker, 2, (str(tmp_path),))
    receiver = json.loads((tmp_path / "mismatch1.json").read_text())
    sender = json.loads((tmp_path / "mismatch0.json").read_text())
    assert "activation (step 0, microbatch 0) from stage 0 (rank 0) is 16 bytes but this stage expects 20" \
        in receiver and "shape or dtype" in receiver, receiver
    assert "recv gradient (step 0, microbatch 0) from stage 1 (rank 1" in sender and \
        "closed the connection" in sender, sender


@pytest.mark.multiproc
def test_socket_transport_reuses_its_receive_slots(tmp_path):
    spawn(tw.socket_slots_worker, 2, (str(tmp_path),))
    first = json.loads((tmp_path / "slots0.json").read_text())
    last = json.loads((tmp_path / "slots1.json").read_text())
    assert first[0][:2] == [0, first[1][1]] and last[0][:2] == [last[1][0], 0]  # each end receives one kind
    for counts in (first, last):  # 3 steps, then 9 more: no new slot or send hold once the pipeline is full
        assert counts[0] == counts[1] and 0 < max(counts[1][:2]) <= 4 + 2, counts
        assert 0 < counts[1][2] <= 8 + 2, counts  # up to 8 sends in flight, and finished ones not yet collected


class _FakeDist:
    """Records new_group/send/recv as one rank would issue them."""

    def __init__(self):
        self.calls = []

    def new_group(self, ranks, timeout=None, backend=None):
        self.calls.append(("new_group", tuple(ranks), backend))
        return f"group{len([c for c in self.calls if c[0] == 'new_group']) - 1}"

    def send(self, tensor, dst, group):
        self.calls.append(("send", dst, group))

    def recv(self, tensor, src, group):
        self.calls.append(("recv", src, group))


@pytest.mark.parametrize("stages,dp", [(2, 1), (3, 2), (4, 2)])
def test_link_groups_are_created_in_one_order_on_every_rank(monkeypatch, stages, dp):
    pipelines = [[r * stages + s for s in range(stages)] for r in range(dp)]
    seen = {}
    for replica in range(dp):
        for stage in range(stages):
            fake = _FakeDist()
            monkeypatch.setattr(tr, "dist", fake)
            groups = tr.create_link_groups(pipelines, stage, replica, torch.device("cpu"), 30)
            seen[(replica, stage)] = fake.calls, groups
    creations = {tuple(c for c in calls if c[0] == "new_group") for calls, _ in seen.values()}
    assert len(creations) == 1  # every rank creates every group, in the same order
    (created,) = creations
    assert len(created) == dp * (stages - 1) * 2 and all(c[2] == "gloo" for c in created)
    for (replica, stage), (calls, groups) in seen.items():
        me = pipelines[replica][stage]
        links = [link for link in (stage - 1, stage) if 0 <= link < stages - 1]
        assert sorted(groups) == sorted((kind, link) for link in links for kind in (0, 1))
        for (kind, link), name in groups.items():  # the group holds this rank and its neighbour
            index = int(name[len("group"):])
            assert created[index][1] == (pipelines[replica][link], pipelines[replica][link + 1])
            assert me in created[index][1]
        # one first message per group, in creation order: the lower stage sends
        probes = [c for c in calls if c[0] in ("send", "recv")]
        assert [c[2] for c in probes] == sorted(groups.values(), key=lambda n: int(n[5:]))
        for op, peer, name in probes:
            assert (op == "send") == (peer == me + 1)


def test_torch_transport_routes_each_kind_and_link_to_its_group():
    class Host:
        stage = 1
    t = tr.TorchTransport(Host(), [0, 1, 2], {(0, 0): "a0", (1, 0): "g0", (0, 1): "a1", (1, 1): "g1"})
    assert [t._group(0, 0), t._group(1, 0), t._group(0, 2), t._group(1, 2)] == ["a0", "g0", "a1", "g1"]
    assert not t._staged(torch.zeros(1)) and t.host_staging is False
    assert tr.GlooTransport(Host(), [0, 1, 2])._group(0, 2) is None  # the default group
