"""Device and transport selection (pipeline/devices.py) with made-up GPU counts, the rank placement
asyncpp-train derives from the environment, and the host-staged gloo transport's bookkeeping,
all on CPU."""
import pytest
import torch

from asyncpp_ext.pipeline import devices
from asyncpp_ext.pipeline.devices import (DeviceError, check_local_world, choose_transport, local_world_size,
                                          process_group_backend, rank_device)
from asyncpp_ext.training.config import RunConfig


@pytest.mark.parametrize("requested,device,want", [
    ("auto", "cpu", "socket"), ("socket", "cpu", "socket"), ("auto", "cuda", "nccl"), ("auto", "cuda:3", "nccl"),
    ("gloo", "cpu", "gloo"), ("gloo", "cuda:0", "gloo"), ("torch", "cpu", "torch"),
    ("torch", "cuda", "torch"), ("nccl", "cuda:1", "nccl"),
])
def test_choose_transport(requested, device, want):
    assert choose_transport(requested, device) == want
    assert choose_transport(requested, torch.device(device)) == want


@pytest.mark.parametrize("requested,device,match", [
    ("nccl", "cpu", "transport 'nccl' moves CUDA tensors but device is 'cpu'"),
    ("bogus", "cpu", "unknown transport 'bogus'; choose one of auto, nccl, torch, gloo, socket"),
    ("socket", "cuda:0", "transport 'socket' moves CPU tensors but device is 'cuda:0'"),
    ("mpi", "cuda", "unknown transport 'mpi'"),
])
def test_choose_transport_refusals(requested, device, match):
    with pytest.raises(DeviceError, match=match):
        choose_transport(requested, device)
    assert issubclass(DeviceError, ValueError)


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
@pytest.mark.parametrize("transport", ["nccl", "torch", "auto"])
def test_one_gpu_per_rank_for_nccl_transports(launcher, transport):
    assert [rank_device("cuda", r, 4, 4, transport, launcher) for r in range(4)] == \
        ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    # fewer ranks than GPUs: each rank takes its local index
    assert [rank_device("cuda", r, 2, 8, transport, launcher) for r in range(2)] == ["cuda:0", "cuda:1"]


def test_gloo_shares_gpus_round_robin():
    assert [rank_device("cuda", r, 4, 1, "gloo") for r in range(4)] == ["cuda:0"] * 4
    assert [rank_device("cuda", r, 5, 2, "gloo") for r in range(5)] == \
        ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert rank_device("cuda", 3, 4, 1, "gloo", "torchrun") == "cuda:0"


@pytest.mark.parametrize("transport", ["gloo", "torch", "auto"])
def test_cpu_ranks_stay_on_cpu_whatever_the_gpu_count(transport):
    assert [rank_device("cpu", r, 3, g, transport) for r in range(3) for g in (0, 1, 8)] == ["cpu"] * 9


@pytest.mark.parametrize("transport", ["nccl", "torch", "auto"])
def test_more_ranks_than_gpus_is_refused_for_nccl_transports(transport):
    with pytest.raises(DeviceError, match=r"^4 ranks on this machine but 2 GPUs visible; transport '(nccl|torch)' "
                                          r"needs one GPU per rank: lower --stages x --dp, or use --transport ipc "
                                          r"\(or gloo\) to share GPUs$"):
        rank_device("cuda", 0, 4, 2, transport, "spawn")
    with pytest.raises(DeviceError, match=r"^2 ranks on this machine but 1 GPU visible; .*--nproc-per-node"):
        check_local_world(2, 1, transport, "torchrun")


def test_no_gpu_is_refused_for_every_transport():
    for transport in ("gloo", "torch", "nccl", "auto"):
        with pytest.raises(DeviceError, match="--device cuda but torch sees no CUDA GPU"):
            rank_device("cuda", 0, 1, 0, transport)


def test_bad_arguments():
    with pytest.raises(DeviceError, match="device must be 'cpu' or 'cuda'"):
        rank_device("tpu", 0, 1, 1, "gloo")
    with pytest.raises(ValueError, match="local_rank must be in"):
        rank_device("cuda", 2, 2, 2, "gloo")
    with pytest.raises(ValueError, match="launcher must be one of"):
        check_local_world(1, 1, "gloo", "mpirun")


def test_default_group_backend():
    assert process_group_backend("torch", "cuda:0") == "cpu:gloo,cuda:nccl"
    for transport, device in (("nccl", "cuda:0"), ("gloo", "cuda:0"), ("gloo", "cpu"), ("torch", "cpu")):
        assert process_group_backend(transport, device) == "gloo"


# ---- asyncpp-train's placement of a rank --------------------------------------------------------
def _cfg(device, transport, stages=2, dp=1):
    cfg = RunConfig()
    cfg.train.device, cfg.pipeline.transport, cfg.pipeline.stages, cfg.pipeline.dp = device, transport, stages, dp
    return cfg


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch pretends to see ``n`` GPUs; set_device calls are recorded instead of made."""
    chosen = []

    def install(n):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(str(d)))
        return chosen
    return install


@pytest.mark.parametrize("spawned,env,transport,gpus,want", [
    (True, {"LOCAL_RANK": "1"}, "auto", 2, ("cuda:1", "nccl", "gloo")),
    (True, {"LOCAL_RANK": "1"}, "gloo", 1, ("cuda:0", "gloo", "gloo")),
    (True, {"LOCAL_RANK": "1"}, "torch", 2, ("cuda:1", "torch", "cpu:gloo,cuda:nccl")),
    (False, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, "nccl", 4, ("cuda:3", "nccl", "gloo")),
    (False, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, "gloo", 2, ("cuda:1", "gloo", "gloo")),
])
def test_rank_placement_on_cuda(monkeypatch, fake_gpus, spawned, env, transport, gpus, want):
    from asyncpp_ext.training.distributed import rank_placement

    chosen = fake_gpus(gpus)
    monkeypatch.delenv("ASYNCPP_LOCAL_SPAWN", raising=False)
    if spawned:
        monkeypatch.setenv("ASYNCPP_LOCAL_SPAWN", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    stages = 2 if spawned else 4
    assert rank_placement(_cfg("cuda", transport, stages=stages)) == want
    assert chosen == [want[0]]


def test_rank_placement_on_cpu(monkeypatch, fake_gpus):
    from asyncpp_ext.training.distributed import rank_placement

    chosen = fake_gpus(8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_placement(_cfg("cpu", "auto")) == ("cpu", "socket", "gloo")
    assert rank_placement(_cfg("cpu", "torch")) == ("cpu", "torch", "gloo")
    assert chosen == []


def test_dtype_auto_is_bf16_autocast_on_cuda_ranks():
    """What a rank's Pipeline does with --dtype auto on the device rank_placement gave it."""
    from asyncpp_ext.pipeline.recompute import resolve_autocast

    assert resolve_autocast("auto", torch.device("cuda:1")) is torch.bfloat16
    assert resolve_autocast("auto", torch.device("cpu")) is None
    assert resolve_autocast("fp32", torch.device("cuda:0")) is None


def test_the_module_names_its_public_api():
    assert set(devices.__all__) >= {"choose_transport", "rank_device", "check_local_world", "process_group_backend"}


# ---- checkpoints: written as CPU tensors, loaded with map_location ------------------------------
def test_to_cpu_keeps_the_structure_and_detaches():
    from asyncpp_ext.training.checkpoint import to_cpu

    w = torch.ones(3, requires_grad=True) * 2
    state = {"params": {"a": w}, "optimizer": {"state": {"a": {"step": torch.tensor(3.0), "lr": 0.1}},
                                               "param_groups": [{"params": ["a"], "betas": (0.9, 0.95)}]},
             "steps_done": 3, "list": [w, "x"]}
    out = to_cpu(state)
    assert not out["params"]["a"].requires_grad and torch.equal(out["params"]["a"], w.detach())
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert isinstance(out["list"], list) and out["list"][1] == "x" and out["steps_done"] == 3


def test_a_shard_is_saved_through_to_cpu_and_loaded_onto_the_cpu(tmp_path, monkeypatch):
    """What a GPU run writes passes through to_cpu (every tensor .cpu()), and every load maps to the
    CPU (then load_state_dict copies onto the run's device): a CUDA checkpoint resumes on CPU and
    the other way round. Without a GPU, a CUDA tensor is stood in for by a tensor whose .cpu() is
    recorded."""
    from asyncpp_ext.training import checkpoint as ck

    moved = []

    class DeviceTensor(torch.Tensor):  # pretends to live elsewhere: records the move to the host
        def cpu(self):
            moved.append(tuple(self.shape))
            return torch.Tensor(self).as_subclass(torch.Tensor).clone()

    weight = torch.arange(6.0).reshape(2, 3).as_subclass(DeviceTensor)
    engine = {"schedule": "2bw", "steps_done": 1, "params": {"w": weight}, "stash": {"w": weight},
              "optimizer": {"state": {}, "param_groups": []}}
    loads = []
    real_load = torch.load
    monkeypatch.setattr(ck.torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    ck.save_checkpoint(tmp_path, 1, [engine], {"config": {}, "data": {}})
    assert sorted(moved) == [(2, 3), (2, 3)]
    _, shards = ck.load_checkpoint(ck.checkpoint_path(tmp_path, 1))
    assert loads == [{"map_location": "cpu", "weights_only": True}]
    got = shards[0]["engine"]["params"]["w"]
    assert type(got) is torch.Tensor and got.device.type == "cpu" and torch.equal(got, torch.arange(6.0).reshape(2, 3))
    # the weights-only readers (asyncpp-export, --init-from) map the files, onto the CPU too
    into = torch.nn.Module()
    into.w = torch.nn.Parameter(torch.zeros(2, 3))
    ck.load_weights(into, ck.checkpoint_path(tmp_path, 1))
    assert loads[1:] == [{"map_location": "cpu", "weights_only": True, "mmap": True}]
    assert torch.equal(into.w, torch.arange(6.0).reshape(2, 3))


def test_local_world_size_spawn_counts_every_rank_torchrun_reads_its_environment():
    assert local_world_size("spawn", 4, {"LOCAL_WORLD_SIZE": "2"}) == 4
    assert local_world_size("torchrun", 4, {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "8"}) == 2
    assert local_world_size("torchrun", 4, {"WORLD_SIZE": "8"}) == 8
    with pytest.raises(ValueError, match="launcher"):
        local_world_size("mpirun", 4, {})


def test_a_local_launch_of_more_ranks_than_the_cores_hold_is_refused():
    devices.check_spawned_ranks(16, 2)  # 8 per core: starts
    with pytest.raises(DeviceError, match=r"--stages x --dp is 17 ranks to start on this machine, more than 8 "
                                          r"per core for its 2 cores \(at most 16\)"):
        devices.check_spawned_ranks(17, 2)


def test_asyncpp_train_refuses_more_ranks_than_the_cores_hold_before_starting_one(tmp_path):
    """--stages 500 started 500 interpreters on a 2-core machine and looked hung."""
    import os
    import subprocess
    import sys

    ranks = devices.MAX_RANKS_PER_CORE * devices.usable_cores() + 1
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", "--stages", str(ranks), "--microbatches",
                        str(ranks), "--n-layer", str(ranks), "--out", str(out)], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"--stages x --dp is {ranks} ranks to start on this machine" in r.stderr
    assert not out.exists()
