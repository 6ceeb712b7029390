"""Models expressed as lists of pipeline blocks (``model.blocks()``): the partitioner splits them
between stages, and a single process runs the very same blocks in order."""
from .gpt import GPT, PRESETS, Block, Embedding, GPTConfig, Head, preset_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset_config", "Embedding", "Block", "Head"]
