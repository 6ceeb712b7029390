"""The ``model`` section of a run from the command line: a preset, a Hugging Face config.json, or a
local Hugging Face model directory, with the shape flags applied.

Everything here runs in the launching process before any rank starts, so a missing file, a
config.json that is not JSON, an architecture the adapter does not pipeline or a missing
``transformers`` ends the command with one line (exit 2) and nothing written.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..models.registry import MODEL_PRESETS, ModelConfig

_SHAPE_FLAGS = (("n_layer", "--n-layer"), ("n_embd", "--n-embd"), ("n_head", "--n-head"))


class ModelSourceError(ValueError):
    """--model/--hf-config/--hf-model cannot give a model; the message names the file and the fix."""


def read_hf_config(path: str | Path) -> dict:
    """The JSON object in ``path``, refused with one line if missing or not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise ModelSourceError(f"--hf-config {path} does not exist (or is not a file); pass a "
                               "Hugging Face config.json")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"--hf-config {path} is not valid JSON ({exc}); pass a Hugging Face "
                               "config.json") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"--hf-config {path} holds a JSON {type(data).__name__}, not an object; "
                               "pass a Hugging Face config.json")
    return data


def _hf_shape(config: dict, source: str) -> dict:
    """vocab_size, n_layer, max positions, width, heads and tying of a transformers config dict,
    after the adapter has accepted its architecture."""
    from ..models import hf

    try:
        hf.check_config(config)
    except ValueError as exc:
        raise ModelSourceError(f"{source}: {' '.join(str(exc).split())}") from None
    return hf.config_shape(config)


def hf_model_config(config: dict, source: str, model_dir: Optional[str] = None) -> ModelConfig:
    """A ModelConfig of arch ``hf`` for a transformers config dict (and optional weights dir),
    after a forward pass on the meta device and a read of the weight files' headers (the ranks
    would otherwise find a shape the layers cannot run, or a damaged file, after the run started)."""
    from ..models import hf

    shape = _hf_shape(config, source)  # an architecture the adapter takes, first
    try:  # left out, transformers would fill in its defaults: a 7B Llama
        hf.check_sizes_given(config, source)
    except hf.HFModelError as exc:
        raise ModelSourceError(str(exc)) from None
    try:
        hf.check_runs(config, model_dir)
    except ValueError as exc:
        raise ModelSourceError(f"{source}: {exc}") from None
    return ModelConfig(arch="hf", vocab_size=shape["vocab_size"], seq_len=shape["max_positions"],
                       n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                       mlp_ratio=None, tie_embeddings=shape["tie_embeddings"], hf_config=config,
                       hf_model=model_dir)


def model_from_args(args, base: ModelConfig) -> ModelConfig:
    """``base`` (defaults, or a resumed run's model) replaced by --model/--hf-config/--hf-model and
    then changed by --n-layer/--n-embd/--n-head/--seq-len/--vocab-size."""
    chosen = [flag for flag, value in (("--model", args.model), ("--hf-config", args.hf_config),
                                       ("--hf-model", args.hf_model)) if value is not None]
    if len(chosen) > 1:
        raise ModelSourceError(f"{' and '.join(chosen)} each choose the model; pass only one of them")
    if args.model is not None:
        model = ModelConfig(**MODEL_PRESETS[args.model].to_dict())
    elif args.hf_config is not None:
        model = hf_model_config(read_hf_config(args.hf_config), f"--hf-config {args.hf_config}")
    elif args.hf_model is not None:
        directory = Path(args.hf_model)
        if not (directory / "config.json").is_file():
            raise ModelSourceError(f"--hf-model {directory} has no config.json; pass a local Hugging Face "
                                   "model directory (config.json + *.safetensors)")
        if not any(directory.glob("*.safetensors")):
            raise ModelSourceError(f"--hf-model {directory} holds no *.safetensors weights; save the model "
                                   "with save_pretrained(..., safe_serialization=True)")
        model = hf_model_config(read_hf_config(directory / "config.json"), f"--hf-model {directory}",
                                model_dir=str(directory.resolve()))
    else:
        model = ModelConfig(**base.to_dict())
    if model.arch == "hf":
        return _hf_overrides(model, args)
    for field, flag in _SHAPE_FLAGS + (("seq_len", "--seq-len"), ("vocab_size", "--vocab-size")):
        value = getattr(args, field)
        if value is not None:
            setattr(model, field, value)
    return model


def _hf_overrides(model: ModelConfig, args) -> ModelConfig:
    for field, flag in _SHAPE_FLAGS:
        if getattr(args, field) is not None:
            raise ModelSourceError(f"{flag} does not apply to a Hugging Face model; change the "
                                   "config.json instead")
    if args.seq_len is not None:
        if args.seq_len > model.seq_len:
            raise ModelSourceError(f"--seq-len {args.seq_len} exceeds the model's {model.seq_len} "
                                   f"positions; pass --seq-len <= {model.seq_len}")
        model.seq_len = args.seq_len
    if args.vocab_size is not None and args.vocab_size != model.vocab_size:
        if model.hf_model is not None:
            raise ModelSourceError(f"--vocab-size {args.vocab_size} differs from the vocabulary of "
                                   f"--hf-model ({model.vocab_size}), whose weights fix it; leave "
                                   "--vocab-size out")
        model.vocab_size = args.vocab_size
        model.hf_config = {**model.hf_config, "vocab_size": args.vocab_size}
    return model


__all__ = ["ModelSourceError", "read_hf_config", "hf_model_config", "model_from_args"]
