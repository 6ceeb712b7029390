"""The Llama as pipeline blocks: composition, shapes, causality, init, GQA, tying, optimizer routing,
fidelity to transformers' LlamaForCausalLM, and the SmolLM presets' sizes."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncpp_ext.models import GPT, LLAMA_PRESETS, Llama, LlamaConfig, llama_preset_config
from asyncpp_ext.models.llama import LlamaConfigError, LlamaInputError, RMSNorm
from asyncpp_ext.optim import split_named_parameters
from asyncpp_ext.pipeline.partition import GlobalView

TINY = llama_preset_config("llama-tiny")
UNTIED_MHA = llama_preset_config("llama-tiny", tie_embeddings=False, n_kv_head=TINY.n_head)


def _ids(shape, seed=0, vocab=TINY.vocab_size):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_block_boundaries_have_the_documented_shapes_and_dtypes():
    cfg = llama_preset_config("llama-tiny", n_layer=3)
    blocks = Llama(cfg).blocks()
    assert len(blocks) == cfg.num_blocks == 5
    h = blocks[0](torch.zeros(4, 7, dtype=torch.int64))
    assert h.shape == (4, 7, cfg.n_embd) and h.dtype == torch.float32
    for block in blocks[1:-1]:
        out = block(h)
        assert out.shape == h.shape and out.dtype == h.dtype
    logits = blocks[-1](h)
    assert logits.shape == (4, 7, cfg.vocab_size) and logits.dtype == torch.float32


def test_every_parameter_belongs_to_exactly_one_block():
    for cfg in (TINY, UNTIED_MHA):
        model = Llama(cfg)
        in_blocks = {id(p) for b in model.blocks() for p in b.parameters()}
        assert in_blocks == {id(p) for p in model.parameters()}
        # Only a tied table is shared, between the first and the last block.
        shared = {id(p) for p in model.embed.parameters()} & {id(p) for p in model.head.parameters()}
        assert shared == ({id(model.embed.tok.weight)} if cfg.tie_embeddings else set())


def test_attention_is_causal():
    model = Llama(TINY, seed=1)
    idx = _ids((1, 16), seed=1)
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % TINY.vocab_size
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_positions_matter_through_rotary():
    # No position table: without rotary embeddings causal attention is blind to the order of the
    # earlier tokens (a weighted mean over an unordered set), so the last position's logits would
    # be the same for a prefix and its permutation. With them, they differ.
    model = Llama(TINY, seed=2)
    a, _ = model(torch.tensor([[7, 9, 11, 13]]))
    b, _ = model(torch.tensor([[9, 7, 11, 13]]))  # the same last token, its prefix permuted
    assert (a[0, -1] - b[0, -1]).abs().max() > 1e-3


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = Llama(TINY, seed=5), Llama(TINY, seed=5), Llama(TINY, seed=6)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
        else:
            assert name.endswith("norm.weight") and torch.equal(pa, torch.ones_like(pa)), name


def test_init_scales_residual_output_projections():
    cfg = llama_preset_config("llama-tiny", n_layer=8, n_embd=64, intermediate_size=256)
    model = Llama(cfg, seed=0)
    residual = cfg.init_std / math.sqrt(2 * cfg.n_layer)  # 0.005 against 0.02
    for layer in model.layers:
        for w, want in ((layer.attn.q_proj.weight, cfg.init_std), (layer.mlp.gate_proj.weight, cfg.init_std),
                        (layer.attn.o_proj.weight, residual), (layer.mlp.down_proj.weight, residual)):
            assert abs(w.std().item() / want - 1) < 0.1


def test_grouped_query_attention_shapes_and_head_grouping():
    model = Llama(TINY, seed=4)
    d = TINY.head_dim
    attn = model.layers[0].attn
    assert attn.q_proj.weight.shape == (TINY.n_head * d, TINY.n_embd)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (TINY.n_kv_head * d, TINY.n_embd)
    assert attn.o_proj.weight.shape == (TINY.n_embd, TINY.n_head * d)
    # Query head h reads kv head h // group: a plain-attention model whose kv heads are those
    # copies gives the same logits.
    mha = Llama(llama_preset_config("llama-tiny", n_kv_head=TINY.n_head), seed=0)
    group = TINY.n_head // TINY.n_kv_head
    idx = _ids((2, 12), seed=3)

    def mha_logits(spread):
        state = dict(model.state_dict())
        for key, value in model.state_dict().items():
            if key.endswith(("k_proj.weight", "v_proj.weight")):
                state[key] = spread(value.view(TINY.n_kv_head, d, TINY.n_embd)).reshape(-1, TINY.n_embd)
        mha.load_state_dict(state)
        return mha(idx)[0]

    expected = model(idx)[0]
    diff = (mha_logits(lambda w: w.repeat_interleave(group, 0)) - expected).abs().max().item()
    print(f"GQA vs plain attention with repeated kv heads: max |diff| {diff:.3e}")
    assert diff <= 1e-6
    # The other order (kv heads tiled 0,1,0,1) is a different model: the check can tell them apart.
    assert not torch.allclose(mha_logits(lambda w: w.repeat(group, 1, 1)), expected, rtol=0, atol=1e-4)


def test_rms_norm_computes_in_float32_and_returns_the_input_dtype():
    norm = RMSNorm(8, eps=1e-5)
    x32 = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 3.0
    torch.testing.assert_close(norm(x32).pow(2).mean(-1), torch.ones(3))  # unit weight: unit RMS
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    norm = norm.to(torch.bfloat16)
    x = x32.to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    xf = x.float()  # normalise in float32, cast back, then scale by the (bf16) weight
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_too_long_input_is_rejected_clearly():
    with pytest.raises(LlamaInputError, match=r"sequence length 33 exceeds the model's seq_len 32"):
        Llama(TINY)(torch.zeros(1, TINY.seq_len + 1, dtype=torch.int64))
    assert issubclass(LlamaInputError, ValueError)


@pytest.mark.parametrize("bad, field", [
    (dict(n_kv_head=3), "model.n_kv_head"), (dict(n_head=3), "model.n_head"),
    (dict(n_embd=36, n_head=4), "must be even"), (dict(intermediate_size=0), "model.intermediate_size"),
    (dict(tie_embeddings=1), "model.tie_embeddings"), (dict(rope_theta=-1.0), "model.rope_theta"),
    (dict(norm_eps=0.0), "model.norm_eps"), (dict(seq_len=True), "model.seq_len")])
def test_bad_shapes_name_the_field(bad, field):
    with pytest.raises(LlamaConfigError, match=field):
        llama_preset_config("llama-tiny", **bad)


def test_presets_overrides_and_unknown_names():
    assert list(LLAMA_PRESETS) == ["llama-tiny", "smollm-135m", "smollm-360m"]
    assert (TINY.vocab_size, TINY.seq_len, TINY.n_layer, TINY.n_embd, TINY.n_head, TINY.n_kv_head,
            TINY.intermediate_size, TINY.tie_embeddings) == (256, 32, 2, 32, 4, 2, 64, True)
    custom = llama_preset_config("llama-tiny", n_layer=5, seq_len=16, tie_embeddings=False)
    assert (custom.n_layer, custom.seq_len, custom.tie_embeddings, custom.num_blocks) == (5, 16, False, 7)
    assert llama_preset_config("llama-tiny", n_layer=None) == TINY
    assert LlamaConfig(**TINY.to_dict()) == TINY
    with pytest.raises(LlamaConfigError, match="llama-tiny, smollm-135m, smollm-360m"):
        llama_preset_config("huge")
    with pytest.raises(LlamaConfigError, match="mlp_ratio"):
        llama_preset_config("llama-tiny", mlp_ratio=4)


def test_loss_is_the_gpt_loss_and_starts_near_uniform():
    assert Llama.loss is GPT.loss  # one shared implementation
    model = Llama(TINY, seed=0)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 256, (3, TINY.seq_len), generator=gen)
    targets = torch.randint(0, 256, (3, TINY.seq_len), generator=gen)
    logits, loss = model(idx, targets)
    assert torch.equal(loss, F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)))
    assert abs(loss.item() - math.log(256)) < 0.1


# ---- tied embeddings ----------------------------------------------------------------------------

def test_tied_head_shares_the_embedding_parameter():
    model = Llama(TINY)
    assert model.head.proj.weight is model.embed.tok.weight
    assert [n for n, _ in model.named_parameters()].count("head.proj.weight") == 0
    untied = Llama(UNTIED_MHA)
    assert untied.head.proj.weight is not untied.embed.tok.weight
    assert not torch.equal(untied.head.proj.weight, untied.embed.tok.weight)


def test_head_uses_a_replaced_parameter_with_the_same_values():
    model = Llama(TINY, seed=7)
    idx = _ids((2, 20), seed=5)
    before, _ = model(idx)
    model.head.proj.weight = nn.Parameter(model.embed.tok.weight.detach().clone())
    assert model.head.proj.weight is not model.embed.tok.weight
    after, _ = model(idx)
    assert torch.equal(before, after)
    with torch.no_grad():  # and it really reads the new Parameter
        model.head.proj.weight.mul_(2.0)
    assert not torch.equal(model(idx)[0], before)


def test_tied_gradient_is_the_sum_of_both_uses():
    tied = Llama(TINY, seed=8)
    untied = copy.deepcopy(tied)
    untied.head.proj.weight = nn.Parameter(tied.embed.tok.weight.detach().clone())
    gen = torch.Generator().manual_seed(6)
    idx, targets = (torch.randint(0, 256, (2, 24), generator=gen) for _ in range(2))
    tied(idx, targets)[1].backward()
    untied(idx, targets)[1].backward()
    g_embed, g_head = untied.embed.tok.weight.grad, untied.head.proj.weight.grad
    assert g_embed.abs().sum() > 0 and g_head.abs().sum() > 0
    # Autograd adds the two uses' gradients into the shared tensor: the very same sum, bitwise.
    assert torch.equal(tied.embed.tok.weight.grad, g_embed + g_head)
    assert not torch.allclose(tied.embed.tok.weight.grad, g_head)


# ---- optimizer routing ---------------------------------------------------------------------------

MATRIX_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")


@pytest.mark.parametrize("cfg", [TINY, UNTIED_MHA], ids=["tied", "untied"])
def test_muon_hybrid_routes_embedding_and_head_to_adamw(cfg):
    model = Llama(cfg)
    muon, adamw = split_named_parameters(model)
    muon_names, adamw_names = {n for n, _ in muon}, {n for n, _ in adamw}
    assert muon_names == {n for n, _ in model.named_parameters() if n.endswith(MATRIX_SUFFIXES)}
    norms = {n for n, _ in model.named_parameters() if n.endswith("norm.weight")}
    head = set() if cfg.tie_embeddings else {"head.proj.weight"}  # a tied table is listed once
    assert adamw_names == {"embed.tok.weight", *norms, *head}
    assert len(muon) + len(adamw) == len(list(model.parameters()))


def test_a_stage_holding_only_the_head_routes_its_projection_to_adamw():
    model = Llama(TINY)
    # As on the last pipeline stage: the head alone, with its own copy of the tied table.
    head = model.head
    head.proj.weight = nn.Parameter(model.embed.tok.weight.detach().clone())
    stage = GlobalView(nn.ModuleList([head]), ["head"])
    muon, adamw = split_named_parameters(stage)
    assert muon == []
    assert {n for n, _ in adamw} == {"head.norm.weight", "head.proj.weight"}


# ---- fidelity to transformers -------------------------------------------------------------------

def _hf_name(name: str) -> str:
    """Our parameter name -> transformers.LlamaForCausalLM's."""
    if name == "embed.tok.weight":
        return "model.embed_tokens.weight"
    if name == "head.norm.weight":
        return "model.norm.weight"
    if name == "head.proj.weight":
        return "lm_head.weight"
    name = name.replace("attn_norm.", "input_layernorm.").replace("mlp_norm.", "post_attention_layernorm.")
    return "model." + name.replace(".attn.", ".self_attn.")


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cfg", [TINY, UNTIED_MHA], ids=["tied-gqa", "untied-mha"])
def test_logits_match_transformers_llama(cfg, attn_implementation):
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install 'asyncpp_ext[hf]'")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        attn_implementation=attn_implementation)
    with torch.random.fork_rng(devices=[]):
        hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    ours = Llama(cfg, seed=11)
    missing, unexpected = hf.load_state_dict({_hf_name(n): t for n, t in ours.state_dict().items()},
                                             strict=False)
    assert missing == [] and set(unexpected) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == cfg.tie_embeddings
    assert torch.equal(hf.lm_head.weight, ours.head.proj.weight)
    idx = _ids((3, cfg.seq_len), seed=9)
    with torch.no_grad():
        expected = hf(input_ids=idx).logits
        got, _ = ours(idx)
    diff = (got - expected).abs().max().item()
    print(f"max |ours - transformers| logits ({attn_implementation}): {diff:.3e}")
    assert diff <= 1e-5
    assert expected.abs().max() > 0.1  # the comparison is not between two near-zero tensors


# ---- SmolLM presets --------------------------------------------------------------------------------

def _count_from_shape(cfg: LlamaConfig) -> int:
    """Parameters by arithmetic: embedding, per-layer attention + MLP + two norms, final norm, head."""
    d = cfg.head_dim
    attention = cfg.n_embd * cfg.n_head * d * 2 + cfg.n_embd * cfg.n_kv_head * d * 2  # q, o; k, v
    per_layer = attention + 3 * cfg.n_embd * cfg.intermediate_size + 2 * cfg.n_embd
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.n_embd
    return cfg.vocab_size * cfg.n_embd + cfg.n_layer * per_layer + cfg.n_embd + head


SMOLLM = {"smollm-135m": 134_515_008, "smollm-360m": 361_821_120}


def test_smollm_presets_are_the_published_shapes():
    s135, s360 = LLAMA_PRESETS["smollm-135m"], LLAMA_PRESETS["smollm-360m"]
    def shape(c):
        return c.n_embd, c.n_layer, c.n_head, c.n_kv_head, c.intermediate_size

    assert shape(s135) == (576, 30, 9, 3, 1536)
    assert shape(s360) == (960, 32, 15, 5, 2560)
    for cfg in (s135, s360):
        assert (cfg.vocab_size, cfg.seq_len, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings,
                cfg.head_dim, cfg.init_std) == (49152, 2048, 10000.0, 1e-5, True, 64, 0.02)
    for name, expected in SMOLLM.items():
        assert _count_from_shape(LLAMA_PRESETS[name]) == expected, name


@pytest.fixture(scope="module")
def smollm(request):
    """A real fp32 build of the SmolLM preset named by the test's parameter (0.5 / 1.5 GB), built
    once per module for the tests below."""
    return request.param, Llama(llama_preset_config(request.param), seed=0)


@pytest.mark.parametrize("name", list(SMOLLM))
def test_smollm_parameter_count_of_a_real_build(name):
    # the module as built, tied table and all, its tensors on the meta device (no 1.5 GB of
    # float32 weights to fill for a count)
    with torch.device("meta"):
        model = Llama(llama_preset_config(name), seed=0)
    count = model.num_parameters()
    print(f"{name}: {count:,} parameters")
    assert count == SMOLLM[name] == _count_from_shape(model.config)


# 360M: 2-3 s alone, but beyond 20 s when the 2 shared cores are busy, so only with -m slow.
@pytest.mark.parametrize("smollm", ["smollm-135m", pytest.param("smollm-360m", marks=pytest.mark.slow)],
                         indirect=True)
def test_smollm_forward_backward_on_one_short_microbatch(smollm):
    name, model = smollm
    gen = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, 49152, (1, 16), generator=gen) for _ in range(2))
    logits, loss = model(idx, targets)
    assert logits.shape == (1, 16, 49152)
    loss.backward()
    print(f"{name}: initial loss {loss.item():.4f} (ln 49152 = {math.log(49152):.4f})")
    # Near uniform, though not exactly: with a tied table the logits of the input token itself
    # are raised by the residual stream's copy of its embedding.
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(49152)) < 0.5
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_handed_to_sdpa_equals_the_repeated_heads(monkeypatch, dtype):
    """The GPU path (enable_gqa: SDPA reads each shared key/value head in place) run on CPU against
    the repeat the CPU keeps: the same outputs, and gradients equal up to float rounding, since the
    kernel sums a shared head's key/value gradient over its query heads itself where the repeat's
    backward sums the copies afterwards (another order of additions). Measured, relative in norm:
    fp32 <= 1.5e-7, bf16 <= 2.8e-3; bound: 4 machine epsilons of the dtype."""
    from asyncpp_ext.models import llama

    cfg = llama.llama_preset_config("llama-tiny", n_head=4, n_kv_head=2)
    x = torch.randn(2, 16, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    cos, sin = llama.rotary_cos_sin(16, cfg.head_dim, cfg.rope_theta, "cpu", torch.float32)
    results = []
    for devices in ((), ("cpu",)):
        monkeypatch.setattr(llama, "NATIVE_GQA_DEVICES", devices)
        torch.manual_seed(0)
        attn = llama.Attention(cfg).to(dtype)
        xi = x.to(dtype).detach().clone().requires_grad_()
        y = attn(xi, cos.to(dtype), llama.signed_sin(sin).to(dtype))
        y.square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for p in attn.parameters()])
    assert torch.equal(results[0][0], results[1][0])
    eps = torch.finfo(dtype).eps
    for got, want in zip(*results):
        assert (got.float() - want.float()).norm() <= 4 * eps * want.float().norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_by_roll_equals_the_rotate_half_concatenation_bit_for_bit(dtype):
    """apply_rotary rolls x against a sign-folded sin table; the textbook form concatenates
    (-second, first). (-a) * b and a * (-b) are the same float, so the two agree exactly, values
    and gradients."""
    from asyncpp_ext.models import llama

    cos, sin = (t.to(dtype) for t in llama.rotary_cos_sin(24, 16, 10000.0, "cpu", torch.float32))
    x = torch.randn(2, 3, 24, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for rolled in (True, False):
        xi = x.clone().requires_grad_()
        if rolled:
            y = llama.apply_rotary(xi, cos, llama.signed_sin(sin))
        else:
            first, second = xi.chunk(2, dim=-1)
            y = xi * cos + torch.cat((-second, first), dim=-1) * sin
        y.backward(torch.linspace(-2, 2, y.numel()).reshape(y.shape).to(dtype))
        results.append((y.detach(), xi.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_inside_skip_default_init_modules_draw_nothing_from_the_global_rng():
    # reset_parameters writes every parameter from the seed, so torch's default init (kaiming
    # draws per nn.Linear: most of a model's build time on the CPU) is skipped; that the built
    # models equal ones built with it is tests/test_models.py's
    from asyncpp_ext.models import base

    before = torch.get_rng_state()
    with base.skip_default_init():
        layer = torch.nn.Linear(64, 64)
        assert torch.equal(torch.get_rng_state(), before)  # the kaiming draw did not happen
        assert torch.equal(torch.ones(3) * 2, torch.full((3,), 2.0))  # other functions run
    torch.nn.Linear(64, 64)
    assert not torch.equal(torch.get_rng_state(), before)  # outside it, it does
    assert layer.weight.shape == (64, 64)
