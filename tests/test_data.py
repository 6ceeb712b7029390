"""Token sources, the resumable batch order, the held-out split, and bad-input errors."""
import numpy as np
import pytest
import torch

from asyncpp_ext.data import (BUILTIN_MAX_BYTES, BatchStream, DataError, builtin_corpus,
                              eval_batches, load_tokens, min_tokens_needed, split_tokens)


def test_builtin_corpus_is_capped_utf8_text_and_deterministic():
    tokens = load_tokens("builtin")
    assert 100_000 < len(tokens) <= BUILTIN_MAX_BYTES
    assert b"def " in bytes(tokens[:100_000])
    builtin_corpus.cache_clear()
    assert np.array_equal(load_tokens("builtin"), tokens)


def test_text_file_bytes_are_tokens(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld\n", encoding="utf-8")
    assert bytes(load_tokens(str(path))) == "héllo wörld\n".encode("utf-8")


def test_bin_file_is_uint16_tokens_checked_against_vocab(tmp_path):
    path = tmp_path / "t.bin"
    ids = np.array([1, 255, 7, 0], dtype="<u2")
    ids.tofile(path)
    assert load_tokens(str(path)).tolist() == [1, 255, 7, 0]
    np.array([1, 300], dtype="<u2").tofile(path)
    with pytest.raises(DataError, match=r"t\.bin holds token id 300 .* vocab_size is 256"):
        load_tokens(str(path))
    assert load_tokens(str(path), vocab_size=301).tolist() == [1, 300]


@pytest.mark.parametrize("name, content, match", [
    ("missing.txt", None, "does not exist"),
    ("empty.txt", b"", "is empty"),
    ("latin1.txt", "caf\xe9".encode("latin-1") * 50, "not UTF-8"),
    ("odd.bin", b"\x01\x00\x02", "odd byte length"),
])
def test_bad_files_raise_data_error_naming_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        load_tokens(str(path))
    assert name in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_too_short_text_says_needed_and_present():
    tokens = np.zeros(100, dtype=np.uint8)
    needed = min_tokens_needed(8, 32, 0.1)
    with pytest.raises(DataError, match=f"has 100 tokens but one batch needs at least {needed}"):
        split_tokens(tokens, 0.1, micro_batch_size=8, seq_len=32)
    train, held = split_tokens(np.arange(needed) % 256, 0.1, 8, 32)
    assert len(train) >= 8 * 33 and len(held) >= 33


def test_split_keeps_the_last_tenth_for_eval():
    tokens = np.arange(10_000) % 256
    train, held = split_tokens(tokens, 0.1, 4, 16)
    assert len(held) == 1000 and np.array_equal(held, tokens[-1000:])
    assert np.array_equal(train, tokens[:9000])


def _stream(seed=0, tokens=None):
    tokens = np.arange(5000, dtype=np.int64) % 251 if tokens is None else tokens
    return BatchStream(tokens, microbatches=3, micro_batch_size=2, seq_len=8, seed=seed)


def test_minibatch_layout_and_shifted_targets():
    batch = _stream().next()
    assert len(batch) == 3
    for x, y in batch:
        assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_batch_order_is_seeded_and_resumes_exactly():
    a, b, other = _stream(seed=1), _stream(seed=1), _stream(seed=2)
    first = [a.next() for _ in range(4)]
    for batch in first:
        for (xa, ya), (xb, yb) in zip(batch, b.next()):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(first[0][0][0], other.next()[0][0])
    state = a.state_dict()
    assert state == {"seed": 1, "position": 4}
    resumed = _stream(seed=1)
    resumed.load_state_dict(state)
    for _ in range(3):
        for (xa, _), (xr, _) in zip(a.next(), resumed.next()):
            assert torch.equal(xa, xr)
    with pytest.raises(DataError, match="seed"):
        _stream(seed=9).load_state_dict(state)


def test_eval_batches_are_fixed_and_inside_the_eval_split():
    held = np.arange(1000, 2000, dtype=np.int64)
    one, two = eval_batches(held, 4, 16, 3), eval_batches(held, 4, 16, 3)
    assert len(one) == 3
    for (x1, y1), (x2, y2) in zip(one, two):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.min() >= 1000 and y1.max() < 2000
