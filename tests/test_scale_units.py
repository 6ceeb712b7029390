"""PP x DP building blocks without processes: rank layout, data shares, buckets, Muon shard
assignment, --dp/--dtype flags, bf16 autocast (tiny on CPU, real on CUDA)."""
import json

import pytest
import torch

from asyncpp_ext.optim.sharding import assign_owners, newton_schulz_cost
from asyncpp_ext.pipeline.data_parallel import GradientAverager, Layout, _bucket_ranges, replica_share
from asyncpp_ext.pipeline.recompute import resolve_autocast
from asyncpp_ext.training.cli import main

TINY = ["--model", "tiny", "--seq-len", "16", "--n-layer", "1", "--micro-batch-size", "2",
        "--microbatches", "2", "--steps", "3", "--eval-every", "0", "--ckpt-every", "0", "--no-progress",
        "--optimizer", "muon", "--lr", "0.01"]


def test_rank_layout_puts_a_replica_on_consecutive_ranks():
    layout = Layout(stages=3, replicas=2)
    assert layout.world == 6
    assert layout.pipeline_ranks(1) == [3, 4, 5]
    assert layout.dp_ranks(2) == [2, 5]
    assert [layout.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    with pytest.raises(ValueError, match="rank 7 is not in this layout's world of 6 ranks"):
        layout.coords(7)  # was (2, 1): a replica the layout does not have
    for stages, replicas, word in ((2, -1, "replicas"), (0, 1, "stages"), ("2", 1, "stages"), (2, True, "replicas")):
        with pytest.raises(ValueError, match=f"Layout's {word} must be an integer >= 1"):
            Layout(stages, replicas)


def test_replicas_take_disjoint_rows_that_cover_the_microbatch():
    mb = torch.arange(12).view(6, 2)
    shares = [replica_share(mb, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(shares), mb)
    with pytest.raises(ValueError, match="cannot be shared equally by 4 data-parallel replicas"):
        replica_share(mb, 0, 4)


def test_buckets_are_contiguous_last_parameter_first():
    ranges, bucket_of = _bucket_ranges([5, 3, 4, 2], bucket_elems=5)
    assert ranges == [(8, 14), (0, 8)]   # [p2, p3] then [p0, p1]: together the whole buffer
    assert bucket_of == [1, 1, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the fused scan; torch's
def test_the_averager_judges_each_bucket_by_this_replicas_values_before_its_all_reduce(dtype):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sizes = [5, 3, 4, 2]
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
        grad_flat = torch.zeros(sum(sizes), dtype=dtype)
        avg = GradientAverager(grad_flat, [params], dist.group.WORLD, replicas=2,
                               bucket_bytes=5 * grad_flat.element_size())
        assert avg.ranges == [(8, 14), (0, 8)]
        for bad, expected in ((None, -1), ({1: 2, 3: 0}, 1), ({2: 1}, 2)):
            grad_flat.fill_(1.0)
            for i, j in (bad or {}).items():  # parameter i's element j
                grad_flat[sum(sizes[:i]) + j] = float("nan") if i % 2 else float("inf")
            avg.arm()
            for i in reversed(range(len(sizes))):
                avg.grad_final(i)
                if i == 2:  # the first bucket's all-reduce has started: what arrives later is not ours
                    assert avg.hook_launches and avg._launched == 1
                    grad_flat[8:14] = float("nan")
            with pytest.raises(RuntimeError, match="call it after launch_rest"):
                avg.own_first_nonfinite()
            avg.launch_rest()
            assert avg.own_first_nonfinite() == expected
            avg.finish()
    finally:
        dist.destroy_process_group()


def test_muon_shards_are_balanced_and_cover_every_matrix():
    shapes = [(128, 32)] * 3 + [(32, 32)] * 4 + [(32, 128)]
    owners = assign_owners(shapes, 2)
    load = [sum(newton_schulz_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    assert sorted(set(owners)) == [0, 1]
    assert max(load) - min(load) <= newton_schulz_cost((32, 32))
    assert owners == assign_owners(shapes, 2)  # every rank derives the same assignment
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        assign_owners(shapes, 0)


def test_autocast_choice():
    assert resolve_autocast("auto", torch.device("cpu")) is None
    assert resolve_autocast("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_autocast("bf16", torch.device("cpu")) is torch.bfloat16
    assert resolve_autocast("fp32", torch.device("cuda")) is None
    assert resolve_autocast("bf16-params", torch.device("cpu")) is torch.bfloat16  # autocast stays on
    with pytest.raises(ValueError, match="choose auto, fp32, bf16 or bf16-params"):
        resolve_autocast("fp16", torch.device("cpu"))


@pytest.mark.parametrize("flags,message", [
    (["--dp", "0"], "--dp: pipeline.dp must be a positive integer, got 0"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice"),
])
def test_bad_scale_flags_are_named(tmp_path, capsys, flags, message):
    assert main(TINY + flags + ["--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err


def _losses(run_dir):
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_bf16_autocast_runs_on_cpu_when_asked(tmp_path):
    """Tiny on purpose (bf16 products are slow on CPU): the bf16 path changes the numbers a little."""
    assert main(TINY + ["--simulate", "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    assert main(TINY + ["--simulate", "--out", str(tmp_path / "fp32")]) == 0
    bf16, fp32 = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp32")
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=2e-2)


@pytest.mark.cuda
def test_bf16_is_the_cuda_default_with_fp32_master_state(tmp_path):
    flags = TINY + ["--simulate", "--device", "cuda"]
    assert main(flags + ["--out", str(tmp_path / "auto")]) == 0
    assert main(flags + ["--dtype", "fp32", "--out", str(tmp_path / "fp32")]) == 0
    auto, fp32 = _losses(tmp_path / "auto"), _losses(tmp_path / "fp32")
    assert auto != fp32 and auto == pytest.approx(fp32, rel=2e-2)
    state = torch.load(next((tmp_path / "auto").glob("ckpt-*/stage-*.pt")), weights_only=False)["engine"]
    assert all(t.dtype == torch.float32 for t in state["params"].values())
    assert all(v.dtype == torch.float32 for s in state["optimizer"]["state"].values()
               for v in s.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


@pytest.mark.cuda
def test_stage_forward_under_autocast_on_cuda():
    from asyncpp_ext.pipeline.stage import StageHost

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).cuda()
    host = StageHost(module, stage=0, stages=2, schedule="2bw", microbatches=1,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=None,
                     batch_source=lambda step: ([torch.randn(4, 8, device="cuda")], [None]),
                     autocast_dtype=torch.bfloat16, recompute=True)
    out = host.forward(0, 0, 0)
    assert out.dtype == torch.bfloat16           # activations in bf16
    assert host.flat[0].dtype == torch.float32   # master weights stay fp32
    host.backward(0, 0, 0, torch.ones_like(out))  # recomputed under autocast, grads in fp32
    assert host.grad_flat.dtype == torch.float32 and host.grad_flat.abs().sum() > 0

