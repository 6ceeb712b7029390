"""The models of bench/gpu_throughput.py and their arithmetic: the bench's model names and the asyncpp
presets behind them, the SmolLM shapes as Hugging Face config fields (checked against those presets),
the parameter counts and FLOPs per token of the PaLM formula, and the GPUs' dense bf16 peaks (the
formula and its conventions are written out in gpu_throughput.py's docstring)."""
from __future__ import annotations

from asyncpp_ext.models.flops import PEAK_TFLOPS, palm_flops_per_token, peak_tflops  # noqa: F401 (PEAK_TFLOPS: re-exported)
from bench_command import BenchError  # noqa: F401 (the bench's error, re-exported)


# The published SmolLM shapes as Hugging Face config fields, checked against asyncpp's presets
# (asyncpp_ext/models/llama.py) at run time: a difference stops the bench.
SMOLLM_HF = {
    "smollm-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.02),
    "smollm-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                        intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.02),
}
# Bench model name -> (asyncpp preset, CLI shape overrides).
MODELS = {"smollm-135m": ("smollm-135m", {}), "smollm-360m": ("smollm-360m", {}),
          "llama-tiny": ("llama-tiny", {}), "llama-tiny-4x64": ("llama-tiny", {"n_layer": 4, "n_embd": 64})}


def model_shape(name: str, seq_len: int) -> dict:
    """The asyncpp LlamaConfig of a bench model at ``seq_len``, as the CLI builds it (same preset,
    same overrides), plus the flags that make the CLI build it."""
    from asyncpp_ext.models.registry import model_config

    if name not in MODELS:
        raise BenchError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    preset, overrides = MODELS[name]
    cfg = model_config(preset, seq_len=seq_len, **overrides).arch_config()
    flags = ["--model", preset, "--seq-len", str(seq_len)]
    for field, value in overrides.items():
        flags += [f"--{field.replace('_', '-')}", str(value)]
    return dict(name=name, preset=preset, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, intermediate_size=cfg.intermediate_size,
                tie_embeddings=cfg.tie_embeddings, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                init_std=cfg.init_std, max_positions=cfg.seq_len, cli_flags=flags)


def hf_config_dict(shape: dict, seq_len: int) -> dict:
    """transformers.LlamaConfig fields for ``shape``; for the SmolLM models the dict written above,
    after checking that it is the asyncpp preset's shape field by field."""
    derived = dict(hidden_size=shape["n_embd"], num_hidden_layers=shape["n_layer"],
                   num_attention_heads=shape["n_head"], num_key_value_heads=shape["n_kv_head"],
                   intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
                   tie_word_embeddings=shape["tie_embeddings"], rope_theta=float(shape["rope_theta"]),
                   max_position_embeddings=max(2048 if shape["name"] in SMOLLM_HF else seq_len, seq_len),
                   rms_norm_eps=shape["norm_eps"], initializer_range=shape["init_std"])
    if shape["name"] in SMOLLM_HF:
        written = dict(SMOLLM_HF[shape["name"]])
        written["max_position_embeddings"] = max(written["max_position_embeddings"], seq_len)
        diff = {k: (written[k], derived[k]) for k in written if written[k] != derived[k]}
        if diff:
            raise RuntimeError(f"{shape['name']}: the bench's Hugging Face config differs from asyncpp's preset "
                               f"(field: (bench, preset)): {diff}")
        derived = written
    return dict(derived, hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False)


def matmul_params(shape: dict) -> int:
    """N of the FLOP formula: block weights (Linear + RMSNorm), final norm, and the head's V x C
    (a tied table once; an untied input table is not counted: a lookup is no matmul)."""
    c, d = shape["n_embd"], shape["n_embd"] // shape["n_head"]
    attn = c * shape["n_head"] * d + 2 * c * shape["n_kv_head"] * d + shape["n_head"] * d * c
    block = attn + 3 * c * shape["intermediate_size"] + 2 * c
    return shape["n_layer"] * block + c + shape["vocab_size"] * c


def total_params(shape: dict) -> int:
    """Every parameter once (what the model holds): N plus an untied input embedding table."""
    return matmul_params(shape) + (0 if shape["tie_embeddings"] else shape["vocab_size"] * shape["n_embd"])


def flops_per_token(shape: dict, seq_len: int) -> float:
    """6 N + 12 L H Q T (H Q = the model width C): asyncpp_ext/models/flops.py's formula."""
    return palm_flops_per_token(matmul_params(shape), shape["n_layer"], shape["n_embd"], seq_len)


def peak_for_gpu(name: str | None):
    """(TFLOP/s, source) of a GPU name from the package's table (models/flops.py), or (None, reason)."""
    peak = peak_tflops(name)
    if peak is not None:
        key = next(k for k, v in PEAK_TFLOPS if k.lower() in name.lower())
        return peak, f"table: {key} dense bf16"
    return None, "unknown device: pass --peak-tflops"
