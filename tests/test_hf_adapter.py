"""The Hugging Face adapter: its blocks compute what the transformers model computes, stay causal,
load saved weights exactly, keep tied embeddings, route to the Muon hybrid, and explain bad input."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncpp_ext.models import hf
from asyncpp_ext.models.hf import HFModelError
from asyncpp_ext.optim.routing import split_named_parameters

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs pip install 'asyncpp_ext[hf]'")

_LLAMA_SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=True, **_LLAMA_SHAPE),
    "gpt2": dict(model_type="gpt2", vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # Layer 1 attends through an 8-token sliding window, shorter than the test sequences.
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                  **_LLAMA_SHAPE),
    "mistral": dict(model_type="mistral", sliding_window=8, **_LLAMA_SHAPE),
    "qwen3": dict(model_type="qwen3", head_dim=8, **_LLAMA_SHAPE),
}
SEQ = 24  # longer than the sliding windows above


def _tokens(batch=3, length=SEQ, seed=0):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@needs_transformers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_loss_match_the_transformers_forward(name):
    model = hf.from_config(CONFIGS[name], seed=1)
    idx, targets = _tokens(), _tokens(seed=1)
    logits, loss = model(idx, targets)
    with torch.no_grad():
        reference = model.hf_model(input_ids=idx).logits
    assert logits.shape == (3, SEQ, 256)
    diff = (logits - reference).abs().max().item()
    assert diff <= 1e-5, f"{name}: max |logits - transformers logits| = {diff}"
    expected_loss = F.cross_entropy(reference.reshape(-1, 256), targets.reshape(-1))
    assert abs(loss.item() - expected_loss.item()) <= 1e-6


@needs_transformers
def test_sliding_window_mask_is_applied_beyond_the_window():
    windowed = hf.from_config(CONFIGS["mistral"], seed=2)
    full = hf.from_config({**CONFIGS["mistral"], "sliding_window": None}, seed=2)
    idx = _tokens()
    a, b = windowed(idx)[0], full(idx)[0]
    # Within the window both attend to the same keys; beyond it the window drops the oldest ones.
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_blocks_composed_in_order_equal_forward_bitwise(name):
    model = hf.from_config(CONFIGS[name], seed=3)
    blocks = model.blocks()
    assert len(blocks) == model.num_blocks == 4
    assert blocks[0] is model.embed and blocks[-1] is model.head and list(blocks[1:-1]) == list(model.layers)
    idx = _tokens()
    x = idx
    for block in blocks:
        x = block(x)
    assert torch.equal(x, model(idx)[0])


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_changing_a_token_leaves_earlier_logits_unchanged(name):
    model = hf.from_config(CONFIGS[name], seed=4)
    idx = _tokens()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :10], b[:, :10])
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


@needs_transformers
def test_init_is_deterministic_per_seed_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    first = hf.from_config(CONFIGS["llama"], seed=5).hf_state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    again = hf.from_config(CONFIGS["llama"], seed=5).hf_state_dict()
    other = hf.from_config(CONFIGS["llama"], seed=6).hf_state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.layers.0.self_attn.q_proj.weight"],
                           other["model.layers.0.self_attn.q_proj.weight"])


@needs_transformers
def test_attributes_and_hf_names():
    model = hf.from_config(CONFIGS["qwen3"])
    assert (model.vocab_size, model.seq_len, model.num_blocks, model.tie_embeddings) == (256, 64, 4, False)
    assert model.hf_config.model_type == "qwen3"
    assert model.num_parameters() == sum(p.numel() for p in model.hf_model.parameters())
    ours, theirs = model.hf_state_dict(), model.hf_model.state_dict()
    assert set(ours) == set(theirs)
    assert all(ours[k].data_ptr() == theirs[k].data_ptr() for k in ours)  # the very same tensors
    assert hf.from_config(CONFIGS["gpt2"]).seq_len == 64  # GPT-2 names it n_positions


@needs_transformers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_shape_describes_the_built_model(name):
    shape = hf.config_shape(CONFIGS[name])
    model = hf.from_config(CONFIGS[name])
    assert shape == {"vocab_size": model.vocab_size, "n_layer": len(model.layers),
                     "max_positions": model.seq_len, "n_embd": 32, "n_head": 4,
                     "tie_embeddings": model.tie_embeddings}
    hf.check_config(CONFIGS[name])
    with pytest.raises(HFModelError, match="'bert' is not supported"):
        hf.check_config({**CONFIGS[name], "model_type": "bert"})


@needs_transformers
def test_dropout_is_switched_off():
    model = hf.from_config({**CONFIGS["gpt2"], "resid_pdrop": 0.3, "attn_pdrop": 0.3, "embd_pdrop": 0.3})
    assert model.hf_config.resid_pdrop == model.hf_config.attn_pdrop == model.hf_config.embd_pdrop == 0.0
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))
    llama = hf.from_config({**CONFIGS["llama"], "attention_dropout": 0.3})
    assert llama.hf_config.attention_dropout == 0.0
    model.train()
    idx = _tokens()
    assert torch.equal(model(idx)[0], model(idx)[0])


@needs_transformers
def test_wrapping_a_model_with_live_dropout_is_refused():
    import transformers
    config = transformers.AutoConfig.for_model("llama", attention_dropout=0.1, **_LLAMA_SHAPE)
    live = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(HFModelError, match="dropout"):
        hf.HFCausalLM(live)


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_from_pretrained_loads_every_saved_tensor(name, tmp_path):
    from safetensors.torch import load_file
    saved_model = hf.from_config(CONFIGS[name], seed=7).hf_model
    with torch.no_grad():  # make the saved weights differ from any fresh init
        for p in saved_model.parameters():
            p.add_(0.01)
    saved_model.save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files
    loaded = hf.from_pretrained(tmp_path)
    on_disk = {k: v for f in files for k, v in load_file(f).items()}
    ours = loaded.hf_state_dict()
    for key, tensor in on_disk.items():
        assert torch.equal(ours[key], tensor), key
    embedding = "model.embed_tokens.weight" if name == "llama" else "transformer.wte.weight"
    assert loaded.tie_embeddings
    assert torch.equal(ours["lm_head.weight"], on_disk.get("lm_head.weight", on_disk[embedding]))
    idx = _tokens()
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], saved_model(input_ids=idx).logits)


@needs_transformers
def test_from_pretrained_refuses_weights_that_do_not_fit_the_config(tmp_path):
    hf.from_config(CONFIGS["llama"]).hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFModelError, match="missing or mismatched"):
        hf.from_pretrained(tmp_path)


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tied_head_reads_its_own_weight_at_call_time(name):
    model = hf.from_config(CONFIGS[name], seed=8)
    embedding = model.embed.embed_tokens if name == "llama" else model.embed.wte
    assert model.head.lm_head.weight is embedding.weight
    idx = _tokens()
    before = model(idx)[0]
    model.head.lm_head.weight = nn.Parameter(model.head.lm_head.weight.detach().clone())
    assert model.head.lm_head.weight is not embedding.weight
    assert torch.equal(model(idx)[0], before)
    with torch.no_grad():
        model.head.lm_head.weight.mul_(2.0)
    assert not torch.equal(model(idx)[0], before)


@needs_transformers
@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_muon_gets_hidden_matrices_and_adamw_the_rest(name):
    model = hf.from_config(CONFIGS[name])
    muon, adamw = split_named_parameters(model)
    hidden = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    assert {n for n, _ in muon} == hidden and hidden
    adamw_names = {n for n, _ in adamw}
    if name == "gpt2":  # tied: the shared matrix appears once, under the embedding's name
        assert {"embed.wte.weight", "embed.wpe.weight"} <= adamw_names
        assert "head.lm_head.weight" not in adamw_names
    else:
        assert {"embed.embed_tokens.weight", "head.lm_head.weight"} <= adamw_names
    assert all(p.ndim == 1 or n.startswith(("embed.", "head.")) for n, p in adamw)


@needs_transformers
@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_a_stage_holding_only_the_head_sends_lm_head_to_adamw(name):
    model = hf.from_config(CONFIGS[name])
    stage = nn.Module()
    stage.add_module("head", model.head)  # how the pipeline names a last stage's parameters
    for source in (stage, list(stage.named_parameters())):
        muon, adamw = split_named_parameters(source)
        assert muon == []
        assert "head.lm_head.weight" in {n for n, _ in adamw}


@needs_transformers
def test_sequence_longer_than_the_positions_is_refused():
    model = hf.from_config(CONFIGS["llama"])
    with pytest.raises(HFModelError, match="exceeds the model's maximum positions 64"):
        model(torch.zeros(1, 65, dtype=torch.int64))


def _one_line_error(call, match):
    with pytest.raises(HFModelError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_config_file_errors(tmp_path):
    _one_line_error(lambda: hf.from_config(tmp_path / "absent.json"), "absent.json does not exist")
    _one_line_error(lambda: hf.from_config(tmp_path), "is not a file")
    broken = tmp_path / "broken.json"
    broken.write_text("{model_type: llama")
    _one_line_error(lambda: hf.from_config(broken), "broken.json is not valid JSON")
    untyped = tmp_path / "untyped.json"
    untyped.write_text(json.dumps({"hidden_size": 32}))
    _one_line_error(lambda: hf.from_config(untyped), 'untyped.json has no "model_type"')
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert"}))
    message = _one_line_error(lambda: hf.from_config(bert), "'bert' is not supported")
    assert all(kind in message for kind in ("llama", "mistral", "qwen2", "qwen3", "gpt2"))
    _one_line_error(lambda: hf.from_config({"model_type": "t5"}), "'t5' is not supported")


@needs_transformers
def test_a_config_transformers_rejects_gives_one_line():
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 builds such a config without validating it")
    _one_line_error(lambda: hf.from_config({**CONFIGS["llama"], "hidden_size": 30}),
                    "transformers rejects the llama config.*hidden size")


def test_weight_directory_errors(tmp_path):
    _one_line_error(lambda: hf.from_pretrained(tmp_path / "absent"), "is not a directory")
    _one_line_error(lambda: hf.from_pretrained(tmp_path), "has no config.json")
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    _one_line_error(lambda: hf.from_pretrained(tmp_path), r"has no \*.safetensors weights")


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    _one_line_error(lambda: hf.from_config(CONFIGS["llama"]), r"pip install 'asyncpp_ext\[hf\]'")


@needs_transformers
def test_too_old_transformers_is_refused(monkeypatch):
    import transformers
    monkeypatch.setattr(transformers, "__version__", "4.40.0")
    _one_line_error(lambda: hf.from_config(CONFIGS["llama"]), r"4.40.0 is older.*transformers>=4.56")


@needs_transformers
def test_a_decoder_layer_without_the_verified_arguments_is_refused():
    class OldLayer(nn.Module):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    with pytest.raises(HFModelError, match="takes no position_embeddings"):
        hf._require_arguments(OldLayer(), ("hidden_states", "position_embeddings"), "llama")


def test_importing_the_package_does_not_import_transformers():
    code = ("import sys, asyncpp_ext, asyncpp_ext.models, asyncpp_ext.models.hf; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@needs_transformers
@pytest.mark.parametrize("field, value", [("hidden_size", -4), ("num_hidden_layers", 0), ("vocab_size", 0)])
def test_a_size_that_is_not_positive_gives_one_line(field, value):
    _one_line_error(lambda: hf.from_config({**CONFIGS["llama"], field: value}),
                    f"({field} must be a positive integer, got {value}|transformers rejects the llama config)")
