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


def bpe_llama_run(root: Path, corpus_bytes: int, vocab_size: int, model_vocab: int):
    """Under ``root``: a BPE of ``vocab_size`` ids whose documents end in <|endoftext|>, trained on
    the first ``corpus_bytes`` of the built-in corpus (tokenizer.json, corpus.txt), that text
    prepared into data/c.bin, and a llama-tiny run of 2 steps on it embedding ``model_vocab`` ids
    (run/); returns the tokenizer."""
    from asyncpp_ext.data import builtin_corpus
    from asyncpp_ext.data import prepare as prep
    from asyncpp_ext.training.cli import main as train

    text = bytes(builtin_corpus()[:corpus_bytes]).decode("utf-8", "ignore")
    tok = train_bpe(root / "tokenizer.json", text, vocab_size, special_tokens=("<|endoftext|>",))
    (root / "corpus.txt").write_text(text)
    assert prep.main(["--tokenizer", str(root / "tokenizer.json"), "--input", str(root / "corpus.txt"),
                      "--out", str(root / "data" / "c.bin")]) == 0
    assert train(["--model", "llama-tiny", "--vocab-size", str(model_vocab), "--data", str(root / "data" / "c.bin"),
                  "--simulate", "--steps", "2", "--no-progress", "--eval-batches", "0",
                  "--out", str(root / "run")]) == 0
    return tok
