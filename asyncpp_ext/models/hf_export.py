"""Any model the trainer builds, as a Hugging Face ``transformers`` model: its ``config.json`` and its
weights under the names transformers gives them, so a trained model loads with
``AutoModelForCausalLM.from_pretrained`` (and in whatever reads that format) and computes the same
logits.

One exporter per architecture (``EXPORTERS``, keyed like ``ModelConfig.arch``):

| arch | transformers model | mapping |
|---|---|---|
| ``gpt`` | ``GPT2LMHeadModel`` | names renamed; GPT-2's ``Conv1D`` holds (in, out) matrices, so every linear weight is transposed; exact GELU (``activation_function="gelu"``), untied head |
| ``llama`` | ``LlamaForCausalLM`` | names renamed (llama.py computes as transformers does: rotate-half rotary, float32 RMSNorm) |
| ``hf`` | the run's own config | the transformers modules' own names (``HFCausalLM.hf_state_dict``) |

A tied output head is left out of the weights, as transformers writes it (``tie_word_embeddings``
in the config re-ties it when loading). Token ids the config would name (bos, eos, pad) are left
unset for the gpt and llama families: the run knows its tokenizer's ids only as data.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The ``torch_dtype`` a config.json names for each export dtype."""


class ExportError(ValueError):
    """A model this module cannot express as a transformers model; the message names what."""


def _gpt2(model: nn.Module, cfg) -> tuple[dict, dict]:
    shape = cfg.arch_config()
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": shape.vocab_size, "n_positions": shape.seq_len, "n_embd": shape.n_embd,
        "n_layer": shape.n_layer, "n_head": shape.n_head, "n_inner": shape.mlp_ratio * shape.n_embd,
        "activation_function": "gelu",  # gpt.py's F.gelu is the exact (erf) GELU, not GPT-2's tanh form
        "layer_norm_epsilon": 1e-5,     # nn.LayerNorm's default, which gpt.py keeps
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # trained without dropout
        "initializer_range": shape.init_std, "scale_attn_weights": True,
        "tie_word_embeddings": False,   # gpt.py's head is a matrix of its own
        "bos_token_id": None, "eos_token_id": None,
    }
    inside = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
              "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    outside = {"embed.tok": "transformer.wte", "embed.pos": "transformer.wpe", "head.ln": "transformer.ln_f",
               "head.proj": "lm_head"}
    tensors = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in outside:
            tensors[f"{outside[module]}.{leaf}"] = tensor
            continue
        _, index, local = module.split(".", 2)  # layers.<i>.<module>
        hf_local = inside[local]
        if leaf == "weight" and not local.startswith("ln"):
            tensor = tensor.t()  # Conv1D: (in, out)
        tensors[f"transformer.h.{index}.{hf_local}.{leaf}"] = tensor
    return config, tensors


def _llama(model: nn.Module, cfg) -> tuple[dict, dict]:
    shape = cfg.arch_config()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": shape.vocab_size, "hidden_size": shape.n_embd,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head, "num_key_value_heads": shape.n_kv_head,
        "head_dim": shape.head_dim, "max_position_embeddings": shape.seq_len,
        "rms_norm_eps": shape.norm_eps, "rope_theta": shape.rope_theta, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": shape.tie_embeddings, "initializer_range": shape.init_std,
        "bos_token_id": None, "eos_token_id": None,
    }
    outside = {"embed.tok.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
               "head.proj.weight": "lm_head.weight"}
    inside = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn": "self_attn",
              "mlp": "mlp"}
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name in outside:
            tensors[outside[name]] = tensor
            continue
        _, index, first, rest = name.split(".", 3)  # layers.<i>.<module>.<rest>
        tensors[f"model.layers.{index}.{inside[first]}.{rest}"] = tensor
    return config, tensors


def _hf(model: nn.Module, cfg) -> tuple[dict, dict]:
    config = dict(cfg.hf_config)
    config.setdefault("architectures", [type(model.hf_model).__name__])  # what serving engines look up
    return config, model.hf_state_dict()


EXPORTERS: dict[str, Callable[[nn.Module, object], tuple[dict, dict]]] = {
    "gpt": _gpt2, "llama": _llama, "hf": _hf}
"""``ModelConfig.arch`` -> ``exporter(model, cfg) -> (config.json dict, {transformers name: tensor})``."""


def to_transformers(model: nn.Module, cfg, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """``(config, tensors)`` for ``model`` (built from ``cfg``: a ``ModelConfig``, or the GPTConfig /
    LlamaConfig a script built it from): the config.json contents and contiguous CPU tensors in
    ``dtype`` under transformers' names, a tied head left out. Write them with ``json.dump`` and
    ``safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})``."""
    from .registry import as_model_config

    cfg = as_model_config(cfg)
    if cfg.arch not in EXPORTERS:
        raise ExportError(f"model.arch={cfg.arch!r} has no transformers form; exportable: {', '.join(EXPORTERS)}")
    if dtype not in DTYPE_NAMES:
        raise ExportError(f"cannot export in {dtype}; choose one of {', '.join(DTYPE_NAMES.values())}")
    config, named = EXPORTERS[cfg.arch](model, cfg)
    config["torch_dtype"] = DTYPE_NAMES[dtype]
    tensors, seen = {}, set()
    for name, tensor in named.items():
        view = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if view in seen and tensor.numel():  # a tied use of a tensor already written: loading re-ties it
            continue
        seen.add(view)
        value = tensor.detach().to("cpu")
        tensors[name] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    return config, tensors


__all__ = ["DTYPE_NAMES", "EXPORTERS", "ExportError", "to_transformers"]
