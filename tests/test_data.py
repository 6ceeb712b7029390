"""Token sources (text, raw uint16 and sidecar-described .bin files), the resumable batch order,
the held-out split, and bad-input errors."""
import json

import numpy as np
import pytest
import torch

from asyncpp_ext.data import (BUILTIN_MAX_BYTES, DEFAULT_EVAL_BATCHES, BatchStream, DataError, builtin_corpus,
                              eval_batches, load_tokens, min_tokens_needed, scan_max_token_id,
                              sidecar_path, split_tokens, token_dtype_for_vocab, token_file_info,
                              token_fingerprint)


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
    tokens = load_tokens(str(path))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype("<u2")
    assert tokens.tolist() == [1, 255, 7, 0]
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


def _token_file(tmp_path, ids, storage, **header):
    """Write ``ids`` as numpy type ``storage`` to t.bin with a sidecar: defaults + ``header``."""
    path = tmp_path / "t.bin"
    np.asarray(ids, dtype=storage).tofile(path)
    fields = {"format": "asyncpp-tokens", "version": 1, "dtype": np.dtype(storage).name,
              "num_tokens": len(ids), "vocab_size": 70_000, "max_token_id": int(max(ids)),
              "tokenizer": "bytes"}
    fields.update(header)
    sidecar_path(path).write_text(json.dumps(fields))
    return path


def test_uint32_file_with_sidecar_is_memory_mapped(tmp_path):
    ids = [0, 69_999, 65_536, 5]
    path = _token_file(tmp_path, ids, "<u4")
    assert sidecar_path(path).name == "t.bin.json"
    tokens = load_tokens(str(path), vocab_size=70_000)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype("<u4")
    assert tokens.tolist() == ids
    assert token_file_info(path) == {"dtype": "uint32", "num_tokens": 4, "vocab_size": 70_000,
                                     "max_token_id": 69_999, "tokenizer": "bytes"}
    with pytest.raises(DataError, match=r"holds token id 69999 .* vocab_size is 65536; train with "
                                        r"--vocab-size 70000"):
        load_tokens(str(path), vocab_size=65_536)


def test_raw_file_info_scans_for_the_largest_id(tmp_path):
    path = tmp_path / "raw.bin"
    np.array([3, 9, 65_535, 2], dtype="<u2").tofile(path)
    assert token_file_info(path) == {"dtype": "uint16", "num_tokens": 4, "vocab_size": None,
                                     "max_token_id": 65_535, "tokenizer": None}


def test_id_check_trusts_the_sidecar_max_instead_of_reading_the_file(tmp_path):
    # The header claims a larger id than the file holds: the check must use the header.
    path = _token_file(tmp_path, [1, 2, 3], "<u2", max_token_id=300)
    with pytest.raises(DataError, match="holds token id 300"):
        load_tokens(str(path))
    # Without max_token_id the file is scanned.
    path = _token_file(tmp_path, [1, 2, 3], "<u2", max_token_id=None)
    assert load_tokens(str(path), vocab_size=4).tolist() == [1, 2, 3]
    with pytest.raises(DataError, match="holds token id 3 "):
        load_tokens(str(path), vocab_size=3)


def test_scan_max_token_id_reads_in_chunks_and_sees_every_chunk():
    tokens = np.array([5, 1, 2, 3, 4, 9, 0], dtype="<u2")
    for chunk in (1, 2, 3, 7, 100):
        assert scan_max_token_id(tokens, chunk=chunk) == 9  # the max sits in a later chunk


def test_token_dtype_follows_the_largest_id():
    assert token_dtype_for_vocab(256) == "uint16"
    assert token_dtype_for_vocab(65_536) == "uint16"  # ids 0..65535 fit in 16 bits
    assert token_dtype_for_vocab(65_537) == "uint32"
    with pytest.raises(DataError):
        token_dtype_for_vocab(0)


@pytest.mark.parametrize("case, match", [
    ("not_json", "is not readable JSON"),
    ("wrong_format", "has format 'nanogpt', not 'asyncpp-tokens'"),
    ("unknown_dtype", "unknown dtype 'int8'"),
    ("future_version", "has version 2"),
    ("bad_count", "num_tokens = -1, not a non-negative integer"),
    ("not_multiple", "byte length \\(6\\), not a multiple of 4"),
    ("count_disagrees", "says 3 uint32 tokens .* disagrees with its header"),
    ("dtype_disagrees", "has 16 bytes but .* says 4 uint16 tokens .* disagrees with its header"),
    ("empty", "is empty"),
])
def test_bad_token_files_raise_one_line_naming_the_file(tmp_path, case, match):
    if case == "dtype_disagrees":  # uint32 data described as uint16
        path = tmp_path / "t.bin"
        np.array([1, 2, 3, 4], dtype="<u4").tofile(path)
        sidecar_path(path).write_text(json.dumps({"format": "asyncpp-tokens", "version": 1,
                                                  "dtype": "uint16", "num_tokens": 4}))
    elif case == "not_multiple":
        path = _token_file(tmp_path, [1, 2], "<u4")
        path.write_bytes(path.read_bytes()[:6])
    elif case == "count_disagrees":
        path = _token_file(tmp_path, [1, 2], "<u4", num_tokens=3)
    elif case == "empty":
        path = tmp_path / "t.bin"
        path.write_bytes(b"")
    else:
        header = {"wrong_format": {"format": "nanogpt"}, "unknown_dtype": {"dtype": "int8"},
                  "future_version": {"version": 2}, "bad_count": {"num_tokens": -1}}.get(case, {})
        path = _token_file(tmp_path, [1, 2], "<u2", **header)
        if case == "not_json":
            sidecar_path(path).write_text("{not json")
    with pytest.raises(DataError, match=match) as info:
        load_tokens(str(path), vocab_size=70_000)
    message = str(info.value)
    assert "t.bin" in message and "\n" not in message
    if case != "empty":
        assert "asyncpp-prepare-data" in message  # the fix: regenerate with the tool


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
    assert state == {"seed": 1, "position": 4, "num_tokens": len(a.tokens), "shards": 1,
                     "fingerprint": token_fingerprint(a.tokens)}
    old_format = _stream(seed=1)  # a checkpoint that recorded seed and position only still resumes
    old_format.load_state_dict({"seed": 1, "position": 4})
    assert old_format.position == 4
    resumed = _stream(seed=1)
    resumed.load_state_dict(state)
    for _ in range(3):
        for (xa, _), (xr, _) in zip(a.next(), resumed.next()):
            assert torch.equal(xa, xr)
    with pytest.raises(DataError, match="seed"):
        _stream(seed=9).load_state_dict(state)


def test_a_resume_over_other_data_is_refused():
    # one array (a .bin file, a text, the builtin corpus): its length and a fingerprint of its
    # contents are recorded, so a file that grew or changed since is named, not silently trained on
    a = _stream(seed=1)
    a.next()
    state = a.state_dict()
    grown = BatchStream(np.concatenate([a.tokens, a.tokens[:100]]), a.microbatches, a.micro_batch_size,
                        a.seq_len, seed=1)
    with pytest.raises(DataError, match=r"ran over 5000 training tokens in 1 shard\(s\) but the data now "
                                        r"gives 5100 in 1; .*a file may have grown"):
        grown.load_state_dict(state)
    changed_tokens = a.tokens.copy()
    changed_tokens[2500] += 1  # one token in the middle: a piece the fingerprint reads (the array is small)
    changed = BatchStream(changed_tokens, a.microbatches, a.micro_batch_size, a.seq_len, seed=1)
    with pytest.raises(DataError, match=r"other training tokens than the data now gives \(the same 5000"):
        changed.load_state_dict(state)


def test_the_fingerprint_samples_large_arrays_evenly():
    big = np.zeros(2_000_000, dtype=np.uint16)  # 4 MB: 64 pieces of 16 KiB are read
    base = token_fingerprint(big)
    last = big.copy()
    last[-1] = 1  # the last piece ends at the array's end
    first = big.copy()
    first[0] = 1
    assert len({base, token_fingerprint(last), token_fingerprint(first)}) == 3
    assert token_fingerprint(big.astype(np.uint32)) != base  # the dtype counts


def test_eval_batches_are_fixed_and_inside_the_eval_split():
    held = np.arange(1000, 2000, dtype=np.int64)
    one, two = eval_batches(held, 4, 16, 3), eval_batches(held, 4, 16, 3)
    assert len(one) == 3
    for (x1, y1), (x2, y2) in zip(one, two):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.min() >= 1000 and y1.max() < 2000


def test_eval_batches_past_one_pass_over_the_split_are_refused():
    """More batches than the split's distinct windows fill would only repeat them (and a huge
    count would build gigabytes): refused with the largest count that fits; a split too small for
    the default count still gets it."""
    held = np.arange(100, dtype=np.int64)  # 100 - 17 + 1 = 84 distinct windows of 16 + 1
    assert len(eval_batches(held, 4, 16, 21)) == 21  # 84 windows: 21 batches of 4
    with pytest.raises(DataError, match="needs 88 windows but the eval split has 84 distinct ones; "
                                        "pass --eval-batches 21 or fewer"):
        eval_batches(held, 4, 16, 22)
    tiny = np.arange(20, dtype=np.int64)  # 4 windows: not one batch of 8
    assert len(eval_batches(tiny, 8, 16, DEFAULT_EVAL_BATCHES)) == DEFAULT_EVAL_BATCHES
    with pytest.raises(DataError, match=f"pass --eval-batches {DEFAULT_EVAL_BATCHES} or fewer"):
        eval_batches(tiny, 8, 16, DEFAULT_EVAL_BATCHES + 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"seq_len": 0}, "seq_len must be an integer >= 1, got 0"),
    ({"microbatches": 0}, "microbatches must be an integer >= 1, got 0"),
    ({"micro_batch_size": 2.0}, "micro_batch_size must be an integer >= 1, got 2.0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"position": -3}, "position must be an integer >= 0, got -3"),
    ({"tokens": np.zeros((4, 100), dtype=np.int64)}, "tokens must be a 1-D array of integer ids, got 2-D int64"),
    ({"tokens": np.zeros(400, dtype=np.float32)}, "tokens must be a 1-D array of integer ids, got 1-D float32"),
])
def test_batch_stream_names_a_bad_argument(kwargs, match):
    args = dict(tokens=np.arange(400) % 50, microbatches=2, micro_batch_size=2, seq_len=8)
    with pytest.raises(DataError, match=match):
        BatchStream(**{**args, **kwargs})


def test_load_tokens_takes_a_path_object_and_names_a_bad_source(tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n" * 10)
    assert load_tokens(tmp_path / "t.txt").tolist() == load_tokens(str(tmp_path / "t.txt")).tolist()
    with pytest.raises(TypeError, match="source must be a path .* got NoneType"):
        load_tokens(None)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 1, got -1"):
        load_tokens(str(tmp_path / "t.txt"), vocab_size=-1)
    stream = BatchStream(np.arange(400) % 50, 2, 2, 8)
    with pytest.raises(DataError, match="position None, not an integer >= 0"):
        stream.load_state_dict({"seed": 0})


@pytest.mark.parametrize("bad, kind", [(-1, ValueError), ("10", TypeError), (1.5, TypeError), (True, TypeError)])
def test_builtin_corpus_refuses_a_cap_that_is_not_a_count(bad, kind):
    """-1 sliced from the end (5217 bytes); "10" and 1.5 failed inside the slice."""
    with pytest.raises(kind, match=r"^max_bytes must be an integer >= 0 \(or None\), got "):
        builtin_corpus(bad)
    assert len(builtin_corpus(0)) == 0 and len(builtin_corpus(np.int64(7))) == 7


@pytest.mark.parametrize("vocab_size", [0, -1, "256", True, 2.5])
def test_batch_stream_refuses_a_vocab_size_that_is_no_count(vocab_size):
    with pytest.raises(DataError, match="BatchStream: vocab_size must be an integer >= 1 \\(or None\\), got "):
        BatchStream(np.arange(100, dtype=np.uint16), microbatches=1, micro_batch_size=1, seq_len=8,
                    vocab_size=vocab_size)


def test_ids_past_the_vocabulary_of_an_array_do_not_blame_a_sidecar():
    stream = BatchStream(np.full(100, 300, dtype=np.uint16), microbatches=1, micro_batch_size=1, seq_len=8,
                         vocab_size=256)
    with pytest.raises(DataError, match="^the data holds token id 300 >= vocab_size 256, outside the vocabulary; "
                                        "train with a vocabulary of at least 301"):
        stream.next()
