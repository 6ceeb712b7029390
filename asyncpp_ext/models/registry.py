"""One model description for every architecture the trainer can build, and the presets by name.

``ModelConfig`` is the ``model`` section of a run's config.json: ``arch`` says which model family
builds it (``gpt``: the byte-level toy of gpt.py; ``llama``: llama.py; ``hf``: a Hugging Face
``transformers`` causal LM through hf.py) and the other fields give its shape. Fields that an
architecture does not use stay None. ``build_model(cfg, seed)`` returns a module with ``blocks()``
and a static ``loss(logits, targets)``, ready for the partitioner.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

from torch import nn

from .gpt import GPT, PRESETS as GPT_PRESETS, GPTConfig

ARCHS = ("gpt", "llama", "hf")


@dataclass
class ModelConfig:
    """Shape of the model a run trains. Every field is part of a checkpoint's identity."""

    arch: str = "gpt"
    """Model family: gpt (learned positions, LayerNorm, GELU MLP) | llama (RMSNorm, rotary
    positions, SwiGLU, grouped-query attention) | hf (a transformers model: ``hf_config``)."""
    vocab_size: int = 256
    """Number of token ids; 256 = raw bytes (the built-in corpus and text files)."""
    seq_len: int = 32
    """Training context length T (for hf: at most the model's maximum positions)."""
    n_layer: int = 2
    """Transformer blocks (the model has n_layer + 2 pipeline blocks: embedding, layers, head)."""
    n_embd: int = 32
    """Residual stream width C."""
    n_head: int = 2
    """Attention heads; must divide n_embd."""
    mlp_ratio: Optional[int] = 4
    """gpt: hidden width of the MLP as a multiple of n_embd."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embeddings and linear weights (gpt, llama)."""
    n_kv_head: Optional[int] = None
    """llama: key/value heads (grouped-query attention); must divide n_head."""
    intermediate_size: Optional[int] = None
    """llama: hidden width of the SwiGLU MLP."""
    tie_embeddings: bool = False
    """llama: the output head uses the input embedding matrix (one tensor, two uses)."""
    rope_theta: Optional[float] = None
    """llama: base of the rotary position embedding frequencies."""
    norm_eps: Optional[float] = None
    """llama: epsilon of RMSNorm."""
    hf_config: Optional[dict] = None
    """hf: the transformers ``config.json`` contents (random initialisation from ``--hf-config``)."""
    hf_model: Optional[str] = None
    """hf: a local directory with config.json and safetensors weights to start from."""

    @property
    def num_blocks(self) -> int:
        """Pipeline blocks of the model: embedding + n_layer layers + head."""
        return self.n_layer + 2

    def to_dict(self) -> dict:
        return asdict(self)

    def arch_config(self):
        """The architecture's own config object (GPTConfig, LlamaConfig, or the hf dict)."""
        if self.arch == "gpt":
            return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, n_layer=self.n_layer,
                             n_embd=self.n_embd, n_head=self.n_head, mlp_ratio=4 if self.mlp_ratio is None else self.mlp_ratio,
                             init_std=self.init_std)
        if self.arch == "llama":
            from .llama import LlamaConfig
            return LlamaConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, n_layer=self.n_layer,
                               n_embd=self.n_embd, n_head=self.n_head,
                               n_kv_head=self.n_head if self.n_kv_head is None else self.n_kv_head,
                               intermediate_size=(4 * self.n_embd if self.intermediate_size is None
                                                  else self.intermediate_size),
                               tie_embeddings=self.tie_embeddings,
                               rope_theta=10000.0 if self.rope_theta is None else self.rope_theta,
                               norm_eps=1e-5 if self.norm_eps is None else self.norm_eps,
                               init_std=self.init_std)
        return self.hf_config

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot build a model."""
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "seq_len", "n_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
            if value > MODEL_LIMITS[name]:
                raise ValueError(f"model.{name} must be at most {MODEL_LIMITS[name]}, got {value!r}")
        if self.arch == "hf":
            if not isinstance(self.hf_config, dict):
                raise ValueError("model.arch='hf' needs model.hf_config (pass --hf-config FILE or --hf-model DIR)")
            return
        if self.hf_config is not None or self.hf_model is not None:
            raise ValueError(f"model.hf_config/hf_model only apply to arch 'hf', not {self.arch!r}")
        if isinstance(self.n_embd, int) and self.n_embd > MODEL_LIMITS["n_embd"]:
            raise ValueError(f"model.n_embd must be at most {MODEL_LIMITS['n_embd']}, got {self.n_embd!r}")
        self.arch_config().validate()  # init_std and the other fields, as the architecture checks them


MODEL_LIMITS = {"vocab_size": 2**24, "seq_len": 2**24, "n_layer": 4096, "n_embd": 2**16}
"""Largest values accepted, far above any model's (a vocabulary of 16M ids, 4096 layers, a width
of 65536): beyond them a typo, whose model would exhaust memory or take hours to build before
failing."""


def as_model_config(cfg) -> ModelConfig:
    """``cfg`` as a ModelConfig: a ModelConfig as is; a GPTConfig or LlamaConfig (e.g. from
    ``preset_config``) converted, so scripts that hand the run a model's own config keep working."""
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, GPTConfig):
        return _from_arch("gpt", cfg)
    from .llama import LlamaConfig
    if isinstance(cfg, LlamaConfig):
        return _from_arch("llama", cfg)
    raise ValueError(f"model config must be a ModelConfig, GPTConfig or LlamaConfig, got {type(cfg).__name__}")


def _from_arch(arch: str, cfg) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    values = {k: v for k, v in asdict(cfg).items() if k in known}
    if arch == "llama":
        values["mlp_ratio"] = None
    return ModelConfig(arch=arch, **values)


def _presets() -> dict:
    from .llama import LLAMA_PRESETS
    presets = {name: _from_arch("gpt", c) for name, c in GPT_PRESETS.items()}
    presets.update({name: _from_arch("llama", c) for name, c in LLAMA_PRESETS.items()})
    return presets


MODEL_PRESETS = _presets()
"""Every preset by name: tiny, small (gpt); llama-tiny, smollm-135m, smollm-360m (llama)."""


def model_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with any non-None field ``overrides`` (n_layer, seq_len, vocab_size...)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown model field(s) {sorted(unknown)}; known: {sorted(known)}")
    values = MODEL_PRESETS[name].to_dict()
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = ModelConfig(**values)
    cfg.validate()
    return cfg


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The model of ``cfg`` (a ModelConfig, or a GPTConfig / LlamaConfig), initialised from
    ``seed`` (or loaded from ``cfg.hf_model``)."""
    cfg = as_model_config(cfg)
    cfg.validate()
    if cfg.arch == "gpt":
        return GPT(cfg.arch_config(), seed=seed)
    if cfg.arch == "llama":
        from .llama import Llama
        return Llama(cfg.arch_config(), seed=seed)
    from . import hf
    if cfg.hf_model is not None:
        return hf.from_pretrained(cfg.hf_model)
    return hf.from_config(cfg.hf_config, seed=seed)


def describe(cfg: ModelConfig) -> str:
    """One line naming the model for summaries, e.g. ``llama 2x32 (tied)``."""
    tied = " tied" if cfg.tie_embeddings else ""
    if cfg.arch == "hf":
        kind = (cfg.hf_config or {}).get("model_type", "?")
        return f"hf {kind} {cfg.n_layer} layers{tied}"
    return f"{cfg.arch} {cfg.n_layer}x{cfg.n_embd}{tied}"


__all__ = ["ARCHS", "ModelConfig", "as_model_config", "MODEL_PRESETS", "model_config", "build_model", "describe"]
