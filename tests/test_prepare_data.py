"""``asyncpp-prepare-data``: tokenized files round-trip to the text, the dtype follows the
vocabulary, sidecars describe their files, bad input exits 2 with one line and leaves no file, and a
prepared train/val pair trains through ``asyncpp-train``."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from asyncpp_ext.data import builtin_corpus, load_tokens, sidecar_path
from asyncpp_ext.data import documents, prepare as prep
from asyncpp_ext.data import text_pieces

tokenizers = pytest.importorskip("tokenizers")

BPE_VOCAB = 512


def _corpus_text(start: int, size: int) -> str:
    """``size`` bytes of the built-in corpus from ``start``, trimmed to whole lines."""
    raw = bytes(builtin_corpus()[start: start + size])
    return raw[raw.index(b"\n") + 1: raw.rindex(b"\n") + 1].decode("utf-8")


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A byte-level BPE (vocabulary 512) trained on ~200 KB of the built-in corpus, saved as
    tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_text(0, 200_000).splitlines(keepends=True), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _run(argv, capsys):
    """(exit status, stdout lines, stderr lines) of main(argv)."""
    rc = prep.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def _decode(tokenizer_path, *paths) -> str:
    from tokenizers import Tokenizer

    ids = np.concatenate([np.asarray(load_tokens(str(p), BPE_VOCAB)) for p in paths])
    return Tokenizer.from_file(str(tokenizer_path)).decode(ids.tolist())


def test_bpe_train_and_val_round_trip_with_sidecars(tmp_path, bpe_path, capsys):
    text = _corpus_text(1_000_000, 30_000) + "# ünïcødé ☃ 日本語\n"
    source = tmp_path / "in.txt"
    source.write_text(text, encoding="utf-8")
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    rc, out, err = _run(["--tokenizer", bpe_path, "--input", source, "--out", train,
                         "--val-fraction", "0.1", "--val-out", val], capsys)
    assert rc == 0 and err == [] and len(out) == 1  # stderr is no terminal: no progress bar
    assert "uint16" in out[0] and "vocabulary 512" in out[0]

    # One piece (the input is shorter than PIECE_CHARS): the ids are exactly the tokenizer's.
    expected = tokenizers.Tokenizer.from_file(str(bpe_path)).encode(
        text, add_special_tokens=False).ids
    train_ids, val_ids = load_tokens(str(train), BPE_VOCAB), load_tokens(str(val), BPE_VOCAB)
    assert isinstance(train_ids, np.memmap) and train_ids.dtype == np.dtype("<u2")
    assert train_ids.tolist() + val_ids.tolist() == expected
    assert len(val_ids) == int(len(expected) * 0.1)
    assert _decode(bpe_path, train, val) == text
    assert f"wrote {len(expected):,} tokens" in out[0]

    for path, ids in ((train, train_ids), (val, val_ids)):
        header = json.loads(sidecar_path(path).read_text())
        assert header == {"format": "asyncpp-tokens", "version": 1, "dtype": "uint16",
                          "num_tokens": len(ids), "vocab_size": BPE_VOCAB,
                          "max_token_id": int(ids.max()), "tokenizer": str(bpe_path.resolve()),
                          "tokenizer_sha256": _serialised_sha256(bpe_path)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.txt", "train.bin", "train.bin.json", "val.bin", "val.bin.json"]


def _serialised_sha256(tokenizer_path) -> str:
    import hashlib

    return hashlib.sha256(tokenizers.Tokenizer.from_file(str(tokenizer_path)).to_str().encode()).hexdigest()


def test_shards_and_validation_data_of_another_tokenizer_are_refused(tmp_path, bpe_path, capsys):
    """Token files of two tokenizers in one --data, or a --val-data of another tokenizer, would
    train or score ids that mean different things: one line naming both. The same tokenizer saved
    at another path is the same tokenizer."""
    from asyncpp_ext.data import DataError
    from asyncpp_ext.training.cli import main as train_main

    source = tmp_path / "in.txt"
    source.write_text(_corpus_text(0, 60_000), encoding="utf-8")
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(bpe_path.read_bytes())
    data = tmp_path / "data"
    data.mkdir()
    for tok, out in ((bpe_path, "a_1.bin"), (copy, "a_2.bin"), ("bytes", "b_1.bin")):
        assert prep.main(["--tokenizer", str(tok), "--input", str(source), "--out", str(data / out)]) == 0
    assert len(load_tokens(str(data / "a_*.bin"), BPE_VOCAB)) > 0  # one tokenizer, two paths
    with pytest.raises(DataError, match=r"mixes token files of different tokenizers: a_1.bin \(tokenizer "
                                        r".*tokenizer.json \(vocabulary 512\)\) and b_1.bin \(UTF-8 bytes\)"):
        load_tokens(str(data), BPE_VOCAB)
    # another tokenizer of the same vocabulary size: told apart by its serialised form
    other = json.loads(bpe_path.read_text())
    other["model"]["vocab"] = {tok: (i + 1) % len(other["model"]["vocab"])
                               for tok, i in other["model"]["vocab"].items()}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert prep.main(["--tokenizer", str(tmp_path / "other.json"), "--input", str(source),
                      "--out", str(data / "a_3.bin")]) == 0
    with pytest.raises(DataError, match="a_1.bin .* and a_3.bin .*other.json"):
        load_tokens(str(data / "a_*.bin"), BPE_VOCAB)
    capsys.readouterr()
    run = tmp_path / "run"
    flags = ["--vocab-size", str(BPE_VOCAB), "--seq-len", "16", "--steps", "1", "--no-progress", "--simulate",
             "--no-compile", "--out", str(run)]
    assert train_main(["--data", str(data / "a_1.bin"), "--val-data", str(source)] + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--val-data {source} holds ids of UTF-8 bytes but --data" in err[0], err
    assert not run.exists()
    assert train_main(["--data", str(data / "a_1.bin"), "--val-data", str(data / "a_2.bin")] + flags) == 0


def test_long_input_is_read_in_pieces_that_rejoin_exactly(tmp_path, bpe_path, monkeypatch, capsys):
    # Tiny blocks and pieces: multi-byte characters straddle blocks, lines straddle pieces, and
    # one line is longer than MAX_CARRY_CHARS (cut at a space) or has no space at all.
    monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", 7)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 50)
    monkeypatch.setattr(text_pieces, "MAX_CARRY_CHARS", 200)
    text = ("ünï ☃ 日本語 line\n" * 40 + "word " * 120 + "\n" + "x" * 450 + "\n"
            + _corpus_text(2_000_000, 3_000) + "tail without newline ☃")
    source = tmp_path / "long.txt"
    source.write_text(text, encoding="utf-8")
    seen = []
    pieces = list(prep.read_pieces(source, seen.append))
    assert "".join(pieces) == text and sum(seen) == len(text.encode("utf-8"))
    assert max(map(len, pieces)) <= 200 and len(pieces) > 20
    assert sum(p.endswith("\n") for p in pieces) >= len(pieces) - 10  # mostly cut at line ends

    rc, _, _ = _run(["--tokenizer", bpe_path, "--input", source, "--out", tmp_path / "t.bin"],
                    capsys)
    assert rc == 0 and _decode(bpe_path, tmp_path / "t.bin") == text
    rc, _, _ = _run(["--tokenizer", "bytes", "--input", source, "--out", tmp_path / "b.bin"],
                    capsys)
    assert rc == 0 and bytes(load_tokens(str(tmp_path / "b.bin")).astype(np.uint8)) == \
        text.encode("utf-8")


def test_bytes_tokenizer_concatenates_inputs_and_names_val_after_out(tmp_path, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("héllo\n", encoding="utf-8")
    second.write_text("wörld " * 20, encoding="utf-8")
    out = tmp_path / "data.bin"
    rc, lines, _ = _run(["--tokenizer", "bytes", "--input", first, second, "--out", out,
                         "--val-fraction", "0.25"], capsys)
    assert rc == 0 and "2 input file(s)" in lines[0]
    val = tmp_path / "data.val.bin"
    joined = np.concatenate([load_tokens(str(out)), load_tokens(str(val))])
    assert bytes(joined.astype(np.uint8)) == ("héllo\n" + "wörld " * 20).encode("utf-8")
    assert len(load_tokens(str(val))) == int(len(joined) * 0.25)
    header = json.loads(sidecar_path(val).read_text())
    assert (header["tokenizer"], header["vocab_size"], header["dtype"]) == ("bytes", 256, "uint16")


@pytest.mark.parametrize("block", [1, 2, 1 << 20])  # the mark split across reads, or not
def test_a_byte_order_mark_at_the_start_of_a_file_is_not_a_token(tmp_path, capsys, monkeypatch, block):
    """Editors on Windows start UTF-8 files with EF BB BF; it is not text. Further in, the same
    character (a zero-width no-break space) is text and stays."""
    monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", block)
    text = "hello\nworld \ufeff!\n"
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": text}).encode() + b"\n")
    for name in ("a.txt", "b.jsonl"):
        out = tmp_path / (name + ".bin")
        rc, _, err = _run(["--tokenizer", "bytes", "--input", tmp_path / name, "--out", out,
                           "--doc-boundary", "none"], capsys)
        assert rc == 0, err
        assert bytes(load_tokens(str(out)).astype(np.uint8)) == text.encode("utf-8"), name
    # Byte offsets in a refusal still count the mark: the NUL is byte 3 + 6 of the file.
    (tmp_path / "nul.txt").write_bytes(b"\xef\xbb\xbfhello\n\0")
    rc, _, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "nul.txt", "--out", tmp_path / "n.bin"],
                      capsys)
    assert rc == 2 and len(err) == 1 and "(byte 9)" in err[0]


@pytest.mark.parametrize("flag, separator", [("\\x1e", "\x1e"), ("\\u2029", "\u2029"), ("<\\\\s>", "<\\s>")])
def test_separator_escapes_name_any_character(tmp_path, capsys, flag, separator):
    (tmp_path / "a.txt").write_text(separator.join(["one", "two", "three"]), encoding="utf-8")
    rc, lines, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "a.txt", "--out", tmp_path / "a.bin",
                           "--doc-separator", flag], capsys)
    assert rc == 0, err  # the separators are cut out: three documents, no boundary token (bytes)
    assert bytes(load_tokens(str(tmp_path / "a.bin")).astype(np.uint8)) == b"onetwothree"


def test_vocabulary_above_16_bits_writes_uint32(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A word-level vocabulary of 70,000 entries costs milliseconds and needs 17-bit ids.
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("w69999 w3 w65536\nw70 w65535\n")
    rc, lines, _ = _run(["--tokenizer", tmp_path / "big.json", "--input", tmp_path / "in.txt",
                         "--out", tmp_path / "t.bin"], capsys)
    assert rc == 0 and "uint32" in lines[0]
    ids = load_tokens(str(tmp_path / "t.bin"), vocab_size=70_000)
    assert ids.dtype == np.dtype("<u4") and ids.tolist() == [69_999, 3, 65_536, 70, 65_535]
    header = json.loads(sidecar_path(tmp_path / "t.bin").read_text())
    assert (header["dtype"], header["vocab_size"], header["max_token_id"]) == ("uint32", 70_000, 69_999)
    assert (tmp_path / "t.bin").stat().st_size == 5 * 4


def _error_case(tmp_path, case, bpe_path, monkeypatch):
    """argv for a bad-input case; files it needs are created in tmp_path."""
    good = tmp_path / "good.txt"
    good.write_text("some text\n" * 100)
    out = tmp_path / "out.bin"
    base = ["--tokenizer", "bytes", "--input", good, "--out", out]
    if case == "missing tokenizer":
        return ["--tokenizer", tmp_path / "nope.json", "--input", good, "--out", out]
    if case == "tokenizers not installed":
        monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
        return ["--tokenizer", bpe_path, "--input", good, "--out", out]
    if case == "not a tokenizer":
        (tmp_path / "bad.json").write_text('{"hello": 1}')
        return ["--tokenizer", tmp_path / "bad.json", "--input", good, "--out", out]
    if case == "missing input":
        return base[:3] + [good, tmp_path / "gone.txt"] + base[4:]
    if case == "a folder without tokenizer.json":
        (tmp_path / "tok").mkdir()
        return ["--tokenizer", tmp_path / "tok", "--input", good, "--out", out]
    if case == "the tokenizer's settings":
        (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 2048, "bos_token": null}')
        return ["--tokenizer", tmp_path / "tokenizer_config.json", "--input", good, "--out", out]
    if case == "a JSON array of records":
        (tmp_path / "records.json").write_text('[\n  {"text": "one"},\n  {"text": "two"}\n]\n')
        return base[:3] + [tmp_path / "records.json"] + base[4:] + ["--skip-bad-records"]
    if case == "a pretty-printed object":
        (tmp_path / "record.json").write_text('{\n  "text": "one"\n}\n')
        return base[:3] + [tmp_path / "record.json"] + base[4:]
    if case == "an input named twice":
        return base[:3] + [good, tmp_path / "*.txt"] + base[4:]
    if case == "an xz file":
        (tmp_path / "corpus.txt.xz").write_bytes(b"\xfd7zXZ\x00\x00")
        return base[:3] + [tmp_path / "corpus.txt.xz"] + base[4:]
    if case == "a pipe":
        os.mkfifo(tmp_path / "fifo")
        return base[:3] + [tmp_path / "fifo"] + base[4:]
    if case == "a token file":
        (tmp_path / "tokens.bin").write_bytes(b"\x00" * 16)
        return base[:3] + [tmp_path / "tokens.bin"] + base[4:]
    if case == "input is a directory":
        (tmp_path / "dir").mkdir()
        return base[:3] + [tmp_path / "dir"] + base[4:]
    if case == "non-UTF-8 after good text":
        # Blocks of good text are tokenized and written before the bad byte is met.
        monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", 64)
        (tmp_path / "latin1.txt").write_bytes(b"abc\n" * 100 + "caf\xe9\n".encode("latin-1"))
        return base[:3] + [good, tmp_path / "latin1.txt"] + base[4:]
    if case in ("character split across blocks", "truncated character at the end"):
        # The reported offset counts the bytes the decoder held back from the previous block.
        monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", 7)
        bad = b"abcdef\xe2\x82X\n" if case.startswith("character") else b"abcdefghij\xe2\x82"
        (tmp_path / "split.txt").write_bytes(bad)
        return base[:3] + [tmp_path / "split.txt"] + base[4:]
    if case == "UTF-16 text after good blocks":
        # Valid UTF-8 byte for byte (no BOM), but every other byte is a NUL.
        monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", 64)
        (tmp_path / "utf16.txt").write_bytes(b"abc\n" * 100 + "plain ASCII\n".encode("utf-16-le"))
        return base[:3] + [tmp_path / "utf16.txt"] + base[4:]
    if case == "val fraction 1":
        return base + ["--val-fraction", "1"]
    if case == "val fraction negative":
        return base + ["--val-fraction", "-0.1"]
    if case == "val-out without fraction":
        return base + ["--val-out", tmp_path / "v.bin"]
    if case == "out not .bin":
        return base[:-1] + [tmp_path / "out.txt"]
    if case == "out under a file":
        (tmp_path / "a_file").write_text("x")
        return base[:-1] + [tmp_path / "a_file" / "sub" / "out.bin"]
    if case == "empty result":
        (tmp_path / "empty.txt").write_text("")
        return base[:3] + [tmp_path / "empty.txt"] + base[4:]
    if case == "empty validation file":
        return base + ["--val-fraction", "0.0001"]
    if case == "val-out is the out file":
        return base + ["--val-fraction", "0.1", "--val-out", base[-1]]
    if case == "shard tokens 0":
        return base + ["--shard-tokens", "0"]
    if case == "unknown flag":
        return base + ["--no-such-flag"]
    if case == "workers 0":
        return base + ["--workers", "0"]
    if case == "workers far above the cores":
        return base + ["--workers", str(4 * len(os.sched_getaffinity(0)) + 1)]
    if case == "empty separator":
        return base + ["--doc-separator", ""]
    if case == "separator for JSON lines only":
        (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
        return base[:3] + [tmp_path / "a.jsonl"] + base[4:] + ["--doc-separator", "\\n\\n"]
    if case == "text field for text files only":
        return base + ["--text-field", "body"]
    if case.startswith("separator "):
        return base + ["--doc-separator", case.split(" ", 1)[1]]
    raise AssertionError(case)


@pytest.mark.parametrize("case, match", [
    ("missing tokenizer", "tokenizer file .*nope.json does not exist"),
    ("tokenizers not installed", r"pip install 'asyncpp_ext\[hf\]'"),
    ("not a tokenizer", "bad.json is not a tokenizers tokenizer.json"),
    ("missing input", "input .*gone.txt does not exist"),
    ("a folder without tokenizer.json", "tokenizer .*tok is a directory without a tokenizer.json; pass the "
                                        "tokenizer.json file"),
    ("the tokenizer's settings", "tokenizer_config.json is a tokenizer's settings, not the tokenizer; pass the "
                                 "tokenizer.json beside it"),
    ("a JSON array of records", "records.json is one JSON document, not JSON lines .*jq -c '.\\[\\]' "),
    ("a pretty-printed object", "record.json is one JSON document, not JSON lines .*jq -c \\. "),
    ("an input named twice", "good.txt is named twice \\(by .*good.txt and by .*\\*.txt\\); name each file once"),
    ("an xz file", "corpus.txt.xz is xz, which is not read; unpack or decompress it"),
    ("a pipe", "fifo is not a regular file \\(pipes, devices and standard input are not read\\)"),
    ("a token file", "tokens.bin is a token file \\(.bin\\), not text"),
    # Directories are inputs (their data files, sorted); one without any is refused.
    ("input is a directory", "input .*dir is a directory with no input files"),
    ("non-UTF-8 after good text", "latin1.txt is not UTF-8 text \\(byte 403\\)"),
    ("character split across blocks", "split.txt is not UTF-8 text \\(byte 6\\)"),
    ("truncated character at the end", "split.txt is not UTF-8 text \\(byte 10\\)"),
    ("UTF-16 text after good blocks", "utf16.txt is not UTF-8 text: it holds a NUL byte \\(byte 401\\), as "
                                      "UTF-16 and binary files do"),
    ("val fraction 1", "--val-fraction 1.0 is outside \\[0, 1\\)"),
    ("val fraction negative", "--val-fraction -0.1 is outside"),
    ("val-out without fraction", "--val-out needs --val-fraction > 0"),
    ("out not .bin", "out.txt does not end in .bin"),
    ("out under a file", "--out .*out.bin: .*a_file is not a writable directory; choose another place"),
    ("empty result", "gave no tokens"),
    ("empty validation file", "leaves the validation file empty"),
    ("val-out is the out file", "--val-out .*out.bin is the --out file"),
    ("shard tokens 0", "argument --shard-tokens: '0' is not a positive whole number of tokens"),
    ("unknown flag", "unrecognized arguments: --no-such-flag"),
    ("workers 0", "--workers 0 is not positive"),
    ("workers far above the cores", "--workers \\d+ is more than 4 per core for the \\d+ core\\(s\\) here; "
                                    "use at most \\d+"),
    ("empty separator", "--doc-separator is empty"),
    # A separator that can never match would leave each file one document, without a word.
    ("separator \\x1", r"--doc-separator '\\\\x1': unknown escape '\\x'; use \\n \\t \\r \\xHH \\uHHHH"),
    ("separator a\\sb", r"--doc-separator 'a\\\\sb': unknown escape '\\s'"),
    ("separator end\\", r"--doc-separator 'end\\\\': a lone '\\' at the end"),
    ("separator \\u0000", r"--doc-separator '\\\\u0000' holds a NUL, which text files never do"),
    ("separator \\uD800", r"--doc-separator '\\\\uD800' holds a lone surrogate, which UTF-8 text never does"),
    ("separator for JSON lines only", "--doc-separator splits text files, and no input is one"),
    ("text field for text files only", "--text-field body names a JSON field or column, and every input is a "
                                       "text file; drop it"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, bpe_path, monkeypatch, capsys,
                                                            case, match):
    argv = _error_case(tmp_path, case, bpe_path, monkeypatch)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == [] and len(err) == 1, err
    assert err[0].startswith("asyncpp-prepare-data: error: ")
    assert re.search(match, err[0]), err[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no output, no temporary


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may write into any directory")
def test_unwritable_directory_is_refused(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("text\n")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    rc, _, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "in.txt",
                       "--out", locked / "t.bin"], capsys)
    assert rc == 2 and "is not writable" in err[0] and list(locked.iterdir()) == []


def test_missing_output_directories_are_created_and_removed_again_when_it_fails(tmp_path, capsys):
    """``--out data/train.bin`` in a fresh checkout: the directories are made, as asyncpp-train
    makes its --out; a preparation that fails leaves none of them behind."""
    (tmp_path / "in.txt").write_text("text\n" * 10)
    (tmp_path / "empty.txt").write_text("")
    rc, _, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "empty.txt",
                       "--out", tmp_path / "new" / "deeper" / "t.bin", "--val-fraction", "0.5",
                       "--val-out", tmp_path / "other" / "v.bin"], capsys)
    assert rc == 2 and "gave no tokens" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "in.txt"]
    rc, out, _ = _run(["--tokenizer", "bytes", "--input", tmp_path / "in.txt",
                       "--out", tmp_path / "new" / "deeper" / "t.bin", "--val-fraction", "0.5",
                       "--val-out", tmp_path / "other" / "v.bin"], capsys)
    assert rc == 0 and "wrote 50 tokens" in out[0]
    assert (tmp_path / "new" / "deeper" / "t.bin").is_file() and (tmp_path / "other" / "v.bin").is_file()


def test_ctrl_c_midway_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", 32)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 16)
    monkeypatch.setattr(documents, "PIECES_PER_BATCH", 1)
    calls = []

    def encode_then_interrupt(self, pieces):
        calls.append(pieces)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return [np.frombuffer(p.encode(), dtype=np.uint8) for p in pieces]

    monkeypatch.setattr(prep.ByteTokenizer, "encode", encode_then_interrupt)
    (tmp_path / "in.txt").write_text("a line of text\n" * 50)
    rc, out, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "in.txt",
                         "--out", tmp_path / "new" / "t.bin", "--val-fraction", "0.1"], capsys)
    assert rc == 130 and len(calls) == 5 and err == ["asyncpp-prepare-data: interrupted; no file written"]
    assert [p.name for p in tmp_path.iterdir()] == ["in.txt"]


def test_progress_bar_goes_to_stderr_when_asked(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("text\n" * 10)
    prep.prepare("bytes", [str(tmp_path / "in.txt")], str(tmp_path / "t.bin"), progress=True)
    err = capsys.readouterr().err
    assert "tokenize: 100%" in err and "50.0/50.0" in err  # bytes read of the 50-byte input


def test_module_help_runs():
    done = subprocess.run([sys.executable, "-m", "asyncpp_ext.data.prepare", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--val-fraction" in done.stdout and "--tokenizer" in done.stdout


def test_prepared_bpe_data_trains_and_eval_loss_falls(tmp_path, bpe_path, capsys, one_intra_op_thread):
    from asyncpp_ext.training.cli import main as train_main
    from asyncpp_ext.training.run_files import read_metrics

    source = tmp_path / "in.txt"
    source.write_text(_corpus_text(0, 400_000), encoding="utf-8")
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    assert prep.main(["--tokenizer", str(bpe_path), "--input", str(source), "--out", str(train),
                      "--val-fraction", "0.1", "--val-out", str(val)]) == 0
    run_dir = tmp_path / "run"
    rc = train_main(["--data", str(train), "--val-data", str(val), "--vocab-size", str(BPE_VOCAB),
                   "--steps", "30", "--eval-every", "10", "--no-progress", "--out", str(run_dir)])
    assert rc == 0
    evals = {row["step"]: row["eval_loss"] for row in read_metrics(run_dir) if "eval_loss" in row}
    assert set(evals) >= {10, 30}
    assert evals[30] < evals[10] and evals[30] < math.log(BPE_VOCAB)


def test_the_python_api_checks_the_shard_size_too(tmp_path):
    (tmp_path / "in.txt").write_text("text\n" * 10)
    with pytest.raises(prep.PrepareError, match="--shard-tokens 0 is not positive"):
        prep.prepare("bytes", [str(tmp_path / "in.txt")], str(tmp_path / "out.bin"), shard_tokens=0)
    assert list(tmp_path.iterdir()) == [tmp_path / "in.txt"]


def test_a_path_this_user_may_not_read_is_one_line(tmp_path, capsys, monkeypatch):
    """Python raises PermissionError from Path.is_file()/is_dir() on an unreadable directory, before
    any file is opened: one line naming the path, exit 2 (root cannot be denied, so it is raised here)."""
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/locked/a.txt")

    monkeypatch.setattr(prep, "prepare", denied)
    assert prep.main(["--tokenizer", "bytes", "--input", "/data/locked/a.txt", "--out", str(tmp_path / "o.bin")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncpp-prepare-data: error: cannot use /data/locked/a.txt "
                                                   "(Permission denied)"), err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_holding_tokenizer_json_is_its_tokenizer(tmp_path, bpe_path, capsys):
    """What `hf download ... tokenizer.json --local-dir tok` leaves: --tokenizer tok reads tok/tokenizer.json."""
    import shutil

    (tmp_path / "tok").mkdir()
    shutil.copy(bpe_path, tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "in.txt").write_text("the same text twice\n")
    outputs = {}
    for name, tokenizer in (("folder", tmp_path / "tok"), ("file", bpe_path)):
        assert _run(["--tokenizer", tokenizer, "--input", tmp_path / "in.txt", "--out", tmp_path / f"{name}.bin"],
                    capsys)[0] == 0
        outputs[name] = (tmp_path / f"{name}.bin").read_bytes()
    assert outputs["folder"] == outputs["file"]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_lone_surrogate_is_named_as_such(tmp_path, bpe_path, capsys, tokenizer):
    """A JSON escape \\ud800 without its partner decodes to a string no encoder takes; the line says
    so instead of quoting the tokenizer's type error."""
    (tmp_path / "s.jsonl").write_text('{"text": "a \\ud800 b"}\n{"text": "fine"}\n')
    rc, _, err = _run(["--tokenizer", bpe_path if tokenizer == "bpe" else "bytes", "--input", tmp_path / "s.jsonl",
                       "--out", tmp_path / "o.bin"], capsys)
    assert rc == 2 and err == [f"asyncpp-prepare-data: error: input {tmp_path / 's.jsonl'} line 1 holds a lone "
                               "surrogate (\\ud800 at character 2), which is not valid Unicode; fix or delete it, "
                               "or pass --skip-bad-records to skip such records"]
