"""The GPT as pipeline blocks: composition, shapes, causality, deterministic init, presets."""
import math

import pytest
import torch
import torch.nn.functional as F

from asyncpp_ext.models import GPT, GPTConfig, preset_config

TINY = preset_config("tiny")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_blocks_composed_in_order_equal_forward_bitwise(family):
    from asyncpp_ext.models import Llama, llama_preset_config

    cfg = TINY if family == "gpt" else llama_preset_config("llama-tiny")
    model = (GPT if family == "gpt" else Llama)(cfg, seed=3)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    x = idx
    for block in model.blocks():
        x = block(x)
    logits, loss = model(idx)
    assert loss is None
    assert torch.equal(x, logits)


def test_block_boundaries_have_the_documented_shapes_and_dtypes():
    cfg = preset_config("tiny", n_layer=3)
    model = GPT(cfg)
    blocks = model.blocks()
    assert len(blocks) == cfg.num_blocks == 5
    idx = torch.zeros(4, 7, dtype=torch.int64)
    h = blocks[0](idx)
    assert h.shape == (4, 7, cfg.n_embd) and h.dtype == torch.float32
    for block in blocks[1:-1]:
        assert block(h).shape == h.shape
    assert blocks[-1](h).shape == (4, 7, cfg.vocab_size)


def test_every_parameter_belongs_to_exactly_one_block_and_embedding_is_not_tied():
    model = GPT(TINY)
    in_blocks = [p for b in model.blocks() for p in b.parameters()]
    assert len(in_blocks) == len(list(model.parameters()))
    assert len({id(p) for p in in_blocks}) == len(in_blocks)
    assert model.embed.tok.weight.data_ptr() != model.head.proj.weight.data_ptr()


def test_attention_is_causal():
    model = GPT(TINY, seed=1)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and pa.dim() == 2:
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_default_module_init_is_skipped_and_the_values_are_the_same(family, monkeypatch):
    # reset_parameters writes every parameter (GPT's biases zero and LayerNorms at identity,
    # Llama's norms at one), so the build skips torch's default draws and equals one that ran them
    import contextlib
    import importlib

    from asyncpp_ext.models import Llama, llama_preset_config

    def build():
        if family == "gpt":
            return GPT(TINY, seed=4)
        return Llama(llama_preset_config("llama-tiny", n_layer=3, intermediate_size=96), seed=4)
    fast = build()
    monkeypatch.setattr(importlib.import_module(f"asyncpp_ext.models.{family}"), "skip_default_init",
                        contextlib.nullcontext)
    slow = build()
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert fast_state.keys() == slow_state.keys()
    assert all(torch.equal(fast_state[k], slow_state[k]) for k in fast_state)


def test_loss_is_mean_cross_entropy_and_starts_near_uniform():
    model = GPT(TINY, seed=0)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 256, (3, TINY.seq_len), generator=gen)
    targets = torch.randint(0, 256, (3, TINY.seq_len), generator=gen)
    logits, loss = model(idx, targets)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    assert torch.equal(loss, expected)
    assert abs(loss.item() - math.log(256)) < 0.05  # small init -> near-uniform predictions


def test_presets_and_overrides():
    small = preset_config("small")
    assert (small.n_layer, small.n_embd, small.n_head, small.seq_len) == (4, 128, 4, 64)
    custom = preset_config("tiny", n_layer=5, n_embd=48, n_head=3, seq_len=16)
    assert (custom.n_layer, custom.n_embd, custom.n_head, custom.seq_len) == (5, 48, 3, 16)
    assert preset_config("tiny", n_layer=None) == TINY


@pytest.mark.parametrize("bad, field", [
    (dict(n_head=3), "n_head"), (dict(n_layer=0), "n_layer"), (dict(seq_len=-1), "seq_len")])
def test_bad_shapes_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        preset_config("tiny", **bad)


def test_too_long_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="seq_len"):
        GPT(TINY)(torch.zeros(1, TINY.seq_len + 1, dtype=torch.int64))


def test_unknown_preset():
    with pytest.raises(ValueError, match="tiny, small"):
        preset_config("huge")
    assert GPTConfig().num_blocks == 4


def test_a_zero_size_is_refused_not_replaced_by_the_default_and_build_model_takes_a_preset():
    from asyncpp_ext.models import PRESETS, GPT
    from asyncpp_ext.models.registry import build_model, model_config

    for name, field in (("llama-tiny", "n_kv_head"), ("llama-tiny", "intermediate_size"), ("tiny", "mlp_ratio")):
        with pytest.raises(ValueError, match=f"model.{field} must be a positive integer, got 0"):
            build_model(model_config(name, **{field: 0}))
    assert isinstance(build_model(PRESETS["tiny"]), GPT)


@pytest.mark.parametrize("name, field", [("tiny", "init_std"), ("llama-tiny", "init_std"),
                                         ("llama-tiny", "norm_eps"), ("llama-tiny", "rope_theta")])
def test_an_infinite_scale_is_refused(name, field):
    from asyncpp_ext.models.registry import build_model, model_config

    with pytest.raises(ValueError, match=f"model.{field} must be a finite positive number, got inf"):
        build_model(model_config(name, **{field: float("inf")}))


@pytest.mark.parametrize("seed", [2**70, -1, 1.5, True])
def test_a_seed_outside_what_the_generators_take_is_named(seed):
    """torch's generator answers 2**70 with "Overflow when unpacking long"; a float or a bool
    would be taken as another seed than meant."""
    from asyncpp_ext.models import Llama, llama_preset_config

    for build in (lambda: GPT(preset_config("tiny"), seed=seed),
                  lambda: Llama(llama_preset_config("llama-tiny"), seed=seed)):
        with pytest.raises(ValueError, match=r"^seed must be an integer in 0..2\*\*63-1, got "):
            build()
    largest = [next(GPT(preset_config("tiny"), seed=2**63 - 1).parameters()) for _ in range(2)]
    assert torch.equal(*largest) and not torch.equal(largest[0], next(GPT(preset_config("tiny"), seed=0).parameters()))
