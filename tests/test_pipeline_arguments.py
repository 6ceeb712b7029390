"""``Pipeline``'s arguments are checked where they are given, each error naming the argument and
the fix: an optimizer factory that returns nothing would otherwise train nothing, a negative
clipping norm would clip nothing, and other mistakes would surface as a binding's signature or a
tuple-unpacking error deep in a rank."""
import pytest
import torch
import torch.distributed as dist

from asyncpp_ext.data import BatchStream, builtin_corpus
from asyncpp_ext.models import GPT, preset_config
from asyncpp_ext.optim import build_optimizer
from asyncpp_ext.optim.lr_schedule import LRSchedule
from asyncpp_ext.pipeline import Pipeline


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return GPT(preset_config("tiny"))


def _pipeline(**overrides):
    kwargs = dict(loss_fn=GPT.loss, optimizer=lambda m: build_optimizer(m, "adamw"), microbatches=2,
                  schedule="2bw", timeout_s=60)
    return Pipeline(_model(), **{**kwargs, **overrides})


@pytest.mark.parametrize("overrides, error, match", [
    ({"optimizer": None}, TypeError, "optimizer must be a factory, module -> torch.optim.Optimizer .* got None"),
    ({"optimizer": torch.optim.AdamW}, TypeError, "got the class AdamW; pass e.g. lambda m: build_optimizer"),
    ({"loss_fn": None}, TypeError, "loss_fn must be callable"),
    ({"microbatches": 2.0}, ValueError, "microbatches must be an integer >= 1, got 2.0"),
    ({"recv_ahead": 0}, ValueError, "recv_ahead must be an integer >= 1, got 0"),
    ({"stages": "1"}, ValueError, "stages must be an integer >= 1, got '1'"),
    ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm must be a number > 0 .*got -1.0"),
    ({"clip_grad_norm": float("nan")}, ValueError, "clip_grad_norm must be a number > 0 .*got nan"),
    ({"lr_schedule": "cosine"}, TypeError, "lr_schedule must be an LRSchedule .* got str"),
    ({"lr_schedule": LRSchedule("constant", -5)}, ValueError, "steps must be a positive integer, got -5"),
    ({"microbatches": 2**40}, ValueError, "microbatches must be at most 2147483647, got 1099511627776"),
    ({"recompute": "no"}, TypeError, "recompute must be True or False, got 'no'"),
    ({"compile": 1}, TypeError, "compile must be True or False, got 1"),
    ({"dp": True}, ValueError, "dp must be a positive integer dividing the world size 1, got True"),
    ({"device": "gpu"}, ValueError, "device 'gpu' is not a device name torch knows; use 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": 5}, ValueError, "device must be a string or torch.device such as 'cpu'"),
    ({"device": "meta"}, ValueError, "device 'meta': the pipeline runs on 'cpu' or 'cuda'"),
    # not a missing NCCL (the transport auto picks on CUDA): the GPU is what is missing
    ({"device": "cuda:99"}, ValueError, "device 'cuda:99' but torch sees (no|\\d+) CUDA device"),
    # a kernel name is checked whatever the head (it trained as plain before)
    ({"head_loss_kernel": "magic"}, ValueError, "unknown head_loss_kernel 'magic'; choose auto, liger, cce, chunked"),
])
def test_bad_arguments_are_named_at_construction(one_rank, overrides, error, match):
    with pytest.raises(error, match=match):
        _pipeline(**overrides)


def test_an_optimizer_instance_or_a_factory_without_its_return_is_refused(one_rank):
    model = _model()
    with pytest.raises(TypeError, match=r"got an optimizer instance \(AdamW\)"):
        Pipeline(model, loss_fn=GPT.loss, optimizer=torch.optim.AdamW(model.parameters()), microbatches=2)

    def forgot_return(m):
        build_optimizer(m, "adamw")

    with pytest.raises(TypeError, match="the optimizer factory returned NoneType, not a torch.optim.Optimizer"):
        _pipeline(optimizer=forgot_return)


def test_minibatches_that_do_not_fit_the_pipeline_are_named(one_rank):
    tokens = builtin_corpus()[:20_000].astype("int64")
    pipe = _pipeline()
    with pipe:
        with pytest.raises(ValueError, match=r"a minibatch of 3 \(inputs, targets\) microbatches, but the "
                                             r"pipeline runs microbatches=2 per step"):
            list(pipe.train(BatchStream(tokens, 3, 2, 32), steps=1))
        for bad in (1.5, 0, 2**40):  # 2**40 passed, past the core's counts
            with pytest.raises(ValueError, match=f"steps must be an integer >= 1 that keeps the run's steps within "
                                                 f"2147483647 \\(the core's counts\\), got {bad} at step 0"):
                list(pipe.train(BatchStream(tokens, 2, 2, 32), steps=bad))
        stats = list(pipe.train(BatchStream(tokens, 2, 2, 32), steps=1))  # the right count trains
        assert len(stats) == 1 and stats[0].loss is not None


def test_the_simulator_names_an_optimizer_or_schedule_of_the_wrong_kind():
    from asyncpp_ext.training import DelaySimulator
    from asyncpp_ext.training.simulate import DelaySimulatorError

    model = _model()
    with pytest.raises(DelaySimulatorError, match="optimizer must be a torch.optim.Optimizer .* got function"):
        DelaySimulator(model, lambda m: build_optimizer(m, "adamw"), "2bw")
    with pytest.raises(DelaySimulatorError, match="lr_schedule must be an LRSchedule .* got str"):
        DelaySimulator(model, build_optimizer(model, "adamw"), "2bw", lr_schedule="cosine")
    with pytest.raises(ValueError, match="warmup_steps 9 exceeds steps 4"):
        DelaySimulator(model, build_optimizer(model, "adamw"), "2bw", lr_schedule=LRSchedule("cosine", 4, 9))


def test_a_fused_head_loss_needs_a_head_that_has_one(one_rank):
    blocks = [torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)]
    with pytest.raises(ValueError, match=r"head_loss='fused' needs a last block with features\(x\), output_weight "
                                         r"and output_bias .* not Linear; use head_loss='plain'"):
        Pipeline(blocks, loss_fn=GPT.loss, optimizer=lambda m: build_optimizer(m, "adamw"), microbatches=2,
                 head_loss="fused")


def test_a_state_of_another_model_shape_is_named_before_anything_is_written(one_rank):
    from asyncpp_ext.models import GPTConfig

    wide = Pipeline(GPT(GPTConfig(**{**preset_config("tiny").__dict__, "n_embd": 64}), seed=0), loss_fn=GPT.loss,
                    optimizer=lambda m: build_optimizer(m, "adamw"), microbatches=2, schedule="2bw", timeout_s=60)
    p = _pipeline()
    before = {k: v.clone() for k, v in p.state_dict()["params"].items()}
    with pytest.raises(ValueError, match=r"the checkpoint's '.*' has shape \(\d+, 64\), this model's \(\d+, 32\); "
                                         r"it was written for another model shape"):
        p.load_state_dict(wide.state_dict())
    assert all(torch.equal(before[k], v) for k, v in p.state_dict()["params"].items())
    with pytest.raises(TypeError, match=r"state must be a dict from Pipeline.state_dict\(\) \(or a checkpoint's shard\), got NoneType$"):
        p.load_state_dict(None)


def test_a_checkpoints_shard_loads_as_load_checkpoint_reads_it(one_rank, tmp_path):
    # load_checkpoint gives shards of {"engine", "rng", "stage", "format"}: the Pipeline and
    # merge_engine_states take them as they come (the engine part), as they take engine states
    from asyncpp_ext.training import load_checkpoint, merge_engine_states
    from asyncpp_ext.training.cli import main as train

    assert train(["--model", "tiny", "--optimizer", "adamw", "--steps", "2", "--eval-batches", "0", "--simulate",
                  "--no-progress", "--threads", "1", "--out", str(tmp_path / "run")]) == 0
    _, shards = load_checkpoint(tmp_path / "run" / "ckpt-000002")
    want = shards[0]["engine"]["params"]
    for state in (shards[0], merge_engine_states(shards), merge_engine_states([s["engine"] for s in shards])):
        p = _pipeline()
        p.load_state_dict(state)
        assert p.next_step == 2
        assert all(torch.equal(want[k], v) for k, v in p.state_dict()["params"].items())
    part = dict(shards[0]["engine"], params={k: v for k, v in want.items() if k != "head.proj.weight"})
    with pytest.raises(ValueError, match=r"the state has no weights for 'head.proj.weight': it holds another model's, or another "
                                         r"stage's share \(merge a checkpoint's shards first"):
        _pipeline().load_state_dict(part)


def test_a_model_without_blocks_is_named_as_such(one_rank):
    with pytest.raises(ValueError, match="the model has no blocks to split into stages"):
        Pipeline([], loss_fn=GPT.loss, optimizer=lambda m: build_optimizer(m, "adamw"), microbatches=2)
