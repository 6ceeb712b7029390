"""Arguments the models cannot use are refused with one line naming them: token ids outside the
vocabulary or of a non-index dtype, an init scale that would overflow, a Hugging Face config that
leaves its sizes to transformers' defaults or whose heads or norms its layers cannot run, and
arguments of the wrong type."""
import importlib.util
import re

import numpy as np
import pytest
import torch

from asyncpp_ext.models import GPT, GPTConfig, Llama, llama_preset_config, preset_config
from asyncpp_ext.models import hf
from asyncpp_ext.models.hf import HFModelError

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs pip install 'asyncpp_ext[hf]'")

_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2)
_GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64,
             bos_token_id=1, eos_token_id=2)

_BUILDERS = {
    "gpt": lambda: GPT(preset_config("tiny")),
    "llama": lambda: Llama(llama_preset_config("llama-tiny")),
    "hf-llama": lambda: hf.from_config(_LLAMA),
    "hf-gpt2": lambda: hf.from_config(_GPT2),
}


def _family(name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    return _BUILDERS[name]()


@pytest.mark.parametrize("name", list(_BUILDERS))
@pytest.mark.parametrize("bad", [256, -1, 10**6])
def test_a_token_id_outside_the_vocabulary_is_named(name, bad):
    """torch answers with a bare "index out of range in self" (on CUDA a device-side assert)."""
    model = _family(name)
    idx = torch.tensor([[1, 2, bad, 3]])
    with pytest.raises(ValueError, match=rf"^token ids must lie in 0\.\.255 \(the model's vocabulary\); got {bad}$"):
        model(idx)
    with pytest.raises(ValueError, match="must lie in 0..255"):
        model.blocks()[0](idx)  # the embedding block as a pipeline stage runs it
    logits, _ = model(torch.tensor([[0, 255]], dtype=torch.int32))  # both ends of the vocabulary
    assert logits.shape == (1, 2, 256)


@pytest.mark.parametrize("name", list(_BUILDERS))
@pytest.mark.parametrize("idx, match", [
    (torch.tensor([[1.0, 2.0]]), "int64 \\(or int32\\) tensor, got dtype torch.float32"),
    (torch.tensor([[True, False]]), "int64 \\(or int32\\) tensor, got dtype torch.bool"),
    (np.array([[1, 2]]), "torch.Tensor of int64 ids \\(batch, time\\), got ndarray"),
    ([[1, 2]], "torch.Tensor of int64 ids \\(batch, time\\), got list"),
])
def test_token_ids_that_are_not_an_index_tensor_are_named(name, idx, match):
    with pytest.raises(TypeError, match=f"^token ids must be an? {match}"):
        _family(name)(idx)


def test_the_range_check_is_left_to_the_data_off_the_cpu():
    """No id leaves the device for the check (it would wait for the device every forward)."""
    model = GPT(preset_config("tiny")).to("meta")
    logits, _ = model(torch.full((1, 4), 10**6, device="meta"))
    assert logits.shape == (1, 4, 256)


@pytest.mark.parametrize("build", [
    lambda std: GPT(GPTConfig(init_std=std)),
    lambda std: GPTConfig(init_std=std).validate(),
    lambda std: llama_preset_config("llama-tiny", init_std=std),
])
@pytest.mark.parametrize("std", [1e300, 1e30, 1.5])
def test_an_init_std_past_1_is_refused(build, std):
    """1e300 gave -inf weights, 1e30 a NaN loss, silently."""
    with pytest.raises(ValueError, match=rf"^model.init_std must be at most 1 .*got {re.escape(repr(std))}$"):
        build(std)


@pytest.mark.parametrize("build", [lambda: GPTConfig(init_std=True).validate(),
                                   lambda: llama_preset_config("llama-tiny", init_std=True)])
def test_a_bool_init_std_is_refused_not_taken_as_1(build):
    with pytest.raises(ValueError, match="^model.init_std must be a finite positive number, got True$"):
        build()


def test_an_init_std_up_to_1_builds():
    assert torch.isfinite(GPT(GPTConfig(init_std=1.0))(torch.tensor([[1, 2]]))[0]).all()


@pytest.mark.parametrize("build, match", [
    (lambda: GPT({"vocab_size": 256}), "^GPT takes a GPTConfig, got dict"),
    (lambda: GPT(np.array([[1, 2]])), "^GPT takes a GPTConfig, got ndarray"),
    (lambda: Llama({"vocab_size": 256}), "^Llama takes a LlamaConfig, got dict"),
    (lambda: hf.HFCausalLM(None), r"^HFCausalLM wraps a transformers \*ForCausalLM model, got NoneType"),
])
def test_a_model_built_from_the_wrong_type_is_named(build, match):
    with pytest.raises(TypeError, match=match):
        build()


@needs_transformers
@pytest.mark.parametrize("config, missing", [
    ({"model_type": "llama"}, "vocab_size, hidden_size, num_hidden_layers, num_attention_heads"),
    ({"model_type": "llama", "vocab_size": 256, "hidden_size": 32}, "num_hidden_layers, num_attention_heads"),
    ({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4}, "vocab_size"),
])
def test_a_hf_config_that_leaves_its_sizes_to_the_defaults_is_refused_before_building(config, missing,
                                                                                      monkeypatch):
    """transformers' defaults are a 7B Llama: building it ran the process out of memory."""
    monkeypatch.setattr(hf, "_random_model", lambda c: pytest.fail("a model was built"))
    with pytest.raises(HFModelError, match=f"^config gives no {missing}: transformers would fill in its "
                                           r"defaults \(for Llama a 7B model\)"):
        hf.from_config(config)
    with pytest.raises(HFModelError, match="^{'model_type': 'llama'} gives no vocab_size"):
        hf.check_sizes_given({"model_type": "llama"}, "{'model_type': 'llama'}")
    hf.check_sizes_given(_LLAMA)


@needs_transformers
@pytest.mark.parametrize("config, match", [
    ({**_LLAMA, "num_key_value_heads": 3},
     r"config num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ({**_LLAMA, "num_key_value_heads": 0}, "config num_key_value_heads must be a positive integer, got 0"),
    ({**_LLAMA, "rms_norm_eps": -1.0}, "config rms_norm_eps must be a finite positive number, got -1.0"),
    ({**_LLAMA, "rms_norm_eps": 0.0}, "config rms_norm_eps must be a finite positive number, got 0.0"),
    ({**_GPT2, "layer_norm_epsilon": -1.0}, "config layer_norm_epsilon must be a finite positive number"),
    ({**_GPT2, "n_head": 3}, "config n_embd=32 must be a multiple of n_head=3"),
])
def test_a_hf_config_whose_layers_cannot_run_is_refused_at_build(config, match, monkeypatch):
    """A kv-head count that does not divide the heads failed inside sdpa at the first forward; a
    negative epsilon gave NaN logits silently."""
    monkeypatch.setattr(hf, "_random_model", lambda c: pytest.fail("a model was built"))
    with pytest.raises(HFModelError, match=f"^{match}.*fix the config.json$"):
        hf.from_config(config)
    with pytest.raises(HFModelError, match=match):
        hf.check_config(config)
