"""Stage-scope compilation (models/regions.py): a stage's blocks but the head compiled as one region
train like eager blocks, follow the stage split so that a split model computes bitwise what the
simulator's regions compute, share one graph across replicas and weight versions, read the live
weight buffer after a swap, fall back to eager with one warning, and refuse regions that are not
runs of consecutive blocks.

Like test_compile.py (same xdist group, same inductor cache under pytest's cache directory): one
intra-op thread, tiny shapes, and the aot_eager backend where only dynamo's decisions are tested."""
import contextlib
import copy
import json
import logging
import pickle

import pytest
import torch
from torch import nn

from asyncpp_ext.models.base import BlockSequence, forward_through
from asyncpp_ext.models.compile import is_compiled, uncompile
from asyncpp_ext.models.registry import build_model, model_config
from asyncpp_ext.models.regions import compile_regions, region_of, scope_regions
from asyncpp_ext.pipeline.flat_buffers import flatten_into, point_at
from asyncpp_ext.pipeline.partition import split
from asyncpp_ext.training.build import compile_stages

from test_compile import _one_compile_thread, _stale_backend, _tokens, version_buffers  # noqa: F401 (a fixture)

LOGGER = "asyncpp_ext.models.compile"


def _llama(n_layer=4):
    return build_model(model_config("llama-tiny", n_layer=n_layer), seed=0)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------
# Which blocks form regions


def test_scope_regions_leave_out_the_head_and_one_block_stages():
    partition = [[0, 1, 2], [3, 4], [5]]  # 6 blocks, the head is block 5
    assert scope_regions("stage", partition, 6) == [[0, 1, 2], [3, 4]]
    assert scope_regions("stage", [[0, 1, 2, 3, 4, 5]], 6) == [[0, 1, 2, 3, 4]]
    assert scope_regions("stage", [[0], [1, 2], [3, 4, 5]], 6) == [[1, 2], [3, 4]]  # [4, 5] -> [4]: none
    assert scope_regions("stage", [[3, 4, 5]], 6, first=3) == [[0, 1]]  # a stage's own numbering
    assert scope_regions("block", partition, 6) == []
    with pytest.raises(ValueError, match="compile scope must be one of block, stage, got 'layer'"):
        scope_regions("layer", partition, 6)
    # The simulator's regions are those of the split a 2-stage pipeline makes (compiling is lazy:
    # nothing is compiled until a call).
    model = _llama()
    report = compile_stages(model, "cpu", "stage", 2)
    assert split(model.blocks(), 2) == [[0, 1, 2], [3, 4, 5]]
    assert [getattr(region_of(b), "length", None) for b in model.blocks()] == [3, None, None, 2, None, None]
    assert is_compiled(model.head) and report.blocks[0] == "LlamaEmbedding"
    block_scoped = _llama()
    compile_stages(block_scoped, "cpu", "block", 2)
    assert all(is_compiled(b) and region_of(b) is None for b in block_scoped.blocks())


def test_regions_that_are_not_runs_of_consecutive_blocks_are_refused():
    blocks = [nn.Linear(2, 2) for _ in range(4)]
    for bad in ([[0]], [[0, 2]], [[2, 3, 4]], [[0, 1], [1, 2]]):
        with pytest.raises(ValueError, match="region"):
            compile_regions(blocks, bad, backend="eager")


# ---------------------------------------------------------------------------------------------
# Numbers: region == eager within float rounding; a split model == the simulator's regions, bitwise


def test_stage_regions_train_like_eager_and_a_split_computes_what_the_simulator_does_bitwise():
    # 6 blocks on 2 stages: [embed, layer 0, layer 1] | [layer 2, layer 3, head] -> regions
    # [0, 1, 2] and [3, 4]; the head is compiled alone. The simulator compiles the model by those
    # regions; a pipeline's stages compile their BlockSequence by the same regions, numbered from
    # their first block. With a detached, grad-requiring boundary (as pipeline/stage.py makes it)
    # the split model must give the simulator's loss and gradients bit for bit.
    # aot_eager (dynamo + AOTAutograd, no code generation) keeps this in-process check fast; the
    # same comparison with inductor, through real processes, is test_stage_compute.py's.
    eager = _llama()
    whole, parted = copy.deepcopy(eager), copy.deepcopy(eager)
    names = [n for n, _ in whole.named_parameters()]
    report = compile_regions(whole, scope_regions("stage", split(whole.blocks(), 2), 6), backend="aot_eager")
    assert [region_of(b) is not None for b in whole.blocks()] == [True, False, False, True, False, False]
    assert is_compiled(whole.head) and not any(is_compiled(b) for b in whole.blocks()[:-1])
    assert [n for n, _ in whole.named_parameters()] == names
    blocks = parted.blocks()
    partition = split(blocks, 2)
    stages = []
    for indices in partition:
        stage = BlockSequence(*[blocks[i] for i in indices])
        compile_regions(stage, scope_regions("stage", [indices], len(blocks), first=indices[0]), backend="aot_eager")
        stages.append(stage)
    idx = _tokens(2, 17, seed=3)
    loss = whole(idx[:, :-1], idx[:, 1:])[1]
    loss.backward()
    first = stages[0](idx[:, :-1])
    received = first.detach().requires_grad_()
    split_loss = parted.loss(stages[1](received), idx[:, 1:])
    split_loss.backward()
    first.backward(received.grad)
    assert torch.equal(loss, split_loss)
    for (name, p), q in zip(whole.named_parameters(), parted.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # Against eager: the bounds of test_compiled_model_trains_like_eager (the stacked projections
    # of compiled Llama blocks round differently).
    eager(idx[:, :-1], idx[:, 1:])[1].backward()
    for (name, p), q in zip(whole.named_parameters(), eager.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name
    assert not report.fallbacks and report.compiles["region[LlamaEmbedding, 2xLlamaBlock]"] >= 1


# ---------------------------------------------------------------------------------------------
# One graph per region across replicas and versions; the live buffer is read


def test_a_region_compiles_once_across_replicas_versions_and_microbatches():
    model = _llama(n_layer=3)
    n = len(model.blocks())
    report = compile_regions(model, scope_regions("stage", [range(n)], n), backend="aot_eager")
    region = "region[LlamaEmbedding, 3xLlamaBlock]"
    before = report.compiles[region]

    def microbatch(m, seed):
        idx = _tokens(3, 11, seed=seed)
        m(idx[:, :-1], idx[:, 1:])[1].backward()

    microbatch(model, 0)
    assert report.compiles[region] - before == 1
    replica = copy.deepcopy(model)  # the 2bw stage's replica per weight version
    assert region_of(replica.embed) is region_of(model.embed)  # the same compiled code
    params, flats = version_buffers(model, replica)
    for version in range(4):
        point_at(params[version % 2], flats[version % 3])
        for mb in range(2):
            microbatch((model, replica)[version % 2], 10 * version + mb)
    assert report.compiles[region] - before == 1
    # Each replica computed with the weights its buffer holds now.
    for m in (model, replica):
        eager = copy.deepcopy(m)
        uncompile(eager)
        assert region_of(eager.embed) is None
        idx = _tokens(3, 10, seed=6)
        assert torch.allclose(m(idx)[0], eager(idx)[0], rtol=0, atol=1e-5)
    assert not report.fallbacks


def _region_swap_error(backend) -> float:
    """Compile two Llama layers as a region, run them, re-point their weights at a buffer with other
    values (the 2bw swap) and return max |compiled - eager| of the output and input gradient."""
    model = _llama(n_layer=2)
    layers = list(model.layers)
    reference = copy.deepcopy(layers)
    compile_regions(layers, [[0, 1]], backend=backend, device="cpu")
    params = [p for m in layers for p in m.parameters()]
    flat = torch.empty(sum(p.numel() for p in params))
    flatten_into(params, flat)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    forward_through(layers, x)  # compiled against the first buffer
    new = torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    point_at(params, new)
    point_at([p for m in reference for p in m.parameters()], new.clone())
    got, want = forward_through(layers, x), forward_through(reference, x)
    g_got, = torch.autograd.grad(got.sum(), x)
    g_want, = torch.autograd.grad(want.sum(), x)
    return max((got - want).abs().max().item(), (g_got - g_want).abs().max().item())


def test_a_region_reads_the_live_weight_buffer_after_a_swap():
    # The region passes the parameters to its graph as blocks do (test_compile.py checks inductor
    # and its freezing switch there); aot_eager runs the region's own AOTAutograd graph.
    assert _region_swap_error("aot_eager") <= 1e-5  # measured ~1e-7 (the stacked projections)
    assert _region_swap_error(_stale_backend) > 1e-2  # the check can fail


# ---------------------------------------------------------------------------------------------
# Fallback, copies, pickling


def test_a_region_that_fails_to_compile_runs_eagerly_with_one_warning(caplog):
    def raising_backend(gm, example_inputs):
        raise RuntimeError("no region kernels today")
    model = _llama(n_layer=2)
    reference = copy.deepcopy(model)
    report = compile_regions(model, [[0, 1, 2]], backend=raising_backend)
    idx = _tokens(2, 9, seed=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for m in (model, copy.deepcopy(model), model):
            assert torch.equal(m(idx)[0], reference(idx)[0])
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(lines) == 1 and "no region kernels today" in lines[0] and "\n" not in lines[0], lines
    assert report.fallbacks == {"region[LlamaEmbedding, 2xLlamaBlock]": "BackendCompilerFailed: RuntimeError: "
                                "no region kernels today", "LlamaHead": "BackendCompilerFailed: RuntimeError: "
                                "no region kernels today"}


def test_region_marks_survive_pickling_and_uncompile_removes_them():
    model = _llama(n_layer=2)
    compile_regions(model, [[0, 1, 2]], backend="eager")
    clone = pickle.loads(pickle.dumps(model))
    assert region_of(clone.embed) is not None and region_of(clone.embed).group is region_of(model.embed).group
    idx = _tokens(2, 9, seed=1)
    assert torch.equal(clone(idx)[0], model(idx)[0])
    uncompile(model.blocks())
    assert region_of(model.embed) is None and not is_compiled(model.head)


@contextlib.contextmanager
def _one_stage_pipeline(n_layer=3, **compile_kw):
    """A compiled one-stage Pipeline of llama-tiny on a one-rank world (compiling is lazy: no graph
    is built until a forward), closed on exit."""
    import torch.distributed as dist
    from asyncpp_ext.pipeline import Pipeline

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _llama(n_layer=n_layer)
        pipe = Pipeline(model, loss_fn=type(model).loss, schedule="1f1b", microbatches=2, stages=1,
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), compile=True, **compile_kw)
        try:
            yield pipe
        finally:
            pipe.close()
    finally:
        dist.destroy_process_group()


def test_a_pipeline_stage_compiles_its_blocks_but_the_head_as_one_region():
    # Pipeline(compile_scope="stage"): the blocks but the head form one region; with the default
    # scope the blocks are compiled alone.
    for scope, lengths in (("stage", [4, None, None, None, None]), ("block", [None] * 5)):
        with _one_stage_pipeline(compile_scope=scope) as pipe:
            for replica in pipe.host.replicas:
                assert [getattr(region_of(b), "length", None) for b in replica] == lengths, scope
                assert isinstance(replica, BlockSequence) and is_compiled(replica[-1])
    with pytest.raises(ValueError, match="compile scope must be one of block, stage"):
        with _one_stage_pipeline(compile_scope="model"):
            pass


def _run_eagerly(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def test_blocks_of_a_region_called_without_the_rest_run_eagerly(monkeypatch):
    # forward_through runs a region only when all its blocks follow its first one in the list it
    # is given; a part of a region (here its first two of three blocks) runs block by block.
    model = _llama(n_layer=2)
    eager = copy.deepcopy(model)
    report = compile_regions(model, [[0, 1, 2]], backend="eager")
    region = region_of(model.embed)
    calls = []
    # count the region's calls (the group is shared by the process: restored after the test)
    monkeypatch.setattr(region.group, "fn", lambda *args: calls.append(len(args[0])) or _run_eagerly(*args))
    idx = _tokens(2, 9, seed=2)
    part, want = forward_through(model.blocks()[:2], idx), forward_through(eager.blocks()[:2], idx)
    assert torch.equal(part, want) and calls == []  # block by block: the region never ran
    forward_through(model.blocks()[:3], idx)
    assert calls == [3] and not report.fallbacks


def test_compile_mode_reaches_inductor_with_its_cuda_graphs_off(monkeypatch, groups_restored):
    # --compile-mode max-autotune: the pipeline's stage and the simulator's regions hand inductor
    # max-autotune's options (CUDA graphs switched off: they would replay captured weight
    # addresses); the default mode adds none. inductor's compile_fx is replaced by a recorder that
    # runs the graph as traced, so only what inductor is asked is tested.
    import torch._inductor.compile_fx as compile_fx_module

    seen = []

    def record(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches or {}))
        return gm.forward
    monkeypatch.setattr(compile_fx_module, "compile_fx", record)
    idx = _tokens(2, 9, seed=3)
    for mode in ("max-autotune", "default"):
        seen.clear()
        model = _llama(n_layer=2)
        compile_stages(model, "cpu", "stage", 2, mode)
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        assert seen, mode
        for patches in seen:
            assert patches.get("triton.cudagraphs") is False and patches.get("freezing") is False
            assert patches.get("max_autotune", False) is (mode == "max-autotune"), (mode, patches)
    # --inductor-option: on top of the mode's, the forced ones still off
    seen.clear()
    model = _llama(n_layer=2)
    compile_stages(model, "cpu", "block", 2, "max-autotune", {"max_pointwise_cat_inputs": 0})
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    assert seen and all(p["max_pointwise_cat_inputs"] == 0 and p.get("max_autotune") is True
                        and p["freezing"] is False for p in seen), seen
    with _one_stage_pipeline(compile_mode="max-autotune") as pipe:
        assert {g.settings.mode for g in pipe.compile_report.groups} == {"max-autotune"}
    with _one_stage_pipeline(compile_options={"max_pointwise_cat_inputs": 0}) as pipe:
        assert {g.settings.options for g in pipe.compile_report.groups} == {(("max_pointwise_cat_inputs", 0),)}
    with pytest.raises(ValueError, match="compile_options: 'no_such_option' is not an option"):
        with _one_stage_pipeline(compile_options={"no_such_option": 1}):
            pass
    with pytest.raises(ValueError, match="compile mode 'reduce-overhead' is not one of default, max-autotune"):
        with _one_stage_pipeline(compile_mode="reduce-overhead"):
            pass


def test_the_cli_hands_its_inductor_options_to_the_simulators_blocks(monkeypatch, groups_restored, tmp_path,
                                                                     capsys):
    # asyncpp-train --simulate --compile --inductor-option: the one-process run's compiled blocks
    # get the option (inductor replaced by the recorder, as above: nothing is compiled for real)
    import torch._inductor.compile_fx as compile_fx_module
    from asyncpp_ext.training.cli import main

    seen = []

    def record(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches or {}))
        return gm.forward
    monkeypatch.setattr(compile_fx_module, "compile_fx", record)
    argv = ["--model", "llama-tiny", "--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2",
            "--steps", "1", "--eval-every", "0", "--ckpt-every", "0", "--no-progress",
            "--compile", "--inductor-option", "max_pointwise_cat_inputs=0", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    assert seen and all(p["max_pointwise_cat_inputs"] == 0 and p["freezing"] is False for p in seen), seen
    # the first step's wait is explained, once
    assert capsys.readouterr().err.count("asyncpp-train: compiling the blocks (torch.compile) before the "
                                         "first step") == 1
    # resumed eagerly: --no-compile turns compiling off whole, the saved option with it; an option
    # given with --no-compile on the command line says how blocks compile and is refused
    run = str(tmp_path / "run")
    assert main(["--resume", run, "--steps", "2", "--no-compile", "--inductor-option", "coordinate_descent_tuning=True",
                 "--no-progress"]) == 2
    assert "--no-compile; add --compile or pass --inductor-option none" in capsys.readouterr().err
    assert main(["--resume", run, "--steps", "2", "--no-compile", "--no-progress"]) == 0
    assert "compiling" not in capsys.readouterr().err  # eager: nothing to explain
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (saved["compile"], saved["inductor_options"]) == (False, {})


def test_the_conftest_guard_finds_groups_made_on_a_stand_in_compiler(monkeypatch, groups_restored):
    # The suite's guard (conftest.stale_compile_groups, checked after every test) against a group
    # made while inductor's compile_fx was replaced: named once the replacement is undone, and a
    # group made with the real compile_fx is not. Groups are made when blocks are compiled, before
    # any call, so nothing runs here.
    import torch._inductor.compile_fx as compile_fx_module
    from conftest import stale_compile_groups

    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, example_inputs, config_patches=None: gm.forward)
    compile_stages(_llama(n_layer=2), "cpu", "block", 1)
    assert stale_compile_groups() == {}  # the stand-in is inductor's compile_fx while it is in place
    monkeypatch.undo()
    assert sorted(g.name for g in stale_compile_groups().values()) == ["LlamaBlock", "LlamaEmbedding", "LlamaHead"]
    from asyncpp_ext.models.compile import _GROUPS

    _GROUPS.clear()
    compile_stages(_llama(n_layer=2), "cpu", "block", 1)
    assert _GROUPS and stale_compile_groups() == {}
