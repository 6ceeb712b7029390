"""The NCCL transport: rendezvous, argument checks and clear failures on CPU; real transfers and a
2-stage pipeline on CUDA (multi-process, needs 2 GPUs)."""
import datetime
import json
import os
import threading

import pytest
import torch
import torch.distributed as dist

import asyncpp_ext.pipeline.nccl as nccl
from asyncpp_ext import _C as C
from asyncpp_ext.pipeline.nccl import nccl_candidates
from asyncpp_ext.pipeline import Pipeline, spawn
from asyncpp_ext.pipeline.nccl import (Channel, NcclUnavailableError, RendezvousError, channel_plan,
                                       exchange_unique_ids, rendezvous_key)
from asyncpp_ext.pipeline.stage import ACTIVATION, GRADIENT

ID = bytes(range(128))


def _nccl_loadable() -> bool:
    return bool(C.nccl_load(nccl_candidates())["ok"])


# ---- rendezvous ---------------------------------------------------------------------------------
def test_rendezvous_keys_name_run_kind_and_link():
    assert rendezvous_key("r7", ACTIVATION, 3) == "asyncpp/nccl/r7/act/3"
    assert rendezvous_key("r7", GRADIENT, 0) == "asyncpp/nccl/r7/grad/0"
    with pytest.raises(ValueError, match="kind must be"):
        rendezvous_key("r7", 2, 0)


def test_channel_plan_gives_each_communicator_one_sender_and_one_receiver():
    assert channel_plan(0, 1) == []
    assert channel_plan(0, 3) == [Channel(ACTIVATION, True, 1, 0), Channel(GRADIENT, False, 1, 0)]
    assert channel_plan(2, 3) == [Channel(ACTIVATION, False, 1, 1), Channel(GRADIENT, True, 1, 1)]
    stages = 5
    roles = {}
    for s in range(stages):
        for ch in channel_plan(s, stages):
            roles.setdefault((ch.kind, ch.link), []).append((s, ch.is_send, ch.peer))
    assert sorted(roles) == [(k, link) for k in (ACTIVATION, GRADIENT) for link in range(stages - 1)]
    for (kind, link), ends in roles.items():
        sender = link if kind == ACTIVATION else link + 1  # activations flow down, gradients up
        receiver = link + 1 if kind == ACTIVATION else link
        assert sorted(ends) == sorted([(sender, True, receiver), (receiver, False, sender)])
    for bad in [(3, 3), (-1, 3), (0, 0)]:
        with pytest.raises(ValueError, match="stage"):
            channel_plan(*bad)


def test_exchange_pairs_every_receiver_with_its_senders_id():
    store, stages, ranks = dist.HashStore(), 4, [10, 11, 12, 13]
    results, errors = {}, []

    def stage_main(s):
        try:
            results[s] = exchange_unique_ids(store, "t", s, stages, ranks, make_id=lambda: os.urandom(128),
                                             timeout_s=5)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=stage_main, args=(s,)) for s in reversed(range(stages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ids = {}
    for s, channels in results.items():
        assert [c[:3] for c in channels] == [(c.kind, c.is_send, c.peer) for c in channel_plan(s, stages)]
        for kind, is_send, peer, peer_rank, uid in channels:
            assert peer_rank == ranks[peer] and len(uid) == 128
            link = min(s, peer)
            ids.setdefault((kind, link), set()).add(uid)
            assert store.get(rendezvous_key("t", kind, link)) == uid
    assert len(ids) == 2 * (stages - 1)
    assert all(len(both_ends) == 1 for both_ends in ids.values())  # sender and receiver agree
    assert len({next(iter(v)) for v in ids.values()}) == len(ids)  # every communicator has its own id


def test_exchange_times_out_naming_the_missing_peer():
    store = dist.HashStore()
    with pytest.raises(RendezvousError, match=r"stage 1: stage 0 \(rank 7\) did not publish its NCCL id under "
                                              r"'asyncpp/nccl/lonely/act/0' within 0.3 s"):
        exchange_unique_ids(store, "lonely", 1, 2, [7, 8], make_id=lambda: ID, timeout_s=0.3)
    # its own id (the gradient it sends to stage 0) was published before it waited
    assert store.get("asyncpp/nccl/lonely/grad/0") == ID


@pytest.mark.parametrize("run_id", ["", "a/b", 3])
def test_exchange_rejects_bad_run_ids(run_id):
    with pytest.raises(ValueError, match="run_id"):
        exchange_unique_ids(dist.HashStore(), run_id, 0, 2, [0, 1], make_id=lambda: ID)


def test_exchange_rejects_wrong_id_sizes_and_rank_lists():
    with pytest.raises(ValueError, match="128"):
        exchange_unique_ids(dist.HashStore(), "x", 0, 2, [0, 1], make_id=lambda: b"short")
    with pytest.raises(ValueError, match="one rank per stage"):
        exchange_unique_ids(dist.HashStore(), "x", 0, 2, [0], make_id=lambda: ID)


# ---- the C++ transport's checks (before any NCCL or CUDA call) ----------------------------------
class _NoReceives:
    def new_recv_buffer(self, kind):
        raise AssertionError("these checks never receive")


def _board():
    return C.MessageBoard(_NoReceives())


def test_cpp_transport_needs_a_message_board():
    with pytest.raises(ValueError, match="board must be the stage host's MessageBoard"):
        C.NcclTransport(1, 0, 0, [(0, False, 0, 0, ID)], None)


@pytest.mark.parametrize("channels,match", [
    ([(0, True, 0, 1, ID)], "stage 1 sends activations to stage 2, not stage 0"),
    ([(1, True, 2, 1, ID)], "stage 1 sends gradients to stage 0, not stage 2"),
    ([(0, False, 2, 1, ID)], "stage 1 receives activations from stage 0, not stage 2"),
    ([(2, True, 2, 1, ID)], "kind must be 0"),
    ([(0, False, 0, 0, ID), (0, False, 0, 0, ID)], "a second activation receive channel"),
    ([(0, False, 0, 0, ID[:100])], "unique_id must be 128 bytes"),
    ([(0, False, 0, 0, "not bytes")], "unique_id must be bytes"),
    ([(0, False, 0, -1, ID)], "peer_rank must be >= 0"),
    ([(0, False, 0)], "must be \\(kind, is_send, peer_stage, peer_rank, unique_id\\)"),
])
def test_cpp_transport_rejects_bad_channels(channels, match):
    with pytest.raises(ValueError, match=match):
        C.NcclTransport(1, 0, 0, channels, _board())


def test_cpp_transport_without_nccl_or_gpu_fails_clearly():
    channels = [(ACTIVATION, False, 0, 0, ID), (GRADIENT, True, 0, 0, ID)]
    if not C.build_config()["cuda_compiled"]:
        expected = "built without CUDA"
    elif not _nccl_loadable():
        expected = "NCCL is not loaded: install the nvidia-nccl-cu12/cu13 wheel or set NCCL_LIBRARY"
    elif C.cuda_device_count() == 0:
        expected = "CUDA device 0 is not available"
    else:
        pytest.skip("NCCL and a GPU are available: the CUDA tests cover this machine")
    with pytest.raises(RuntimeError, match=expected):
        C.NcclTransport(1, 0, 0, channels, _board())


@pytest.mark.skipif(_nccl_loadable(), reason="NCCL is loadable here")
def test_unique_id_needs_nccl():
    with pytest.raises(RuntimeError, match="NCCL is not loaded"):
        C.nccl_unique_id()


# ---- the Python checks: what to install, rebuild or choose --------------------------------------
@pytest.mark.skipif(_nccl_loadable(), reason="NCCL is loadable here")
def test_missing_nccl_says_what_to_install(monkeypatch):
    if not C.build_config()["cuda_compiled"]:
        pytest.skip("this build has no CUDA; the rebuild message is tested separately")
    monkeypatch.setattr(nccl, "nccl_candidates", lambda: ["/nonexistent/libnccl.so.2"])
    with pytest.raises(NcclUnavailableError, match="pip install nvidia-nccl-cu12 .*NCCL_LIBRARY") as e:
        nccl.require_nccl()
    assert "/nonexistent/libnccl.so.2" in str(e.value)


def test_build_without_cuda_says_to_rebuild(monkeypatch):
    class NoCuda:
        def __getattr__(self, name):
            return getattr(C, name)

        @staticmethod
        def build_config():
            return dict(C.build_config(), cuda_compiled=False)

    monkeypatch.setattr(nccl, "C", NoCuda())
    with pytest.raises(NcclUnavailableError, match="built without CUDA .*put nvcc on PATH and rebuild"):
        nccl.require_nccl()


def test_create_transport_rejects_cpu_devices():
    with pytest.raises(ValueError, match="runs on a CUDA device, got device='cpu'"):
        nccl.create_nccl_transport(None, 0, 2, [0, 1], "cpu", store=dist.HashStore())


@pytest.fixture
def one_rank_world(free_port):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _blocks():
    return [torch.nn.Linear(4, 4)]


def _sgd(module):
    return torch.optim.SGD(module.parameters(), lr=0.1)


@pytest.mark.parametrize("device,transport,match", [
    ("cpu", "nccl", "transport 'nccl' moves CUDA tensors but device is 'cpu'"),
    ("cpu", "mpi", "unknown transport 'mpi'"),
])
def test_pipeline_rejects_transport_device_mismatches(one_rank_world, device, transport, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(_blocks(), loss_fn=torch.nn.functional.mse_loss, optimizer=_sgd, schedule="1f1b",
                 microbatches=1, device=device, transport=transport)


@pytest.mark.skipif(torch.cuda.is_available() and _nccl_loadable(), reason="NCCL can run here")
def test_pipeline_on_cuda_without_nccl_or_gpu_fails_clearly(one_rank_world):
    if torch.cuda.is_available():  # the GPU is there: what is missing is NCCL
        if _nccl_loadable():
            pytest.skip("this machine has a GPU and NCCL")
        error, match = NcclUnavailableError, "nvidia-nccl-cu12|needs a GPU|built without CUDA"
    else:  # named first: without a GPU, installing NCCL would not help
        error, match = ValueError, "device 'cuda' but torch sees no CUDA device; use device='cpu'"
    with pytest.raises(error, match=match):
        Pipeline(_blocks(), loss_fn=torch.nn.functional.mse_loss, optimizer=_sgd, schedule="1f1b",
                 microbatches=1, device="cuda")


def test_pipeline_on_cpu_takes_the_socket_transport(one_rank_world):
    pipe = Pipeline(_blocks(), loss_fn=torch.nn.functional.mse_loss, optimizer=_sgd, schedule="1f1b",
                    microbatches=1)
    assert type(pipe.transport).__name__ == "SocketTransport" and pipe.device == torch.device("cpu")


# ---- on GPUs: real transfers and a 2-stage pipeline ---------------------------------------------
def _two_gpus_with_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    if not _nccl_loadable():
        pytest.skip("NCCL is not loadable (pip install nvidia-nccl-cu12)")


@pytest.mark.cuda
@pytest.mark.multiproc
def test_transfers_arrive_bit_exact_for_every_dtype(tmp_path):
    import nccl_workers

    _two_gpus_with_nccl()
    spawn(nccl_workers.transfer_worker, 2, (str(tmp_path),))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"transfer{rank}.json").read_text()) == [True] * 5


@pytest.mark.cuda
@pytest.mark.multiproc
def test_a_silent_peer_times_out_naming_message_rank_and_timeout(tmp_path):
    import nccl_workers

    _two_gpus_with_nccl()
    spawn(nccl_workers.timeout_worker, 2, (str(tmp_path),))
    wait_error, later_error = json.loads((tmp_path / "timeout.json").read_text())
    assert "recv gradient (step 0, microbatch 0) from stage 1 (rank 1) made no progress for 2 s" in wait_error
    assert "was aborted after an earlier failure" in later_error


@pytest.mark.cuda
@pytest.mark.multiproc
def test_cancel_ends_a_wait_in_progress_from_another_thread(tmp_path):
    import nccl_workers

    _two_gpus_with_nccl()
    spawn(nccl_workers.cancel_worker, 2, (str(tmp_path),))
    result = json.loads((tmp_path / "cancel.json").read_text())
    assert result["error"].startswith("stage 0: NCCL transport: the pipeline was closed"), result
    assert result["waited_s"] < 2.0, result  # not its 30 s deadline
    assert "was aborted after an earlier failure" in result["later"], result


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_two_stage_pipeline_on_nccl_matches_gloo_on_cpu(tmp_path, schedule):
    import nccl_workers

    _two_gpus_with_nccl()
    m, steps = 2, 6
    for kind in ("cpu", "cuda"):
        spawn(nccl_workers.pipeline_worker, 2, (kind, schedule, m, steps, str(tmp_path)))
    cpu = json.loads((tmp_path / "losses_cpu.json").read_text())
    cuda = json.loads((tmp_path / "losses_cuda.json").read_text())
    assert len(cpu) == len(cuda) == steps
    assert cuda == pytest.approx(cpu, rel=1e-5, abs=1e-7)


# ---- the one-GPU self-test ----------------------------------------------------------------------
def test_self_test_cases_cover_every_dtype_and_size_class():
    cases = nccl.self_test_cases()
    assert {d for d, _, _ in cases} == {"float32", "bfloat16", "float16", "int64", "uint8"}
    for dtype, size in nccl.SELF_TEST_DTYPES.items():
        nbytes = sorted(size * n for d, _, n in cases if d == dtype)
        assert nbytes[0] == size  # one element
        assert all(n % 2 for _, _, n in cases if n > 1), "counts near a target are odd"
        for target, got in zip((1000, 4 << 10, 1 << 20, 64 << 20), nbytes[1:]):
            assert target - size <= got <= target + size, (dtype, target, got)
    quick = nccl.self_test_cases(quick=True)
    assert [c for c in quick if c[1] * c[2] >= 64 << 20] == [("uint8", 1, (64 << 20) | 1)]


def test_self_test_binding_names_bad_arguments():
    with pytest.raises(ValueError, match="device must be"):
        C.nccl_self_test(-1, [("uint8", 1, 1)])
    with pytest.raises(ValueError, match="spin_ms"):
        C.nccl_self_test(0, [("uint8", 1, 1)], -1.0)
    with pytest.raises(ValueError, match="at least one"):
        C.nccl_self_test(0, [])
    with pytest.raises(ValueError, match=r"cases\[1\]: element_size"):
        C.nccl_self_test(0, [("uint8", 1, 1), ("x", 3, 1)])
    with pytest.raises(ValueError, match=r"cases\[0\]: count"):
        C.nccl_self_test(0, [("uint8", 1, 0)])
    with pytest.raises(ValueError, match=r"cases\[0\] must be"):
        C.nccl_self_test(0, [("uint8", 1)])
    with pytest.raises(ValueError, match="CUDA device"):
        nccl.self_test("cpu")


@pytest.mark.cuda
def test_self_test_on_one_gpu_is_bit_exact_and_ordered():
    if not _nccl_loadable():
        pytest.skip("NCCL is not loadable here (pip install nvidia-nccl-cu12/cu13)")
    r = nccl.self_test("cuda:0")
    assert len(r["cases"]) == len(nccl.self_test_cases())
    bad = [c for c in r["cases"] + [r["ordering"]] if c["mismatches"]]
    assert not bad, bad
    assert r["ok"] and r["ordering"]["bytes"] == max(c["bytes"] for c in r["cases"])
    # The delayed producer really held the transfer back (else the ordering case proves nothing).
    assert r["ordering"]["seconds"] >= r["spin_ms"] / 1e3
