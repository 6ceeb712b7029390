"""models/concat_lowering.py: ``max_pointwise_cat_inputs=0`` lowered as ConcatKernels on torches
whose inductor has no ``max_complex_pointwise_cat_inputs``. The GPU lowering it changes cannot run
here; the decision is tested on stand-in IR nodes, and the ConcatKernel it builds on this torch's
real inductor with the CPU let through."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from asyncpp_ext.models import concat_lowering as cl

OLD = {"max_pointwise_cat_inputs": 8}  # an older inductor's option names
NEW = {"max_pointwise_cat_inputs": 8, "max_complex_pointwise_cat_inputs": 8}


def test_needed_only_for_the_option_at_zero_on_an_inductor_without_the_newer_option():
    assert cl.needed({"max_pointwise_cat_inputs": 0}, OLD)
    assert not cl.needed({"max_pointwise_cat_inputs": 0}, NEW)  # inductor honours it itself
    assert not cl.needed({"max_pointwise_cat_inputs": 8}, OLD)
    assert not cl.needed({}, OLD) and not cl.needed(None, OLD)
    assert not cl.needed({"max_pointwise_cat_inputs": 0}, {})  # no such option at all


def _node(device="cuda", dtype=torch.bfloat16, size=(4, 8)):
    return SimpleNamespace(get_device=lambda: torch.device(device), get_dtype=lambda: dtype,
                           get_size=lambda: list(size))


def test_takes_gpu_concatenations_of_one_dtype_and_rank_while_the_option_is_zero():
    from torch._inductor import config

    three = [_node(), _node(size=(4, 2)), _node(size=(4, 3))]
    with config.patch(max_pointwise_cat_inputs=0):
        assert cl.takes(three, -1) and cl.takes(three, 1)
        assert not cl.takes(three[:1], -1)  # one input: inductor's clone
        assert not cl.takes([_node("cpu"), _node("cpu")], 0)  # inductor's CPU lowering does it already
        assert not cl.takes([_node(), _node(dtype=torch.float32)], 0)  # promotion: inductor's
        assert not cl.takes([_node(), _node(size=(4,))], 0)  # ranks differ (ATen's empty 1-D case)
        assert not cl.takes([_node(), _node("cuda:1")], 0)
        assert not cl.takes(three, None)
        with config.patch(force_pointwise_cat=True):
            assert not cl.takes(three, -1)
    with config.patch(max_pointwise_cat_inputs=8):
        assert not cl.takes(three, -1)


def _counting(original, decisions):
    """``original`` (inductor's cat lowering), noting each call in ``decisions`` as "inductor"."""
    def lowering(*args, **kwargs):
        decisions.append("inductor")
        return original(*args, **kwargs)
    return lowering


@pytest.fixture
def cpu_let_through(monkeypatch):
    """The lowering installed and acting on CPU inputs too (inductor's own CPU lowering builds the
    same ConcatKernels), removed after the test; every call's decision recorded, and every call
    that reached inductor's own lowering as "inductor"."""
    decisions = []
    real_takes = cl.takes

    def recorded(inputs, dim):
        decisions.append(real_takes(inputs, dim))
        return decisions[-1]
    monkeypatch.setattr(cl, "LOWERED_BY_INDUCTOR", ())
    monkeypatch.setattr(cl, "takes", recorded)
    was_installed = bool(cl._installed)  # by an earlier compile in this process (an older torch)
    cl.install()
    inductors = cl._installed[0]
    cl._installed[0] = _counting(inductors, decisions)
    yield decisions
    cl._installed[0] = inductors
    if not was_installed:
        cl.uninstall()


def test_the_concat_kernel_it_builds_computes_the_concatenation(cpu_let_through):
    # q/k/v-like parts, two of them computed (as the rotary backward's are), concatenated and
    # multiplied: inductor compiles it through the installed lowering for real (caches off, so
    # the lowering runs), and the values are eager's
    def f(a, b, c, w):
        return torch.cat([a.sin() * 2, b.roll(1, -1) + 1, c], dim=-1) @ w

    torch.manual_seed(0)
    a, b, c, w = torch.randn(6, 5), torch.randn(6, 3), torch.randn(6, 2), torch.randn(10, 4)
    for option, calls in ((0, [True]), (8, [False, "inductor"])):
        cpu_let_through.clear()
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="inductor", fullgraph=True,
                                 options={"max_pointwise_cat_inputs": option})
        with torch._inductor.config.patch(force_disable_caches=True):
            out = compiled(a, b, c, w)
        assert torch.allclose(out, f(a, b, c, w), rtol=1e-5, atol=1e-5)
        assert cpu_let_through == calls, (option, cpu_let_through)
    torch._dynamo.reset()


def test_compiled_blocks_install_it_where_their_options_need_it(monkeypatch, groups_restored):
    from asyncpp_ext.models.compile import compile_blocks

    installs = []
    monkeypatch.setattr(cl, "install", lambda: installs.append(1))
    monkeypatch.setattr(cl, "NEWER_OPTION", "an_option_this_inductor_lacks")  # an older inductor
    compile_blocks([nn.Linear(3, 3)], device="cpu", options={"max_pointwise_cat_inputs": 8})
    assert installs == []
    compile_blocks([nn.Linear(3, 3)], device="cpu", options={"max_pointwise_cat_inputs": 0})
    assert installs == [1]
    monkeypatch.setattr(cl, "NEWER_OPTION", "force_pointwise_cat")  # an inductor that has it
    installs.clear()
    compile_blocks([nn.Bilinear(2, 2, 2)], device="cpu", options={"max_pointwise_cat_inputs": 0})  # a new group
    assert installs == []


def test_its_compiles_carry_a_mark_in_inductors_cache_key(monkeypatch):
    # a graph compiled without the lowering must not be served to a compile with it, nor the
    # reverse: the patches of a compile that needs it get a post-grad pass that changes nothing
    # and whose uuid enters inductor's cache key; a pass of the caller's own is kept
    from torch._inductor.custom_graph_pass import CustomGraphPass

    monkeypatch.setattr(cl, "install", lambda: None)
    monkeypatch.setattr(cl, "NEWER_OPTION", "an_option_this_inductor_lacks")
    patches = {"max_pointwise_cat_inputs": 0}
    cl.install_if_needed(patches)
    mark = patches[cl.CACHE_OPTION]
    assert isinstance(mark, CustomGraphPass) and mark.uuid() and mark is cl.cache_mark()
    graph = torch.fx.Graph()
    assert mark(graph) is None and list(graph.nodes) == []
    own = object()
    patches = {"max_pointwise_cat_inputs": 0, cl.CACHE_OPTION: own}
    cl.install_if_needed(patches)
    assert patches[cl.CACHE_OPTION] is own
    patches = {"max_pointwise_cat_inputs": 8}
    cl.install_if_needed(patches)
    assert cl.CACHE_OPTION not in patches


@pytest.mark.slow  # ~18 s of inductor compiles on 2 cores; the mechanism: the test above
def test_a_compiled_llama_block_through_it_trains_as_eager(cpu_let_through, groups_restored):
    # The model's own concatenations (the stacked q/k/v weight forward; the q/k/v gradient, q's and
    # k's through the rotary backward, in backward) lowered by it, as compile_blocks does it with
    # the option: the block's output and every gradient are eager's (float32, compiled rounding)
    from asyncpp_ext.models.compile import compile_blocks
    from asyncpp_ext.models.llama import LlamaBlock, llama_init_, llama_preset_config

    cfg = llama_preset_config("llama-tiny")
    eager, block = LlamaBlock(cfg), LlamaBlock(cfg)
    llama_init_(eager, 0, cfg)
    block.load_state_dict(eager.state_dict())
    compile_blocks([block], device="cpu", options={"max_pointwise_cat_inputs": 0})
    x = torch.randn(2, 16, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    with torch._inductor.config.patch(force_disable_caches=True):
        out = block(x.clone().requires_grad_())
        out.square().sum().backward()
    want = eager(x.clone().requires_grad_())
    want.square().sum().backward()
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(block.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    # forward: the stacked weight; backward: the q/k/v gradient -- both through the ConcatKernel
    assert cpu_let_through.count(True) >= 2 and "inductor" not in cpu_let_through, cpu_let_through


def test_an_inductor_laid_out_otherwise_gets_one_warning_and_its_own_lowering(monkeypatch):
    from torch._inductor import lowering

    if cl._installed:
        pytest.skip("installed by an earlier compile in this process (an older torch)")
    monkeypatch.setattr(cl, "NEWER_OPTION", "an_option_this_inductor_lacks")
    monkeypatch.delitem(lowering.lowerings, torch.ops.aten.cat.default)
    patches = {"max_pointwise_cat_inputs": 0}
    with pytest.warns(UserWarning, match="lowering of aten.cat could not be extended .KeyError"):
        assert cl.install_if_needed(patches) is False
    assert cl.CACHE_OPTION not in patches and not cl._installed


def test_cuda_compiles_get_the_concat_kernels_by_default_and_a_caller_can_take_inductors_back():
    from asyncpp_ext.models.compile_support import DEVICE_OPTIONS, device_inductor_options

    assert device_inductor_options("cpu") == {} and device_inductor_options("cpu", {"a": 1}) == {"a": 1}
    cats = dict(DEVICE_OPTIONS["cuda"])
    assert cats == {"max_pointwise_cat_inputs": 0, "max_complex_pointwise_cat_inputs": 0}
    assert device_inductor_options("cuda") == cats
    assert device_inductor_options("cuda:1", {"coordinate_descent_tuning": True}) == \
        {**cats, "coordinate_descent_tuning": True}
    # naming either option takes the set: inductor's defaults for the one not named
    assert device_inductor_options("cuda", {"max_pointwise_cat_inputs": 8}) == {"max_pointwise_cat_inputs": 8}
    assert device_inductor_options("cuda", {"max_complex_pointwise_cat_inputs": 8}) == \
        {"max_complex_pointwise_cat_inputs": 8}
    # an older inductor: the option it lacks is left out (concat_lowering gives the other its meaning)
    assert device_inductor_options("cuda", known=OLD) == {"max_pointwise_cat_inputs": 0}
    assert device_inductor_options("cuda", {"max_pointwise_cat_inputs": 8}, known=OLD) == \
        {"max_pointwise_cat_inputs": 8}


def test_compiled_blocks_and_regions_on_cuda_compile_with_the_defaults(monkeypatch, groups_restored):
    # compiling is lazy, so CUDA's settings can be checked here with the availability check let through
    from asyncpp_ext.models import compile as compile_mod
    from asyncpp_ext.models.compile_support import device_inductor_options
    from asyncpp_ext.models.regions import compile_regions

    monkeypatch.setattr(compile_mod, "compile_unavailable_reason", lambda device: None)
    cats = device_inductor_options("cuda")
    assert cats  # this torch has at least max_pointwise_cat_inputs
    blocks = [nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)]
    assert compile_mod.compile_blocks(blocks, device="cuda").options == cats
    assert compile_mod.compile_blocks(blocks, device="cpu").options == {}
    report = compile_regions(blocks, [[0, 1]], device="cuda", options={"coordinate_descent_tuning": True})
    assert {tuple(sorted(g.settings.options)) for g in report.groups} == \
        {tuple(sorted({**cats, "coordinate_descent_tuning": True}.items()))}  # the region's group too
    taken_back = compile_mod.compile_blocks(blocks, device="cuda", options={"max_pointwise_cat_inputs": 8})
    assert taken_back.options == {"max_pointwise_cat_inputs": 8}
