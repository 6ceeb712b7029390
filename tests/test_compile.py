"""Regional compilation (models/compile.py): compiled blocks train like eager ones (llama-tiny, a
Hugging Face llama from a config dict, the GPT), keep their parameter names, compile one graph per
block type across blocks, microbatches, weight versions and deep-copied replicas, read the live
weight buffer after a 2bw-style swap, and fall back to eager with one warning when compiling fails.

Compiling costs seconds per graph on 2 cores, so the tests share one inductor cache (under pytest's
cache directory: warm on a re-run), use one intra-op thread and one compile thread, and compile
only tiny shapes; the shapes of the recompile and swap tests are their own so that graphs compiled
by another test do not change their counts."""
import copy
import importlib.util
import logging
import pickle

import pytest
import torch
from torch import nn

from asyncpp_ext.models import compile_support
from asyncpp_ext.models.compile import (CompileUnavailableError, compile_blocks, compile_unavailable_reason,
                                        is_compiled, resolve_compile, uncompile)
from asyncpp_ext.models.registry import ModelConfig, build_model, model_config
from asyncpp_ext.pipeline.flat_buffers import flatten_into, point_at

LLAMA_HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (pip install 'asyncpp_ext[hf]')")
LOGGER = "asyncpp_ext.models.compile"


@pytest.fixture(scope="session", autouse=True)
def _one_compile_thread():
    """One compile thread (no worker pool to start on a 2-core machine) and one intra-op thread (see
    conftest.one_intra_op_thread); the inductor cache is the run's (conftest._share_one_inductor_cache)."""
    import torch._inductor.config as inductor_config
    saved = inductor_config.compile_threads, torch.get_num_threads()
    inductor_config.compile_threads = 1
    torch.set_num_threads(1)
    yield
    inductor_config.compile_threads, threads = saved
    torch.set_num_threads(threads)


def _model(source: str, **overrides) -> nn.Module:
    if source == "hf-llama":
        cfg = ModelConfig(arch="hf", vocab_size=256, seq_len=64, n_layer=2, hf_config=LLAMA_HF)
    else:
        cfg = model_config(source, **overrides)
    return build_model(cfg, seed=0)


def _tokens(batch: int, time: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, time), generator=torch.Generator().manual_seed(seed))


def _train(model: nn.Module, steps: int, microbatches: int, shape=(2, 16)) -> list[float]:
    """Per-step losses of AdamW steps with ``microbatches`` accumulated microbatches each."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        total = 0.0
        for mb in range(microbatches):
            idx = _tokens(*shape, seed=100 * step + mb)
            _, loss = model(idx[:, :-1], idx[:, 1:])
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


# ---------------------------------------------------------------------------------------------
# Compiled == eager, names unchanged


@pytest.mark.parametrize("source", ["llama-tiny", pytest.param("hf-llama", marks=needs_transformers), "tiny"])
def test_compiled_model_trains_like_eager(source):
    eager = _model(source)
    compiled = copy.deepcopy(eager)
    names = [n for n, _ in compiled.named_parameters()]
    keys = list(compiled.state_dict())
    report = compile_blocks(compiled, device="cpu")
    before = dict(report.compiles)
    # Checkpoints and the optimizer key on these names, in this order.
    assert [n for n, _ in compiled.named_parameters()] == names
    assert list(compiled.state_dict()) == keys
    assert all(is_compiled(b) for b in compiled.blocks())
    # Gradients of one microbatch. Measured on CPU (torch 2.13, float32): max |compiled - eager|
    # <= 5e-7 of the tensor's largest |gradient| for all three models (inductor fuses and reorders
    # float32 sums); 1e-5 leaves room for another CPU's vector width.
    idx = _tokens(2, 17, seed=7)
    for m in (eager, compiled):
        m(idx[:, :-1], idx[:, 1:])[1].backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name
        p.grad = q.grad = None
    # Per-step losses of 3 AdamW steps of 2 microbatches: measured <= 5e-8 relative.
    want, got = _train(eager, 3, 2, shape=(2, 17)), _train(compiled, 3, 2, shape=(2, 17))
    rel = max(abs(a - b) / abs(a) for a, b in zip(want, got))
    assert rel <= 1e-5, f"{source}: compiled losses {got} vs eager {want}"
    # Weights after the steps: measured <= 2.3e-5 apart (AdamW at lr 1e-2 turns a gradient
    # difference of 1e-7 on a near-zero gradient into a step difference of up to lr).
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert (p - q).abs().max() <= 2e-4, name
    # The identical layers share one graph (forward and backward): two layers, at most one new
    # graph (none if a test run before compiled this shape).
    layer_type = type(compiled.layers[0]).__qualname__
    assert {k: report.compiles[k] - before[k] for k in before}[layer_type] <= 1, report.compiles
    assert len(report.groups) == 3 and not report.fallbacks


# ---------------------------------------------------------------------------------------------
# One graph per block type across blocks, microbatches, versions and replicas


def version_buffers(model: nn.Module, replica: nn.Module) -> tuple[list, list]:
    """The 2bw stage's layout: the parameters of ``model`` and ``replica`` flattened into three
    per-version buffers (the third holding other values); version v is ``point_at(params[v % 2],
    flats[v % 3])``."""
    params = [list(model.parameters()), list(replica.parameters())]
    flats = [torch.empty(sum(p.numel() for p in params[0])) for _ in range(3)]
    for ps, flat in zip(params, flats):
        flatten_into(ps, flat)
    flats[2].copy_(flats[0] * 0.5)
    return params, flats


def test_no_recompilation_across_blocks_microbatches_versions_and_replicas():
    from torch._dynamo.utils import counters
    model = _model("llama-tiny", n_layer=3)
    # Recompilation is dynamo's decision (its guards); the backend only turns graphs into code, so
    # aot_eager (dynamo + AOTAutograd, no code generation) counts what inductor would, in a second
    # instead of a minute. test_compiled_model_trains_like_eager checks the count under inductor.
    report = compile_blocks(model, device="cpu", backend="aot_eager")
    before = dict(report.compiles)
    graphs_before = counters["stats"]["unique_graphs"]
    train_shape = (3, 13)

    def microbatch(m, seed):
        idx = _tokens(*train_shape, seed=seed)
        _, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return loss.detach()

    def added():
        return {k: report.compiles[k] - before[k] for k in before}

    microbatch(model, 0)
    assert added() == {"LlamaEmbedding": 1, "LlamaBlock": 1, "LlamaHead": 1}  # 3 layers, 1 graph
    # What the 2bw stage does: replicas by deepcopy, all weights flattened into per-version
    # buffers, the versions swapped by re-pointing p.data, several microbatches per version.
    replica = copy.deepcopy(model)
    assert all(is_compiled(b) for b in replica.blocks())
    assert replica.layers[0].forward.module is replica.layers[0]  # re-bound to the copy
    params, flats = version_buffers(model, replica)
    for version in range(4):
        m = (model, replica)[version % 2]
        point_at(params[version % 2], flats[version % 3])
        for mb in range(3):
            microbatch(m, seed=10 * version + mb)
    assert added() == {"LlamaEmbedding": 1, "LlamaBlock": 1, "LlamaHead": 1}
    # Evaluation: no_grad is another graph per type, then a batch of another size one more.
    with torch.no_grad():
        model(_tokens(*train_shape, seed=1)[:, :-1])
        assert added() == {"LlamaEmbedding": 2, "LlamaBlock": 2, "LlamaHead": 2}
        replica(_tokens(*train_shape, seed=2)[:, :-1])
        model(_tokens(5, 12, seed=3))
        replica(_tokens(5, 12, seed=4))
    assert added() == {"LlamaEmbedding": 3, "LlamaBlock": 3, "LlamaHead": 3}
    microbatch(replica, 5)  # training again: the first graph still serves
    assert added() == {"LlamaEmbedding": 3, "LlamaBlock": 3, "LlamaHead": 3}
    # Each replica computed with its own, current weights (the version its buffer holds).
    for m, flat in ((model, flats[0]), (replica, flats[2])):
        point_at(list(m.parameters()), flat)
        eager = copy.deepcopy(m)
        uncompile(eager)
        idx = _tokens(*train_shape, seed=6)[:, :-1]  # the training shape: no new graph
        assert torch.allclose(m(idx)[0], eager(idx)[0], rtol=0, atol=1e-5)
    assert added() == {"LlamaEmbedding": 3, "LlamaBlock": 3, "LlamaHead": 3}
    # Dynamo's own count agrees (our backend sees each graph dynamo makes).
    assert counters["stats"]["unique_graphs"] - graphs_before == 9
    assert not report.fallbacks


# ---------------------------------------------------------------------------------------------
# The weight-buffer swap reads the live buffer


def _stale_backend(gm, example_inputs):
    """A deliberately wrong 'compiler': it snapshots the parameters it was compiled with (what CUDA
    graphs or inductor's freezing would do) and keeps using the snapshot."""
    frozen = {i: t.detach().clone() for i, t in enumerate(example_inputs) if isinstance(t, nn.Parameter)}
    assert frozen, "dynamo passed no parameters as graph inputs"

    def run(*args):
        return gm(*[frozen.get(i, a) for i, a in enumerate(args)])
    return run


def _swap_error(backend, grad: bool, device="cpu", autocast: bool = False) -> float:
    """Compile a Llama block, run it, re-point its parameters at a new flat buffer holding other
    values (as the 2bw stage does between versions), and return max |compiled - eager| of the
    output (and, with ``grad``, of the input gradient) on the new values."""
    block = _model("llama-tiny").layers[0].to(device)
    reference = copy.deepcopy(block)
    compile_blocks([block], backend=backend, device=device)
    params = list(block.parameters())
    # (2, 16, 32): the layer input of test_compiled_model_trains_like_eager, whose training graph
    # then serves here too (one compile less); the no_grad graph is compiled here.
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_(grad)
    flat = torch.empty(sum(p.numel() for p in params), device=device)
    flatten_into(params, flat)
    with torch.set_grad_enabled(grad), torch.autocast(torch.device(device).type, torch.bfloat16, enabled=autocast):
        block(x)  # compiled against the first buffer
        new = (torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)) * 0.1).to(device)
        point_at(params, new)
        point_at(list(reference.parameters()), new.clone())
        got, want = block(x).float(), reference(x).float()
    err = (got - want).abs().max().item()
    if grad:
        g_got, = torch.autograd.grad(got.sum(), x)
        g_want, = torch.autograd.grad(want.sum(), x)
        err = max(err, (g_got - g_want).abs().max().item())
    return err


def test_compiled_block_reads_the_live_weight_buffer_after_a_swap():
    import torch._inductor.config as inductor_config
    # Freezing would fold the weights of a no_grad graph into constants; compile_blocks turns it
    # off for its graphs even where the environment (TORCHINDUCTOR_FREEZING=1) turns it on.
    # (torch's config.patch, not monkeypatch: monkeypatch's undo deletes config entries.)
    with inductor_config.patch(freezing=True):
        for grad in (True, False):
            assert _swap_error("inductor", grad) <= 1e-5  # measured ~1e-7 (eager vs inductor float32)


def test_the_swap_check_catches_a_compiler_that_captured_a_stale_buffer():
    # The same check, with a backend that keeps the weights it was compiled with: it must fail,
    # or the test above would prove nothing.
    assert _swap_error(_stale_backend, grad=True) > 1e-2


def test_blocks_run_as_stages_compute_what_the_whole_model_computes_bitwise():
    # Regional compilation compiles each block alone, so how the blocks are split between stages
    # does not change any graph: two "stages" (a detached, grad-requiring boundary as
    # pipeline/stage.py makes it) give the whole model's loss and gradients bit for bit. This is
    # what keeps real == --simulate exact with compile on, on both sides. Shapes are those of
    # test_compiled_model_trains_like_eager, so no new graph is compiled.
    whole = _model("llama-tiny")
    split = copy.deepcopy(whole)
    compile_blocks(whole, device="cpu")
    compile_blocks(split, device="cpu")
    idx = _tokens(2, 17, seed=3)
    loss = whole(idx[:, :-1], idx[:, 1:])[1]
    loss.backward()
    blocks = split.blocks()
    first = blocks[1](blocks[0](idx[:, :-1]))  # stage 0: embedding + layer 0
    received = first.detach().requires_grad_()
    logits = blocks[3](blocks[2](received))  # stage 1: layer 1 + head
    split_loss = split.loss(logits, idx[:, 1:])
    split_loss.backward()
    first.backward(received.grad)
    assert torch.equal(loss, split_loss)
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), name


# ---------------------------------------------------------------------------------------------
# Fallback to eager on a compile failure


class _Probe(nn.Module):
    """A small block type of its own, so each fallback test starts a fresh group."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) + x


def _fresh_probe_type(name):
    return type(name, (_Probe,), {})


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_failing_backend_falls_back_to_eager_with_one_warning(caplog):
    def raising_backend(gm, example_inputs):
        raise RuntimeError("no kernels today")
    model = _model("llama-tiny")  # three block types, each failing the same way
    reference = copy.deepcopy(model)
    report = compile_blocks(model, backend=raising_backend)
    idx = _tokens(2, 9, seed=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for m in (model, copy.deepcopy(model), model):  # again, and on a replica: no new line
            logits, loss = m(idx)[0], m(idx[:, :-1], idx[:, 1:])[1]
            loss.backward()
            assert torch.equal(logits, reference(idx)[0])
    lines = _warnings(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert "\n" not in message and "LlamaEmbedding" in message
    assert "BackendCompilerFailed" in message and "no kernels today" in message
    cause = "BackendCompilerFailed: RuntimeError: no kernels today"
    assert report.fallbacks == {"LlamaEmbedding": cause, "LlamaBlock": cause, "LlamaHead": cause}
    assert "eager after a failure: LlamaEmbedding, LlamaBlock, LlamaHead" in report.summary()


def test_a_backward_compile_failure_falls_back_in_the_forward_call(caplog):
    from torch._dynamo.backends.common import aot_autograd

    def raising_bw(gm, example_inputs):
        raise RuntimeError("no backward kernels today")
    # AOTAutograd compiles the backward at the first backward unless told otherwise; compile_blocks
    # tells it to compile it with the forward, inside the call that can still fall back.
    backend = aot_autograd(fw_compiler=lambda gm, ex: gm, bw_compiler=raising_bw)
    cls = _fresh_probe_type("BackwardRaisingProbe")
    block = cls()
    compile_blocks([block], backend=backend)
    x = torch.randn(4, 8, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        block(x).sum().backward()  # would raise here if the backward compiled lazily
    assert x.grad is not None
    assert len(_warnings(caplog)) == 1 and "no backward kernels today" in _warnings(caplog)[0].getMessage()


def test_a_missing_cpp_compiler_falls_back_to_eager(caplog):
    import torch._inductor.config as inductor_config
    cls = _fresh_probe_type("NoCompilerProbe")
    block = cls(width=6)
    reference = copy.deepcopy(block)
    compile_blocks([block], device="cpu")
    # The compiler disappears after the check (compile_unavailable_reason would refuse it before),
    # and nothing is cached for this block type, so inductor must build C++ and cannot.
    x = torch.randn(3, 6)
    with caplog.at_level(logging.WARNING, logger=LOGGER), \
            inductor_config.patch({"cpp.cxx": ("asyncpp-no-such-c++",), "fx_graph_cache": False}):
        out = block(x)
    assert torch.equal(out, reference(x))
    lines = _warnings(caplog)
    assert len(lines) == 1 and "C++ compiler" in lines[0].getMessage(), [r.getMessage() for r in lines]


def test_errors_of_the_model_itself_still_raise(caplog):
    model = _model("llama-tiny")
    eager = copy.deepcopy(model)
    report = compile_blocks(model, device="cpu")
    bad_width = torch.randn(2, 5, 31)
    too_long = torch.zeros(1, 33, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for compiled_block, eager_block, x in ((model.layers[0], eager.layers[0], bad_width),
                                               (model.embed, eager.embed, too_long)):
            with pytest.raises(Exception) as want:
                eager_block(x)
            with pytest.raises(Exception) as got:
                compiled_block(x)
            # Eager's own exception, not dynamo's wrapper of it, and not swallowed by the fallback.
            assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert not _warnings(caplog) and not report.fallbacks
    assert "LlamaInputError" in repr(got.value) or isinstance(got.value, ValueError)


# ---------------------------------------------------------------------------------------------
# Can torch compile here, and the auto default


def test_compile_unavailable_reason_and_resolve_compile(monkeypatch):
    import torch._inductor.config as inductor_config
    assert compile_unavailable_reason("cpu") is None  # this CI machine has g++
    assert resolve_compile(None, "cpu") is False  # auto stays eager on CPU
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "cpu") is False
    assert "not" in compile_unavailable_reason("mps")
    if not torch.cuda.is_available():
        assert "CUDA is not available" in compile_unavailable_reason("cuda")
        assert resolve_compile(None, "cuda") is False
        with pytest.raises(CompileUnavailableError, match="CUDA is not available"):
            resolve_compile(True, "cuda:0")
    monkeypatch.setattr(compile_support, "_cuda_reason", lambda dev: None)
    assert resolve_compile(None, "cuda") is True  # auto = on where CUDA can compile
    with inductor_config.patch({"cpp.cxx": (None, "asyncpp-no-such-c++")}):
        reason = compile_unavailable_reason("cpu")
        assert "no working C++ compiler" in reason and "asyncpp-no-such-c++" in reason
        with pytest.raises(CompileUnavailableError) as err:
            resolve_compile(True, "cpu")
        assert "\n" not in str(err.value) and "C++ compiler" in str(err.value)
        assert resolve_compile(None, "cpu") is False
        with pytest.raises(CompileUnavailableError, match="C..? compiler"):
            compile_blocks([nn.Linear(2, 2)], device="cpu")
    import torch._dynamo.eval_frame as eval_frame

    def unsupported():
        raise RuntimeError("Python 3.99 not yet supported for torch.compile")
    monkeypatch.setattr(eval_frame, "check_if_dynamo_supported", unsupported)
    assert "Python 3.99" in compile_unavailable_reason("cuda")


def test_arguments_that_would_capture_weights_or_bypass_code_are_refused():
    with pytest.raises(ValueError, match="CUDA graphs"):
        compile_blocks([nn.Linear(2, 2)], mode="reduce-overhead")
    with pytest.raises(ValueError, match="inductor options"):
        compile_blocks([nn.Linear(2, 2)], backend="eager", options={"max_autotune": True})
    patched = nn.Linear(2, 2)
    patched.forward = lambda x: x
    with pytest.raises(ValueError, match="own forward"):
        compile_blocks([patched])


class PickledProbe(_Probe):
    """Importable by name, as pickle needs."""


def test_uncompile_and_pickle():
    block = PickledProbe()
    compile_blocks([block], backend="eager")
    x = torch.randn(2, 8)
    want = block(x)
    clone = pickle.loads(pickle.dumps(block))  # re-bound on load, like deepcopy
    assert is_compiled(clone) and clone.forward.module is clone
    uncompile([block])
    assert not is_compiled(block) and "forward" not in block.__dict__
    assert torch.equal(block(x), want)


# ---------------------------------------------------------------------------------------------
# The fused head loss's chunk passes (models/head_loss.py): compiled on CUDA, checked here on CPU.

def test_head_loss_chunk_passes_compiled_match_eager_and_fall_back():
    from asyncpp_ext.models import head_loss as hl

    gen = torch.Generator().manual_seed(3)
    passes = hl._ChunkPasses(True)
    for rows in (6, 4):  # a full chunk and a shorter last one
        logits = torch.randn(rows, 300, generator=gen).to(torch.bfloat16) * 4
        t = torch.randint(0, 300, (rows, 1), generator=gen)
        valid = torch.arange(rows) != 1  # row 1's target is ignored
        lse, nll_sum = passes.stats(logits, t, valid)
        ref = torch.log_softmax(logits.double(), dim=1)
        assert torch.allclose(nll_sum.double(), -ref.gather(1, t).squeeze(1)[valid].sum(), atol=1e-5 * rows)
        assert torch.allclose(lse.double(), torch.logsumexp(logits.double(), 1), atol=1e-5)
        g = passes.grad(logits, t, lse[:, None], torch.bfloat16)
        want = ref.exp().scatter_add(1, t, torch.full((rows, 1), -1.0, dtype=torch.float64))
        assert g.dtype == torch.bfloat16 and torch.allclose(g.double(), want, atol=4e-3, rtol=1e-2)
        assert torch.equal(g, hl._chunk_grad(logits, t, lse[:, None], torch.bfloat16))
    # Compiled, the gradient pass is one elementwise kernel: its only (rows, V) allocation is its
    # 16-bit output (a scatter for the one-hot wrote an fp32 buffer first, then converted it).
    big = torch.randn(64, 4096, generator=gen).to(torch.bfloat16)
    big_t = torch.randint(0, 4096, (64, 1), generator=gen)
    big_lse = passes.stats(big, big_t, torch.ones(64, dtype=torch.bool))[0][:, None]
    passes.grad(big, big_t, big_lse, torch.bfloat16)  # its compile happens outside the window
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        passes.grad(big, big_t, big_lse, torch.bfloat16)
    cpu = torch._C._autograd.DeviceType.CPU
    allocs = [e.nbytes() for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == cpu and e.nbytes() > 0]
    assert sum(allocs) == 64 * 4096 * 2, allocs
    assert passes.compiled

    broken = hl._ChunkPasses(False)
    broken.compiled = True
    broken.stats = broken._guarded(lambda *a: (_ for _ in ()).throw(RuntimeError("no triton\nmore")), hl._chunk_stats)
    with pytest.warns(UserWarning, match=r"chunk passes failed \(RuntimeError: no triton\); they run eagerly"):
        lse2, _ = broken.stats(logits, t, valid)
    assert torch.equal(lse2, lse) and not broken.compiled


def test_compiled_llama_block_stacks_its_projections():
    """Under compile a Llama block runs q/k/v as one product and gate/up as one
    (llama.fused_linear): 4 linear calls instead of 7, with the same outputs up to float
    rounding."""
    import torch._dynamo
    from asyncpp_ext.models.llama import LlamaBlock, fused_linear, llama_preset_config

    block = LlamaBlock(llama_preset_config("llama-tiny"))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    got = torch.compile(block, backend=record, fullgraph=True)(x)
    linears = [n for n in graphs[0].graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == 4
    assert len([n for n in graphs[0].graph.nodes if n.target is torch.cat]) == 2  # q/k/v's and gate/up's weights
    assert torch.allclose(got, block(x), atol=1e-6, rtol=1e-5)
    q, k, v = fused_linear(x, block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)
    assert torch.allclose(q, block.attn.q_proj(x), atol=1e-6) and torch.allclose(v, block.attn.v_proj(x), atol=1e-6)
    gate, up = fused_linear(x, block.mlp.gate_proj, block.mlp.up_proj)
    assert torch.allclose(gate, block.mlp.gate_proj(x), atol=1e-6) and torch.allclose(up, block.mlp.up_proj(x), atol=1e-6)
    with pytest.raises(ValueError, match="bias-free projections only"):  # it would drop the bias
        fused_linear(x, torch.nn.Linear(32, 4), torch.nn.Linear(32, 4, bias=False))


def test_inductor_compiled_blocks_add_fused_weight_gradients_as_eager_blocks_do():
    # --gradient-accumulation-fusion: the weight-gradient op (a custom op mutating the float32
    # gradient, pipeline/main_grad.py) inside inductor's compiled backward, the stacked products
    # included. bf16 autocast: compiled and eager round their pointwise ops apart, so the bound is
    # bf16's (measured on the CPU: 6.6e-3 of a gradient's largest value at most).
    from asyncpp_ext.pipeline.compute_copies import ComputeCopies
    from asyncpp_ext.pipeline.main_grad import MainGradProduct

    grads = []
    for compiled in (False, True):
        model = _model("llama-tiny")
        copies = ComputeCopies(model, torch.bfloat16, fuse_weight_gradients=True)
        if compiled:
            report = compile_blocks(copies.module, device="cpu")
            before = dict(report.compiles)
            assert sum(isinstance(m, MainGradProduct) for m in copies.module.modules()) == 2 * len(model.layers)
        copies.begin_step()
        copies.refresh()
        announced = []  # data parallelism's hears of each weight from the op's kernel, compiled too
        copies.announce_final_grads(announced.append)
        for mb in range(2):
            idx = _tokens(2, 17, seed=mb)
            copies.start_final_backward(mb == 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                copies.module(idx[:, :-1], idx[:, 1:])[1].backward()
            copies.start_final_backward(False)
            assert all(w.grad is None for w, _ in copies.stacked)  # the products took their gradients
            copies.accumulate()
        assert sorted(map(id, announced)) == sorted(map(id, copies.masters)), (compiled, len(announced))
        if compiled:  # one graph for both layers: each layer's gradient tensor is an input, no recompile
            layer_type = type(copies.module.layers[0]).__qualname__
            assert report.compiles[layer_type] - before.get(layer_type, 0) <= 1 and not report.fallbacks
        grads.append([p.grad.clone() for p in model.parameters()])
    for (name, _), a, b in zip(model.named_parameters(), *grads):
        assert (b - a).abs().max() <= 2e-2 * a.abs().max(), (name, ((b - a).abs().max() / a.abs().max()).item())
