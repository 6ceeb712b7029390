"""Models expressed as lists of pipeline blocks (``model.blocks()``): the partitioner splits them
between stages, and a single process runs the very same blocks in order."""
from .gpt import GPT, PRESETS, Block, Embedding, GPTConfig, Head, preset_config
from .llama import LLAMA_PRESETS, Llama, LlamaConfig, llama_preset_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset_config", "Embedding", "Block", "Head",
           "Llama", "LlamaConfig", "LLAMA_PRESETS", "llama_preset_config"]
