"""The real-compute workload shared by bench/real_compute.py and bench/memory.py: a preset GPT (or
a small Llama with or without tied embeddings), its stage split, token minibatches from the built-in
corpus, and the AdamW factory every run uses.

Every rank builds the same model from the same seed, so our runtime and torch's see identical
stage modules; both take the split from ``asyncpp_ext.pipeline.split`` (balanced parameter counts).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from asyncpp_ext.data import BatchStream, load_tokens  # noqa: E402
from asyncpp_ext.models import GPT, Llama, LlamaConfig, preset_config  # noqa: E402
from asyncpp_ext.optim import build_optimizer  # noqa: E402
from asyncpp_ext.pipeline import split  # noqa: E402

MODELS = ("tiny", "small")
LR, WEIGHT_DECAY = 1e-3, 0.1
SEED = 0
# The built-in corpus is raw bytes: every token id is below this, whatever the model's vocabulary.
CORPUS_VOCAB = 256


class WorkloadVocabularyError(ValueError):
    """A vocabulary too small for the built-in corpus's token ids."""


def build_gpt(model: str) -> GPT:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return GPT(preset_config(model), seed=SEED)


def llama_config(tied: bool, vocab_size: int) -> LlamaConfig:
    """The ``small`` GPT preset's shape as a Llama (4 layers, width 128, 4 query and 2 key/value
    heads, SwiGLU width 512, context 64) with ``vocab_size`` token ids, embeddings tied or not."""
    if not isinstance(vocab_size, int) or vocab_size < CORPUS_VOCAB:
        raise WorkloadVocabularyError(f"vocab_size must be an integer >= {CORPUS_VOCAB} (the built-in "
                                      f"corpus's byte ids), got {vocab_size!r}; pass a larger --vocab-size")
    return LlamaConfig(vocab_size=vocab_size, seq_len=64, n_layer=4, n_embd=128, n_head=4, n_kv_head=2,
                       intermediate_size=512, tie_embeddings=tied)


def build_llama(tied: bool, vocab_size: int) -> Llama:
    """The benchmark Llama (``llama_config``), identically initialised on every rank."""
    return Llama(llama_config(tied, vocab_size), seed=SEED)


def _seq_len(model) -> int:
    """Context length of a GPT preset name or of a model config (anything with ``seq_len``)."""
    return preset_config(model).seq_len if isinstance(model, str) else model.seq_len


def stage_module(gpt: GPT, stages: int, stage: int) -> nn.Sequential:
    """This stage's blocks, split exactly as ``Pipeline`` splits them by default."""
    blocks = gpt.blocks()
    return nn.Sequential(*[blocks[i] for i in split(blocks, stages)[stage]])


def adamw_factory(ef_beta: float = 0.0, ef_source: str = "buffer"):
    """The optimizer of every run: the project's fused AdamW (EF on when ef_beta > 0, its previous
    update from its own buffer or, with ef_source "weights", from the weight versions)."""
    return lambda module: build_optimizer(module, "adamw", lr=LR, weight_decay=WEIGHT_DECAY, ef_beta=ef_beta,
                                          ef_source=ef_source)


def minibatches(model, microbatches: int, micro_batch_size: int, concatenated: bool = False):
    """Endless minibatches for ``model`` (a GPT preset name or a model config): a list of m
    (inputs, targets) pairs, or, with ``concatenated``, one (m*B, T) pair (what torch's schedules
    split themselves)."""
    stream = BatchStream(load_tokens("builtin"), microbatches=microbatches,
                         micro_batch_size=micro_batch_size, seq_len=_seq_len(model), seed=SEED)
    for batch in stream:
        if concatenated:
            yield torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])
        else:
            yield batch


def tokens_per_step(model, microbatches: int, micro_batch_size: int) -> int:
    """Tokens in one minibatch of ``model`` (a GPT preset name or a model config)."""
    return microbatches * micro_batch_size * _seq_len(model)


def cpu_model() -> str:
    """/proc/cpuinfo's model name ("unknown CPU" where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def machine_description() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}"
