"""Hugging Face ``transformers`` causal language models as asyncpp pipeline blocks.

``from_config`` builds a randomly initialised model from a ``config.json`` (or its dict);
``from_pretrained`` loads a local directory of safetensors weights for continued pretraining. Both
return an ``HFCausalLM`` whose ``blocks()`` are::

    blocks[0]      embedding block   int64 (B, T)   -> float (B, T, C)   tokens (GPT-2: + positions)
    blocks[1..L]   one decoder layer (B, T, C)      -> (B, T, C)
    blocks[L+1]    head block        (B, T, C)      -> (B, T, V)         final norm + lm_head

Only the hidden state crosses a block boundary: each layer block derives its position ids, rotary
cos/sin (from the transformers model's own rotary module) and, where a sliding window cuts the
sequence, its attention mask from the hidden state's shape. The blocks hold the transformers
modules themselves, so the weights, their initialisation and the layer code are those of
``transformers``; ``hf_state_dict()`` gives the weights back under the names transformers uses.

Models are built for pipeline training: float32 weights, attention through PyTorch's
scaled_dot_product_attention (``sdpa``, causal by its own flag, no mask tensor), and every dropout
probability in the config set to 0. Pipeline stages and the one-process simulator draw different
random numbers, so dropout would break the guarantee that both compute the same thing; pretraining
commonly runs without it.

Supported: the Llama decoder-layer family (``llama``, ``mistral``, ``qwen2``, ``qwen3``) and
``gpt2``. ``transformers`` is optional and imported only when a model is built
(``pip install 'asyncpp_ext[hf]'``).
"""
from __future__ import annotations

import copy
import inspect
import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from .base import BlockModel, check_seed, check_token_ids
from .document_mask import active_mask
from .hf_checks import SIZE_KEYS, HFModelError, check_heads_and_norms, check_sizes_given

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
"""model_types whose decoder layers take (hidden_states, attention_mask, position_ids,
position_embeddings) and whose model holds embed_tokens / layers / norm / rotary_emb."""
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "gpt2")
"""Every model_type the adapter builds; others are refused."""
MIN_TRANSFORMERS = "4.56"
"""Oldest transformers whose decoder-layer interface the adapter has been checked against."""
INSTALL_HINT = "pip install 'asyncpp_ext[hf]'"


# ---------------------------------------------------------------------------------------------
# transformers import, config reading


def require_transformers():
    """The transformers module, checked to be installed and recent enough."""
    try:
        import transformers
    except ImportError as exc:
        raise HFModelError(f"Hugging Face models need the transformers package, which is not "
                           f"installed ({exc}); run {INSTALL_HINT}") from None
    from packaging.version import Version
    found = Version(transformers.__version__)
    if found.release < Version(MIN_TRANSFORMERS).release:
        raise HFModelError(f"transformers {transformers.__version__} is older than the {MIN_TRANSFORMERS} "
                           f"whose layer interface this adapter uses; run pip install -U "
                           f"'transformers>={MIN_TRANSFORMERS}'")
    return transformers


def _check_model_type(config: dict, source: str) -> str:
    model_type = config.get("model_type")
    if not model_type:
        raise HFModelError(f"{source} has no \"model_type\"; use a transformers config.json "
                           f"(model_type one of {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFModelError(f"{source}: model_type {model_type!r} is not supported; supported: "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def read_config(path: Union[str, os.PathLike]) -> dict:
    """The contents of a transformers ``config.json``, checked to be JSON naming a supported
    ``model_type``. Needs no transformers install."""
    file = Path(path)
    if not file.exists():
        raise HFModelError(f"config file {file} does not exist; pass the path of a transformers config.json")
    if not file.is_file():
        raise HFModelError(f"config path {file} is not a file; pass the config.json itself "
                           f"(e.g. {file / 'config.json'})")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFModelError(f"config file {file} is not valid JSON ({exc}); fix it or re-save it with "
                           "config.save_pretrained()") from None
    if not isinstance(config, dict):
        raise HFModelError(f"config file {file} holds a JSON {type(config).__name__}, not an object; "
                           "pass a transformers config.json")
    _check_model_type(config, f"config file {file}")
    return config


def _hf_config(config: dict):
    """A transformers config object for ``config`` with dropout off (every ``*dropout*`` /
    ``*pdrop`` probability set to 0, see the module docstring) and no key/value cache."""
    transformers = require_transformers()
    values = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = transformers.AutoConfig.for_model(config["model_type"], **values)
    except Exception as exc:  # transformers' validators raise ValueError, TypeError or their own types
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise HFModelError(f"transformers rejects the {config['model_type']} config ({reason}); "
                           "fix that field of the config") from None
    for key, value in hf_config.to_dict().items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            setattr(hf_config, key, 0.0)
    if getattr(hf_config, "add_cross_attention", False):
        raise HFModelError("config has add_cross_attention=true (an encoder-decoder setup); set it to "
                           "false: the pipeline trains decoder-only language models")
    hf_config.use_cache = False  # training never reuses keys/values across calls
    return hf_config


def check_config(config: dict) -> None:
    """Raise HFModelError (one line) unless ``config`` (a config.json dict) names a supported
    model_type that the installed transformers accepts."""
    config_shape(config)


def config_shape(config: dict) -> dict:
    """The shape of the model ``config`` describes, with transformers' defaults filled in:
    ``vocab_size``, ``n_layer``, ``max_positions``, ``n_embd``, ``n_head``, ``tie_embeddings``.
    Raises HFModelError like ``check_config``."""
    if not isinstance(config, dict):
        raise HFModelError(f"a transformers config must be a dict, got {type(config).__name__}; "
                           "pass the contents of config.json")
    _check_model_type(config, "config")
    hf_config = _hf_config(config)
    shape = {}
    for key, attribute in _SHAPE_ATTRIBUTES.items():
        value = getattr(hf_config, attribute)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # else torch's "negative dimension", later
            raise HFModelError(f"config {attribute} must be a positive integer, got {value!r}; fix the config.json")
        shape[key] = value
    check_heads_and_norms(hf_config, shape)
    return {**shape, "tie_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False))}


# config_shape's keys -> the transformers config attribute each is read from
_SHAPE_ATTRIBUTES = {"vocab_size": "vocab_size", "n_layer": "num_hidden_layers",
                     "max_positions": "max_position_embeddings", "n_embd": "hidden_size",
                     "n_head": "num_attention_heads"}


# ---------------------------------------------------------------------------------------------
# Blocks


def _check_ids(idx: torch.Tensor, table: nn.Embedding, seq_len: int) -> None:
    check_token_ids(idx, table.num_embeddings, HFModelError)
    if idx.dim() != 2:
        raise HFModelError(f"token ids must have shape (batch, time), got {tuple(idx.shape)}; "
                           "pass a 2-D int64 tensor")
    if idx.shape[1] > seq_len:
        raise HFModelError(f"sequence length {idx.shape[1]} exceeds the model's maximum positions "
                           f"{seq_len}; shorten the input or raise max_position_embeddings")


class TokenEmbedding(nn.Module):
    """Llama family: token ids (B, T) -> embeddings (B, T, C)."""

    def __init__(self, embed_tokens: nn.Embedding, seq_len: int):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.seq_len = seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _check_ids(idx, self.embed_tokens, self.seq_len)
        return self.embed_tokens(idx)


class GPT2Embedding(nn.Module):
    """GPT-2: token ids (B, T) -> token embedding + learned position embedding (B, T, C)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, seq_len: int):
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.seq_len = seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _check_ids(idx, self.wte, self.seq_len)
        positions = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
        return self.wte(idx) + self.wpe(positions)


def _sliding_window_mask(length: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Boolean (1, 1, T, T) mask letting query i see keys i-window < j <= i, or None when the window
    cuts nothing (sdpa's causal flag then gives the same attention)."""
    if window is None or length <= window:
        return None
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    return ((key <= query) & (key > query - window))[None, None]


class LlamaFamilyLayer(nn.Module):
    """One transformers decoder layer (B, T, C) -> (B, T, C) that derives its own positions.

    Position ids are 0..T-1, cos/sin come from a private copy of the model's rotary module (so a
    stage on another device holds its own buffers), causality from sdpa's causal flag, or from an
    explicit mask for a sliding-window layer whose window is shorter than the sequence.
    """

    def __init__(self, decoder: nn.Module, rotary_emb: nn.Module, sliding_window: Optional[int]):
        super().__init__()
        self.decoder = decoder
        self.rotary_emb = rotary_emb
        self.sliding_window = sliding_window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary_emb(x, positions)
        mask = _sliding_window_mask(x.shape[1], self.sliding_window, x.device)
        documents = _documents()  # --document-mask's (B, 1, T, T), or None (models/document_mask.py)
        if documents is not None:
            mask = documents if mask is None else documents & mask
        out = self.decoder(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out  # tolerate releases returning a tuple


def _documents():
    """The held document mask as transformers' layers take it (a boolean tensor), or None."""
    mask = active_mask()
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError("a Hugging Face model's layers take the document mask as a tensor, not FlexAttention's "
                         "BlockMask: run it with --attention auto (flex is for the package's own models)")
    return mask


class GPT2Layer(nn.Module):
    """One GPT-2 block (B, T, C) -> (B, T, C); causality from sdpa's causal flag."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.decoder(x, attention_mask=_documents())  # --document-mask's, or None: causal
        return out[0] if isinstance(out, tuple) else out  # transformers 4.x returns (hidden, ...)


class LMHead(nn.Module):
    """Final norm + lm_head: (B, T, C) -> (B, T, V).

    ``lm_head`` is an nn.Linear, which reads its ``weight`` attribute at every call: when it is the
    tied input embedding and the runtime later swaps in a separate Parameter, the new one is used.
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, norm_name: str):
        super().__init__()
        self.norm_name = norm_name
        self.add_module(norm_name, norm)  # transformers' own name (norm / ln_f)
        self.lm_head = lm_head

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What goes into lm_head (the final norm); head_loss.py's fused loss starts here."""
        return getattr(self, self.norm_name)(x)

    @property
    def output_weight(self) -> torch.Tensor:
        """lm_head's (V, C) weight -- the input embedding when tied -- read at call time."""
        return self.lm_head.weight

    @property
    def output_bias(self) -> Optional[torch.Tensor]:
        """lm_head's bias: None for Llama and GPT-2, a tensor where a model's lm_head has one."""
        return self.lm_head.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.features(x))


# ---------------------------------------------------------------------------------------------
# The model


def _require_arguments(module: nn.Module, names: tuple, model_type: str) -> None:
    """Refuse a decoder layer whose forward lacks the keyword arguments the blocks pass."""
    params = inspect.signature(type(module).forward).parameters
    missing = [n for n in names if n not in params]
    if missing:
        import transformers
        raise HFModelError(f"{type(module).__name__}.forward of transformers {transformers.__version__} "
                           f"({model_type}) takes no {', '.join(missing)}; the adapter is verified with "
                           f"transformers {MIN_TRANSFORMERS} to 5.23: install a version in that range")


def _sliding_window(hf_config, layer_index: int) -> Optional[int]:
    """The attention window of decoder layer ``layer_index``, or None for full causal attention."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    if hf_config.model_type == "mistral":
        return window  # every Mistral layer uses the window
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_index] == "sliding_attention":
        return window
    return None


class HFCausalLM(BlockModel):
    """A transformers causal LM as pipeline blocks: ``[embed, *layers, head]``.

    Build it with ``from_config`` or ``from_pretrained``; the constructor wraps an already built
    transformers ``*ForCausalLM`` of a supported family (dropout off, sdpa or eager attention).
    The blocks share the transformers modules, so ``hf_model`` sees every update.

    Attributes:
        embed, layers, head: the embedding block, one block per decoder layer (nn.ModuleList),
            the final norm + lm_head block.
        hf_config: the transformers config (dropout off, ``use_cache`` off).
        hf_model: the wrapped transformers model (not a registered submodule: its parameters are
            the blocks' own), e.g. for ``save_pretrained``.
        model_type: the config's model_type.
        vocab_size: number of token ids (width of the logits).
        seq_len: longest sequence accepted (max_position_embeddings / n_positions).
        num_blocks: ``len(blocks())`` = decoder layers + 2.
        tie_embeddings: whether lm_head.weight was the input embedding Parameter when wrapped.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
            raise TypeError(f"HFCausalLM wraps a transformers *ForCausalLM model, got {type(hf_model).__name__}; "
                            "build one with from_config or from_pretrained")
        config = hf_model.config
        model_type = _check_model_type({"model_type": getattr(config, "model_type", None)},
                                       type(hf_model).__name__)
        if not isinstance(getattr(hf_model, "lm_head", None), nn.Linear):
            raise HFModelError(f"{type(hf_model).__name__} has no lm_head; wrap a causal LM "
                               "(AutoModelForCausalLM), not the bare decoder")
        _check_ready_for_pipeline(hf_model)
        self.hf_config = config
        self.model_type = model_type
        self.vocab_size = int(config.vocab_size)
        self.seq_len = int(getattr(config, "max_position_embeddings", None) or config.n_positions)
        if model_type == "gpt2":
            body = hf_model.transformer
            self.embed = GPT2Embedding(body.wte, body.wpe, self.seq_len)
            _require_arguments(body.h[0], ("hidden_states", "attention_mask"), model_type)
            self.layers = nn.ModuleList(GPT2Layer(block) for block in body.h)
            self.head = LMHead(body.ln_f, hf_model.lm_head, "ln_f")
        else:
            body = hf_model.model
            self.embed = TokenEmbedding(body.embed_tokens, self.seq_len)
            _require_arguments(body.layers[0], ("hidden_states", "attention_mask", "position_ids",
                                                "position_embeddings"), model_type)
            self.layers = nn.ModuleList(
                LlamaFamilyLayer(layer, copy.deepcopy(body.rotary_emb), _sliding_window(config, i))
                for i, layer in enumerate(body.layers[:config.num_hidden_layers]))
            self.head = LMHead(body.norm, hf_model.lm_head, "norm")
        self.num_blocks = len(self.layers) + 2
        self.tie_embeddings = self.head.lm_head.weight is hf_model.get_input_embeddings().weight
        # Kept outside the module tree so its parameters are not registered twice.
        self.__dict__["hf_model"] = hf_model
        hf_names = {id(m): name for name, m in hf_model.named_modules(remove_duplicate=False)}
        self._hf_module_names = {name: hf_names[id(m)] for name, m in self.named_modules()
                                 if id(m) in hf_names}

    @property
    def attention_width(self) -> int:
        """Query heads x head width: a config's ``head_dim`` where it sets one (Qwen3's heads are
        wider than hidden_size / heads), else hidden_size / heads."""
        config, heads = self.hf_config, int(self.hf_config.num_attention_heads)
        return heads * int(getattr(config, "head_dim", None) or config.hidden_size // heads)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers under transformers' names (``model.layers.0...``,
        ``lm_head.weight``), as ``hf_model.state_dict()`` would name them; a tied lm_head appears
        under both names, like there."""
        out = {}
        for name, tensor in self.state_dict().items():
            module_name, _, leaf = name.rpartition(".")
            hf_module = self._hf_module_names.get(module_name)
            if hf_module is None:
                raise RuntimeError(f"no transformers name for {name}")
            out[f"{hf_module}.{leaf}" if hf_module else leaf] = tensor
        return out


def _check_ready_for_pipeline(hf_model: nn.Module) -> None:
    """Refuse a model with live dropout or an attention kernel the blocks were not checked with."""
    attn = getattr(hf_model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        raise HFModelError(f"attention implementation {attn!r} is not supported; build the model with "
                           "attn_implementation='sdpa' (from_config / from_pretrained do)")
    for name, module in hf_model.named_modules():
        rate = module.p if isinstance(module, nn.Dropout) else getattr(module, "attention_dropout", 0.0)
        if isinstance(rate, (int, float)) and rate != 0:
            raise HFModelError(f"{name or 'model'} has dropout {rate}; set every dropout probability "
                               "to 0 (from_config / from_pretrained do) so pipeline stages stay exact")


# ---------------------------------------------------------------------------------------------
# Builders


def from_config(path_or_dict: Union[str, os.PathLike, dict], seed: int = 0) -> HFCausalLM:
    """A randomly initialised model from a transformers ``config.json`` path or its dict.

    Dropout is switched off and attention runs through sdpa (see the module docstring).
    transformers' own initialisation runs under ``torch.manual_seed(seed)`` inside a forked RNG:
    the same seed gives the same weights and the caller's random stream is left as it was.
    Nothing is downloaded.
    """
    if isinstance(path_or_dict, dict):
        config = dict(path_or_dict)
        _check_model_type(config, "config dict")
    else:
        config = read_config(path_or_dict)
    check_sizes_given(config)  # transformers' default sizes are a 7B Llama
    config_shape(config)  # sizes checked before transformers builds anything
    check_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = _random_model(config)
    return HFCausalLM(hf_model)


def _random_model(config: dict) -> nn.Module:
    """The transformers causal LM of ``config`` (a checked dict), randomly initialised on the
    current default device, float32, sdpa attention, dropout off."""
    return require_transformers().AutoModelForCausalLM.from_config(
        _hf_config(config), attn_implementation="sdpa", dtype=torch.float32)


def check_runs(config: dict, directory: Union[str, os.PathLike, None] = None) -> None:
    """Raise HFModelError (one line) unless the model of ``config`` runs a forward pass and the
    ``*.safetensors`` files in ``directory`` (when given) can be read and fit its shapes.

    The model is built and run on the meta device, so nothing is allocated or computed: what a
    config's fields allow but its layers cannot run (e.g. attention heads that are not a multiple of
    the key/value heads) is found before any process starts or any file is written. Only the
    files' headers are read."""
    try:
        with torch.device("meta"):
            hf_model = _random_model(config)
            model = HFCausalLM(hf_model)
            model(torch.zeros(1, min(4, model.seq_len), dtype=torch.long))
    except HFModelError:
        raise
    except Exception as exc:  # whatever the layers raise on shapes they cannot combine
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise HFModelError(f"the {config['model_type']} model this config describes cannot run ({reason}); "
                           "fix the config's shape fields") from None
    if directory is None:
        return
    from safetensors import SafetensorError, safe_open

    shapes = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
    for file in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                found = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        except (SafetensorError, OSError) as exc:
            raise HFModelError(f"weights file {file} cannot be read ({' '.join(str(exc).split())[:200]}); "
                               "save the model again with save_pretrained()") from None
        wrong = [f"{name} {shape} (config: {shapes[name]})" for name, shape in sorted(found.items())
                 if name in shapes and shapes[name] != shape]
        if wrong:
            raise HFModelError(f"weights in {file} do not fit its config.json ({'; '.join(wrong[:3])}); "
                               "save the model again with save_pretrained()")


def from_pretrained(directory: Union[str, os.PathLike]) -> HFCausalLM:
    """The model saved in a local directory (config.json + ``*.safetensors``), for continued
    pretraining. Never touches the network; weights load as float32 with dropout off."""
    folder = Path(directory)
    if not folder.is_dir():
        raise HFModelError(f"model directory {folder} does not exist or is not a directory; pass a "
                           "folder written by save_pretrained()")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise HFModelError(f"model directory {folder} has no config.json; pass a folder written by "
                           "save_pretrained()")
    if not any(folder.glob("*.safetensors")):
        raise HFModelError(f"model directory {folder} has no *.safetensors weights; re-save the model "
                           "with save_pretrained() (safetensors format)")
    config = read_config(config_file)
    transformers = require_transformers()
    hf_config = _hf_config(config)
    with torch.random.fork_rng(devices=[]):  # weights missing from the files would draw from it
        hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, config=hf_config, attn_implementation="sdpa", dtype=torch.float32,
            local_files_only=True, use_safetensors=True, output_loading_info=True)
    bad = list(info.get("missing_keys", ())) + [str(k[0]) if isinstance(k, tuple) else str(k)
                                                for k in info.get("mismatched_keys", ())]
    if bad:
        raise HFModelError(f"weights in {folder} do not fit its config.json (missing or mismatched: "
                           f"{', '.join(sorted(bad)[:5])}); save the model again with save_pretrained()")
    return HFCausalLM(hf_model)


__all__ = ["HFModelError", "HFCausalLM", "from_config", "from_pretrained", "read_config",
           "check_config", "check_runs", "check_sizes_given", "config_shape", "SIZE_KEYS",
           "SUPPORTED_MODEL_TYPES", "MIN_TRANSFORMERS"]
