"""Checks of a Hugging Face config that need no model built and no transformers import: the sizes a
config must give itself, and the head counts and norm epsilons its layers can run with."""
from __future__ import annotations

import math


class HFModelError(ValueError):
    """A Hugging Face config, weight directory or installation the adapter cannot use; the message
    says what is wrong and how to fix it."""


def check_heads_and_norms(hf_config, shape: dict) -> None:
    """Refuse what transformers' config classes take but the layers cannot run, or run to
    non-finite values: key/value heads that do not divide the attention heads (the forward would
    fail inside sdpa), GPT-2 heads that do not divide the width, a norm epsilon that is not a
    finite positive number (the logits would be NaN)."""
    heads = shape["n_head"]
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    if hf_config.model_type != "gpt2" and kv_heads is not None:
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            raise HFModelError(f"config num_key_value_heads must be a positive integer, got {kv_heads!r}; "
                               "fix the config.json")
        if heads % kv_heads:
            raise HFModelError(f"config num_attention_heads={heads} must be a multiple of num_key_value_heads="
                               f"{kv_heads} (each key/value head serves a whole group of query heads: the "
                               f"layers cannot run {heads} on {kv_heads}); fix the config.json")
    if hf_config.model_type == "gpt2" and shape["n_embd"] % heads:
        raise HFModelError(f"config n_embd={shape['n_embd']} must be a multiple of n_head={heads}; "
                           "fix the config.json")
    for name in ("rms_norm_eps", "layer_norm_epsilon"):
        value = getattr(hf_config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise HFModelError(f"config {name} must be a finite positive number, got {value!r}; "
                               "fix the config.json")


# Each size a config must give itself (under one of its names across architectures): left out,
# transformers fills in its class's default -- a 7B Llama for {"model_type": "llama"} -- and
# building that on the CPU runs until memory runs out.
SIZE_KEYS = (("vocab_size",), ("hidden_size", "n_embd", "d_model"), ("num_hidden_layers", "n_layer", "num_layers"),
             ("num_attention_heads", "n_head"))


def check_sizes_given(config: dict, source: str = "config") -> None:
    """Raise HFModelError (one line, starting with ``source``) unless the config.json dict
    ``config`` gives each size of ``SIZE_KEYS`` itself. Needs no transformers install."""
    missing = [names[0] for names in SIZE_KEYS if not any(n in config for n in names)]
    if missing:
        raise HFModelError(f"{source} gives no {', '.join(missing)}: transformers would fill in its defaults "
                           "(for Llama a 7B model); pass the model's whole config.json, or give them")


__all__ = ["HFModelError", "SIZE_KEYS", "check_sizes_given", "check_heads_and_norms"]
