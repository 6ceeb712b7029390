"""The fused head loss (asyncpp_ext/models/head_loss.py, docs/design.md "Fused head loss") against
the plain path ``BlockModel.loss(head(x), t)``: values and gradients in fp32 and under bf16
autocast, every chunking, the three head classes (tied weights included), the auto rule, the
kernel choice, and the memory it saves."""
import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncpp_ext.models import head_loss as hl
from asyncpp_ext.models.base import BlockModel
from asyncpp_ext.models.head_loss import (FUSED_VOCAB_THRESHOLD, default_chunk_rows, fused_kernel_name,
                                          fused_linear_cross_entropy, head_loss, linear_cross_entropy,
                                          measure_head_loss, require_kernel, resolve_head_loss)
from asyncpp_ext.models.hf import LMHead
from asyncpp_ext.models.llama import LlamaConfig, LlamaHead
from asyncpp_ext.models.registry import ModelConfig, build_model, model_config

LLAMA_HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
GPT2_HF = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
           "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}

N, C, V = 100, 48, 640
# chunk sizes: default (one chunk here), one row, ragged (7 and 64 do not divide 100), exactly N, > N
CHUNKS = [None, 1, 7, 64, N, 1000]


def _problem(device="cpu", bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=gen)
    w = torch.randn(V, C, generator=gen) * 0.2  # logits of std ~1.4: a spread-out softmax
    b = torch.randn(V, generator=gen) * 0.1 if bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    leaves = [z.to(device).requires_grad_() for z in (h, w) + ((b,) if bias else ())]
    return leaves, t.to(device)


def _loss_and_grads(fn, leaves, t, autocast_dtype=None):
    for z in leaves:
        z.grad = None
    device = leaves[0].device.type
    with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = fn(*leaves, t)
    loss.backward()
    return loss.detach(), [z.grad.clone() for z in leaves]


def _plain(h, w, *rest):
    *b, t = rest
    return F.cross_entropy(F.linear(h, w, b[0] if b else None), t)


def _chunked(rows):
    def fn(h, w, *rest):
        *b, t = rest
        return linear_cross_entropy(h, w, t, bias=b[0] if b else None, chunk_rows=rows)
    return fn


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("rows", CHUNKS)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_loss_and_gradients_match_the_plain_loss(rows, bias):
    leaves, t = _problem(bias=bias)
    want, want_grads = _loss_and_grads(_plain, leaves, t)
    got, got_grads = _loss_and_grads(_chunked(rows), leaves, t)
    # Measured on CPU: loss within 5e-7 absolute (of ~7), gradients within 2e-6 of their largest
    # entry: fp32 summation order only (per-chunk vs whole-matrix products and sums).
    assert abs(got.item() - want.item()) < 1e-5
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32
        assert _rel(g, w) < 2e-5


def _exact_grads(leaves, t):
    """The gradients in float64: the truth both bf16 paths approximate."""
    exact = [z.detach().double().requires_grad_() for z in leaves]
    _plain(*exact, t).backward()
    return [z.grad for z in exact]


def _check_bf16(got_grads, want_grads, exact_grads, leaves, factor=1.25):
    """bf16 gradients: as close to the float64 truth as plain's, within ``factor`` (bf16 rounds the
    matmul inputs, the logits' gradient and the products: ~5e-3 of the largest entry for both
    paths, measured), and so within two such errors of plain's."""
    for g, w, x, leaf in zip(got_grads, want_grads, exact_grads, leaves):
        assert g.dtype == w.dtype == leaf.dtype  # fp32 leaves: autocast casts, gradients come back fp32
        ours, theirs = _rel(g.double(), x), _rel(w.double(), x)
        assert ours <= factor * theirs + 1e-4, (ours, theirs)
        assert _rel(g, w) < 2 ** -6


@pytest.mark.parametrize("rows", CHUNKS)
def test_bf16_autocast_matches_the_plain_loss_within_bf16_rounding(rows):
    leaves, t = _problem(bias=True)
    want, want_grads = _loss_and_grads(_plain, leaves, t, torch.bfloat16)
    got, got_grads = _loss_and_grads(_chunked(rows), leaves, t, torch.bfloat16)
    # Both multiply in bf16 and take the log-softmax in fp32 from the same bf16 logits, so the loss
    # agrees to fp32 summation order (measured <= 1e-6). Gradients, measured on CPU: the chunked
    # kernel's error against float64 is 0.7-0.95x plain's (it accumulates grad_weight in fp32;
    # plain rounds it to bf16); fused vs plain differ by at most 6.7e-3 of the largest entry.
    assert abs(got.item() - want.item()) < 1e-4
    _check_bf16(got_grads, want_grads, _exact_grads(leaves, t), leaves)


def test_bf16_inputs_without_autocast_give_bf16_gradients():
    leaves, t = _problem()
    leaves = [z.detach().bfloat16().requires_grad_() for z in leaves]
    want, want_grads = _loss_and_grads(_plain, leaves, t)
    got, got_grads = _loss_and_grads(_chunked(7), leaves, t)
    assert got.dtype == torch.float32 and want.dtype == torch.bfloat16  # plain's loss is bf16 here
    assert abs(got.item() - want.item()) < 0.05  # the plain loss itself is a bf16 number (~7)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.bfloat16
        assert _rel(g.float(), w.float()) < 2 ** -6  # plain's softmax also ran in bf16 here


def test_ignored_targets_drop_out_of_the_mean_as_in_cross_entropy():
    leaves, t = _problem()
    t = t.clone()
    t[::3] = -100
    want, want_grads = _loss_and_grads(_plain, leaves, t)
    got, got_grads = _loss_and_grads(_chunked(7), leaves, t)
    assert abs(got.item() - want.item()) < 1e-5
    assert all(_rel(g, w) < 2e-5 for g, w in zip(got_grads, want_grads))
    assert torch.count_nonzero(got_grads[0][::3]) == 0  # ignored rows get no gradient


def test_every_target_ignored_gives_a_nan_loss_and_zero_gradients_as_cross_entropy():
    leaves, t = _problem()
    t = torch.full_like(t, -100)
    want, want_grads = _loss_and_grads(_plain, leaves, t)
    got, got_grads = _loss_and_grads(_chunked(7), leaves, t)
    assert torch.isnan(want) and torch.isnan(got)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got_grads)  # finite: nothing poisons the stages
    assert all(torch.equal(w, torch.zeros_like(w)) for w in want_grads)


def test_shapes_batched_input_and_bad_inputs():
    leaves, t = _problem()
    h, w = leaves
    flat = linear_cross_entropy(h, w, t)
    assert torch.equal(linear_cross_entropy(h.reshape(4, 25, C), w, t.reshape(4, 25)), flat)
    with pytest.raises(ValueError, match="does not fit weight"):
        linear_cross_entropy(h[:, :-1], w, t)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(h, w, t, chunk_rows=0)
    with pytest.raises(ValueError, match="one dtype"):
        linear_cross_entropy(h.bfloat16(), w, t)
    # a weight elsewhere gave ln V from nothing; ids as hidden states and float targets, torch's errors
    with pytest.raises(ValueError, match=r"different devices \(hidden cpu, weight meta, targets cpu\)"):
        linear_cross_entropy(h, w.to("meta"), t)
    with pytest.raises(ValueError, match="hidden is torch.int64; it must be a floating-point tensor"):
        linear_cross_entropy(h.long(), w, t)
    with pytest.raises(ValueError, match="targets are torch.float32; they must be class ids"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(TypeError, match="weight must be a tensor, got list"):
        linear_cross_entropy(h, w.tolist(), t)
    for bad in (1.5, "x"):
        with pytest.raises(ValueError, match=f"ignore_index must be an integer .*got {re.escape(repr(bad))}"):
            linear_cross_entropy(h, w, t, ignore_index=bad)
    for rows in (2.7, "2", True, float("nan")):
        with pytest.raises(ValueError, match=f"chunk_rows must be a positive integer, got {re.escape(repr(rows))}"):
            linear_cross_entropy(h, w, t, chunk_rows=rows)


def test_measure_head_loss_refuses_no_timed_calls():
    with pytest.raises(ValueError, match="repeats must be a positive number of timed calls, got 0"):
        measure_head_loss("plain", 1, 8, 8, 16, "cpu", repeats=0)


def test_default_chunk_bounds_what_a_chunk_holds_by_its_path():
    """384 MiB of (rows, V) buffers: eagerly 12 bytes per logit (682 rows at smollm's 49152 ids),
    compiled (CUDA) the 16-bit logits and gradient only, so three times the rows; a compile
    failure midway keeps the planned chunking (the order of the gradient sums within a run)."""
    assert default_chunk_rows(49152) == 682  # 682 x 49152 x 12 B <= 384 MiB
    assert default_chunk_rows(49152, 4) == 2048
    assert default_chunk_rows(256) == 131072
    assert default_chunk_rows(10 ** 9) == 1
    compiled, eager = hl._ChunkPasses(True), hl._ChunkPasses(False)
    assert compiled.logit_bytes(torch.bfloat16) == 4 and compiled.logit_bytes(torch.float32) == 8
    assert eager.logit_bytes(torch.bfloat16) == eager.logit_bytes(torch.float32) == 12
    compiled.compiled = False  # what a failed compile does
    assert compiled.logit_bytes(torch.bfloat16) == 4


def _model(name):
    """A small model of each head class: GPT Head, LlamaHead (tied), LMHead (HF llama tied; GPT-2 tied)."""
    if name == "gpt":
        return build_model(model_config("tiny"))
    if name == "llama-tied":
        return build_model(model_config("llama-tiny"))
    return build_model(ModelConfig(arch="hf", hf_config=dict(LLAMA_HF if name == "hf-llama-tied" else GPT2_HF)))


def _input_embedding(model):
    embed = model.embed
    return getattr(embed, "tok", None) or getattr(embed, "embed_tokens", None) or embed.wte


@pytest.mark.parametrize("name", ["gpt", "llama-tied"] + [
    pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                reason="needs pip install 'asyncpp_ext[hf]'"))
    for name in ("hf-llama-tied", "hf-gpt2-tied")])
def test_each_head_class_plain_is_bitwise_the_old_path_and_fused_matches(name):
    model = _model(name)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (2, 16), generator=gen)
    tgt = torch.randint(0, 256, (2, 16), generator=gen)
    head = model.blocks()[-1]
    assert head.output_bias is None  # none of these heads has a bias
    assert (head.output_weight is _input_embedding(model).weight) == name.endswith("tied")

    def run(mode):
        model.zero_grad(set_to_none=True)
        x = idx
        for block in model.blocks()[:-1]:
            x = block(x)
        loss = head_loss(head, x, tgt, mode)
        if mode == "plain":  # the historical path, recomputed from the same activation
            assert torch.equal(loss, BlockModel.loss(head(x), tgt))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, plain_grads = run("plain")
    assert torch.equal(plain, model(idx, tgt)[1])  # the model's own forward + loss, bit for bit
    fused, fused_grads = run("fused")
    # Measured: loss within 5e-7 (of ~5.5); every parameter's gradient within 1e-6 of its largest
    # entry, the tied table's (embedding + head uses summed into one Parameter) included.
    assert abs(fused.item() - plain.item()) < 1e-5
    assert plain_grads.keys() == fused_grads.keys()
    for n in plain_grads:
        assert _rel(fused_grads[n], plain_grads[n]) < 2e-5, n


def test_output_weight_is_read_at_call_time():
    model = build_model(model_config("llama-tiny"))
    head = model.head
    assert head.output_weight is model.embed.tok.weight  # tied
    head.proj.weight = nn.Parameter(model.embed.tok.weight.detach().clone())  # untied, as a pipeline does
    assert head.output_weight is head.proj.weight and head.output_weight is not model.embed.tok.weight
    x = torch.randn(2, 8, 32, requires_grad=True)
    t = torch.randint(0, 256, (2, 8))
    head_loss(head, x, t, "fused").backward()
    assert head.proj.weight.grad is not None and model.embed.tok.weight.grad is None


def test_a_head_with_a_bias_uses_it():
    torch.manual_seed(0)
    head = LMHead(nn.LayerNorm(32), nn.Linear(32, 300, bias=True), "ln_f")
    nn.init.normal_(head.lm_head.bias)
    assert head.output_bias is head.lm_head.bias
    x = torch.randn(3, 10, 32)
    t = torch.randint(0, 300, (3, 10))
    plain, fused = head_loss(head, x, t, "plain"), head_loss(head, x, t, "fused")
    assert torch.equal(plain, BlockModel.loss(head(x), t))
    assert abs(plain.item() - fused.item()) < 1e-5


def test_resolve_head_loss_rules():
    assert FUSED_VOCAB_THRESHOLD == 8192
    for device in ("cpu", "cuda"):
        assert resolve_head_loss("auto", 256, device) == "plain"       # byte-level GPT, llama-tiny
        assert resolve_head_loss("auto", 8191, device) == "plain"
        assert resolve_head_loss("auto", 8192, device) == "fused"
        assert resolve_head_loss("auto", 49152, device) == "fused"     # smollm
        assert resolve_head_loss("plain", 49152, device) == "plain"
        assert resolve_head_loss("fused", 256, device) == "fused"
    with pytest.raises(ValueError, match="one of auto, fused, plain"):
        resolve_head_loss("fast", 256, "cpu")
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        head_loss(build_model(model_config("tiny")).head, torch.randn(1, 2, 32), torch.zeros(1, 2, dtype=torch.long), "auto")


def test_kernel_choice_on_cpu_and_one_line_errors():
    assert fused_kernel_name("cpu") == "chunked"
    assert require_kernel("auto", "cpu") == require_kernel("chunked", "cpu") == "chunked"
    for kernel in ("liger", "cce"):
        with pytest.raises(ValueError, match="runs on CUDA only") as err:
            require_kernel(kernel, "cpu")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown head-loss kernel"):
        require_kernel("triton", "cpu")


def _saved_bytes(fn, exclude):
    """Bytes of the tensors autograd keeps for backward, each storage once, the inputs and
    parameters (which exist anyway) left out."""
    skip = {z.untyped_storage()._cdata for z in exclude}
    seen = {}

    def pack(z):
        storage = z.untyped_storage()
        if storage._cdata not in skip:
            seen[storage._cdata] = storage.nbytes()
        return z

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z):
        fn()
    return sum(seen.values())


def test_fused_keeps_far_less_for_backward_at_smollm_head_size():
    # smollm-135m's head at the GPU micro-batch (8 x 1024), on the meta device: shapes and dtypes are
    # real, nothing is computed, so the test takes milliseconds.
    cfg = LlamaConfig(vocab_size=49152, seq_len=1024, n_layer=1, n_embd=576, n_head=1, n_kv_head=1,
                      intermediate_size=576, tie_embeddings=True)
    head = LlamaHead(cfg).to("meta")
    x = torch.empty(8, 1024, 576, device="meta", requires_grad=True)
    t = torch.empty(8, 1024, dtype=torch.long, device="meta")
    plain = _saved_bytes(lambda: head_loss(head, x, t, "plain"), [x, *head.parameters()])
    fused = _saved_bytes(lambda: head_loss(head, x, t, "fused"), [x, *head.parameters()])
    # Measured: plain 1572 MiB (the fp32 log-probabilities, 8192 x 49152 x 4 B = 1536 MiB, and the
    # norm's output); fused 144 MiB: the gradients it forms in forward (grad_weight, 49152 x 576 fp32
    # = 108 MiB, and g @ W, 8192 x 576) and the norm's output. The grad_weight term does not grow
    # with the micro-batch: at 2 x 1024 fused keeps 117 MiB against plain's 393.
    assert plain > 8192 * 49152 * 4
    assert fused < plain / 10
    assert fused < 49152 * 576 * 4 + 3 * 8192 * 576 * 4 + (1 << 20)


def test_measured_peak_memory_fused_below_plain_at_equal_loss():
    # smollm's vocabulary (the logits, which the peak is made of) for 1024 tokens through a narrow
    # head (C = 32: cheap matmuls), cut into 256-row chunks to stand for the default 682-row chunks
    # of a micro-batch of thousands of tokens. Measured: plain 604 MB (logits, log-probs and their
    # gradient, 3 x 201 MB), fused 110 MB (one chunk's buffers and the fp32 grad_weight).
    plain = measure_head_loss("plain", 1, 1024, 32, 49152, "cpu")
    fused = measure_head_loss("fused", 1, 1024, 32, 49152, "cpu", chunk_rows=256)
    assert abs(plain["loss"] - fused["loss"]) < 1e-4
    assert plain["peak_bytes"] > 3 * 1024 * 49152 * 4 * 0.95
    assert fused["peak_bytes"] < plain["peak_bytes"] / 4
    assert set(plain) == {"seconds", "peak_bytes", "loss"} and plain["seconds"] > 0


# ---------------------------------------------------------------------------------------------
# CUDA: the chunked kernel and each library kernel that is installed, against plain on the GPU.

def _cuda_kernels():
    return ["chunked"] + [k for k in ("liger", "cce") if require_kernel_ok(k)]


def require_kernel_ok(kernel):
    try:
        return torch.cuda.is_available() and require_kernel(kernel, "cuda") == kernel
    except ValueError:
        return False


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["chunked", "liger", "cce"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_kernels_match_plain(kernel, dtype):
    if not require_kernel_ok(kernel):
        pytest.skip(f"{kernel} is not installed")
    if kernel == "cce" and dtype is None:
        pytest.skip("cut-cross-entropy computes in 16-bit only")
    leaves, t = _problem("cuda")
    want, want_grads = _loss_and_grads(_plain, leaves, t, dtype)
    got, got_grads = _loss_and_grads(
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, kernel=kernel, chunk_rows=7), leaves, t, dtype)
    # fp32 on CUDA: TF32 is off by default for matmuls, so summation order only. bf16: the same
    # check as on CPU (no less accurate than plain against float64).
    if dtype is None:
        assert abs(got.item() - want.item()) < 1e-5
        assert all(_rel(g, w) < 2e-5 and g.dtype == w.dtype for g, w in zip(got_grads, want_grads))
    else:
        assert abs(got.item() - want.item()) < 1e-3
        # The libraries' bf16 numerics are their own (cut-cross-entropy rounds its gradient sums to
        # bf16: 8.2e-3 of the largest weight-gradient entry from plain's, measured on an H200), so
        # they get a looser factor; it still catches a misuse (wrong row, dtype or scale: O(1)).
        _check_bf16(got_grads, want_grads, _exact_grads(leaves, t), leaves,
                    factor=1.25 if kernel == "chunked" else 3.0)


@pytest.mark.cuda
def test_cuda_fused_kernel_name_prefers_the_installed_library():
    want = "liger" if require_kernel_ok("liger") else "cce" if require_kernel_ok("cce") else "chunked"
    assert fused_kernel_name("cuda") == want


@pytest.mark.cuda
def test_cuda_measured_peak_fused_below_plain():
    plain = measure_head_loss("plain", 8, 1024, 576, 49152, "cuda", torch.bfloat16)
    fused = measure_head_loss("fused", 8, 1024, 576, 49152, "cuda", torch.bfloat16)
    assert abs(plain["loss"] - fused["loss"]) < 1e-3
    assert fused["peak_bytes"] < plain["peak_bytes"] / 4


def _recomputing_reference(h, w, b, t, rows, grad_output, dtype):
    """The head loss's gradients the way a backward that recomputes each chunk's logits forms them,
    from the module's own per-chunk passes: the oracle for gradients formed in the forward."""
    valid = t != -100
    safe = t.masked_fill(~valid, 0)
    hc, wc, bc = h.to(dtype), w.to(dtype), b.to(dtype)
    lse = torch.cat([hl._chunk_stats(F.linear(hc[s:s + rows], wc, bc), safe[s:s + rows, None],
                                     valid[s:s + rows])[0] for s in range(0, len(t), rows)])
    count = valid.sum()
    scale = grad_output.float() / count
    mask = valid.to(dtype)
    grad_h = torch.empty(h.shape, dtype=h.dtype)
    grad_w = torch.zeros(w.shape, dtype=torch.float32)
    grad_b = torch.zeros(w.shape[0], dtype=torch.float32)
    hm = hc * mask[:, None]
    for s in range(0, len(t), rows):
        e = min(s + rows, len(t))
        g = hl._chunk_grad(F.linear(hc[s:e], wc, bc), safe[s:e, None], lse[s:e, None], dtype)
        torch.mul(g @ wc, (valid[s:e].float() * scale)[:, None], out=grad_h[s:e])
        hl._accumulate(grad_w, g.t(), hm[s:e])
        grad_b += torch.mv(g.t(), mask[s:e]).float()
    return grad_h, grad_w.mul_(scale).to(w.dtype), grad_b.mul_(scale).to(b.dtype)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "bmm", "linear", "matmul")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_formed_in_forward_are_bitwise_the_recomputing_form_with_a_matmul_less(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(700, 64, generator=g).requires_grad_()
    w = (torch.randn(3000, 64, generator=g) * 0.1).requires_grad_()
    b = (torch.randn(3000, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, 3000, (700,), generator=g)
    t[::7] = -100
    chunks = 6  # 700 rows by 128
    with _CountMatmuls() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = linear_cross_entropy(h, w, t, bias=b, chunk_rows=128)
        (loss * 0.37).backward()
    # per chunk: the logits, g @ W and g^T @ h (the recomputing form makes the logits twice)
    assert seen.count == 3 * chunks
    want = _recomputing_reference(h.detach(), w.detach(), b.detach(), t, 128, torch.tensor(0.37), dtype)
    for got, ref in zip((h.grad, w.grad, b.grad), want):
        assert torch.equal(got, ref)
    with _CountMatmuls() as seen, torch.no_grad():  # evaluation forms no gradients
        linear_cross_entropy(h, w, t, bias=b, chunk_rows=128)
    assert seen.count == chunks


def test_the_cli_choices_are_the_modes_and_the_kernels():
    # --head-loss takes every mode and every kernel by name, nothing else (config.HEAD_LOSSES is
    # written out where the config is, so that the config needs no torch import to list it)
    from asyncpp_ext.training.config import HEAD_LOSSES

    assert set(HEAD_LOSSES) == set(hl.HEAD_LOSS_MODES) | set(hl.KERNELS)
