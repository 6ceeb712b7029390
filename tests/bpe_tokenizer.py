"""A small byte-level BPE tokenizer trained on the spot, for tests of runs on tokenizer ids."""
from pathlib import Path

import pytest


def train_bpe(path: Path, text: str, vocab_size: int, special_tokens: tuple = ()):
    """Train a byte-level BPE of ``vocab_size`` ids on ``text``'s lines, save it as ``path`` (a
    tokenizer.json) and return it; skips the test without the tokenizers package."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(keepends=True), tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=list(special_tokens),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok
