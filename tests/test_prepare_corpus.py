"""``asyncpp-prepare-data`` on corpora as people have them: JSON lines (plain, gzip, zstd), Parquet
and save_to_disk inputs, directories and globs; documents each followed by one end-of-text token
(or preceded by BOS); shards + manifest; the same bytes for 1 and 2 workers; a validation split by
whole documents; bad records named by file and line, exit 2 and no file left, or skipped and counted."""
import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from asyncpp_ext.data import builtin_corpus, load_tokens, sidecar_path
from asyncpp_ext.data import prepare as prep
from asyncpp_ext.data import text_pieces
from asyncpp_ext.data.encode import Task, ordered_encode

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 512
EOT = "<|endoftext|>"


def _docs(count: int, start: int = 500_000) -> list:
    """``count`` documents of 1-12 lines of the built-in corpus, one empty, one with non-ASCII."""
    lines = bytes(builtin_corpus()[start: start + 120_000]).decode("utf-8", "ignore").splitlines(True)[1:]
    docs, at = [], 0
    for k in range(count):
        n = 1 + (k * 7) % 12
        docs.append("".join(lines[at: at + n]))
        at += n
    docs[3] = ""  # an empty document: skipped and counted
    docs[5] = "ünïcødé ☃ 日本語\n" + docs[5]
    return docs


def _train_bpe(path, special, template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = bytes(builtin_corpus()[:150_000]).decode("utf-8", "ignore")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{template} $A", special_tokens=[(template, tok.token_to_id(template))])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def eot_tok(tmp_path_factory):
    """A byte-level BPE with <|endoftext|> (GPT-2 style: auto -> eos)."""
    return _train_bpe(tmp_path_factory.mktemp("tok") / "eot.json", [EOT])


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory):
    """A byte-level BPE whose template puts <s> before every text (Llama style: auto -> bos)."""
    return _train_bpe(tmp_path_factory.mktemp("tok") / "bos.json", ["<s>", "</s>"], template="<s>")


def _encode(tok_path, text):
    return tokenizers.Tokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids


def _expected(tok_path, docs, boundary=EOT, where="after"):
    marker = tokenizers.Tokenizer.from_file(str(tok_path)).token_to_id(boundary)
    ids = []
    for doc in docs:
        tokens = _encode(tok_path, doc)
        if tokens:
            ids += ([marker] + tokens) if where == "before" else (tokens + [marker])
    return ids


def _run(argv, capsys):
    rc = prep.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def _jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}) + "\n")
    return path


def test_jsonl_and_gzip_documents_each_followed_by_one_end_of_text(tmp_path, eot_tok, capsys):
    docs = _docs(40)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "part-01.jsonl", docs[:25])
    _jsonl(corpus / "part-02.jsonl.gz", docs[25:], opener=gzip.open)
    (corpus / "README.md").write_text("not data")  # ignored: not a data suffix
    (corpus / ".cache").mkdir()
    _jsonl(corpus / ".cache" / "x.jsonl", ["hidden"])  # hidden: skipped
    out = tmp_path / "train.bin"
    rc, lines, err = _run(["--tokenizer", eot_tok, "--input", corpus, "--out", out, "--workers", "1"],
                          capsys)
    assert rc == 0 and err == [] and len(lines) == 1, err
    assert load_tokens(str(out), VOCAB).tolist() == _expected(eot_tok, docs)
    assert "from 2 input file(s)" in lines[0] and "39 documents, <|endoftext|> (id 0) after each" in lines[0]
    assert "1 empty document(s) skipped" in lines[0]
    header = json.loads(sidecar_path(out).read_text())
    assert header["doc_boundary"] == "eos" and header["boundary_token_id"] == 0
    assert header["num_documents"] == 39 and header["num_tokens"] == len(_expected(eot_tok, docs))
    # The glob of the same files (and a second pass through the gzip) gives the same bytes.
    rc, _, _ = _run(["--tokenizer", eot_tok, "--input", corpus / "part-0*", "--out",
                     tmp_path / "glob.bin"], capsys)
    assert rc == 0 and (tmp_path / "glob.bin").read_bytes() == out.read_bytes()


def test_zstd_jsonl_with_another_text_field(tmp_path, eot_tok, capsys):
    zstandard = pytest.importorskip("zstandard")
    docs = _docs(12)
    raw = "".join(json.dumps({"content": d}) + "\n" for d in docs).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    rc, lines, err = _run(["--tokenizer", eot_tok, "--input", tmp_path / "a.jsonl.zst", "--out",
                           tmp_path / "t.bin", "--text-field", "content"], capsys)
    assert rc == 0, err
    assert load_tokens(str(tmp_path / "t.bin"), VOCAB).tolist() == _expected(eot_tok, docs)


def test_parquet_and_save_to_disk_inputs(tmp_path, eot_tok, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _docs(30)
    folder = tmp_path / "fineweb"
    folder.mkdir()
    for i, part in enumerate((docs[:10], docs[10:20])):  # two row groups in the first file
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}),
                       folder / f"{i:03d}_00000.parquet", row_group_size=4)
    saved = tmp_path / "saved"
    try:
        import datasets
    except ImportError:  # the layout save_to_disk writes: an Arrow stream + state.json
        saved.mkdir()
        table = pa.table({"text": docs[20:]})
        with pa.ipc.new_stream(str(saved / "data-00000-of-00001.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
        (saved / "dataset_info.json").write_text("{}")
        (saved / "state.json").write_text(json.dumps(
            {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}))
    else:
        datasets.Dataset.from_dict({"text": docs[20:]}).save_to_disk(str(saved))
    rc, lines, err = _run(["--tokenizer", eot_tok, "--input", folder, saved, "--out",
                           tmp_path / "t.bin"], capsys)
    assert rc == 0, err
    assert "from 3 input file(s)" in lines[0]
    assert load_tokens(str(tmp_path / "t.bin"), VOCAB).tolist() == _expected(eot_tok, docs)


def _corpus_dir(tmp_path, n_docs=120):
    docs = _docs(n_docs, start=900_000)
    corpus = tmp_path / "in"
    corpus.mkdir()
    for i in range(4):
        _jsonl(corpus / f"{i}.jsonl", docs[i * n_docs // 4: (i + 1) * n_docs // 4])
    return docs, corpus


def test_one_and_two_workers_write_identical_shards_and_manifest(tmp_path, eot_tok, capsys, monkeypatch):
    from asyncpp_ext.data import inputs as inp

    monkeypatch.setattr(inp, "TASK_BYTES", 2_000)  # many small tasks: ordering is exercised
    docs, corpus = _corpus_dir(tmp_path)
    outputs = {}
    for workers in (1, 2):
        out_dir = tmp_path / f"w{workers}"
        out_dir.mkdir()
        rc, lines, err = _run(["--tokenizer", eot_tok, "--input", corpus, "--out", out_dir / "fw.bin",
                               "--shard-tokens", "1000", "--val-fraction", "0.1", "--workers",
                               str(workers)], capsys)
        assert rc == 0, err
        outputs[workers] = {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}
    assert outputs[1] == outputs[2]
    names = sorted(outputs[1])
    shards = [n for n in names if re.fullmatch(r"fw_\d{6}\.bin", n)]
    assert len(shards) >= 3 and "fw.manifest.json" in names and "fw.val.manifest.json" in names
    manifest = json.loads(outputs[1]["fw.manifest.json"])
    assert [s["file"] for s in manifest["shards"]] == shards
    assert all(s["num_tokens"] == 1000 for s in manifest["shards"][:-1])
    assert manifest["num_tokens"] == sum(s["num_tokens"] for s in manifest["shards"])
    assert manifest["doc_boundary"] == "eos" and manifest["num_documents"] > 0
    # Read back: the manifest, a glob and the directory of train shards give the same tokens.
    base = tmp_path / "w1"
    joined = load_tokens(str(base / "fw.manifest.json"), VOCAB)
    assert np.array_equal(np.asarray(load_tokens(str(base / "fw_*.bin"), VOCAB)), np.asarray(joined))
    val = np.asarray(load_tokens(str(base / "fw.val.manifest.json"), VOCAB))
    _check_split(eot_tok, docs, np.asarray(joined).tolist(), val.tolist(), 0.1)


def _split_docs(ids, marker=0):
    """Token lists of the documents in an eos-marked stream."""
    docs, current = [], []
    for t in ids:
        if t == marker:
            docs.append(current)
            current = []
        else:
            current.append(t)
    assert current == []  # every document ends with the marker
    return docs


def _check_split(tok, docs, train_ids, val_ids, fraction):
    encoded = [_encode(tok, d) for d in docs]
    nonempty = [e for e in encoded if e]
    train_docs, val_docs = _split_docs(train_ids), _split_docs(val_ids)
    # Every document whole, in one of the two files, in order; F of the documents in val.
    expected_val = [e for k, e in enumerate(encoded)
                    if e and int((k + 1) * fraction) > int(k * fraction)]
    assert val_docs == expected_val
    assert sorted(map(tuple, train_docs + val_docs)) == sorted(map(tuple, nonempty))
    assert len(val_docs) == int(len(docs) * fraction) - (1 if not encoded[9] else 0)


def test_validation_split_takes_whole_documents(tmp_path, eot_tok, capsys):
    docs, corpus = _corpus_dir(tmp_path, 60)
    rc, lines, err = _run(["--tokenizer", eot_tok, "--input", corpus, "--out", tmp_path / "t.bin",
                           "--val-fraction", "0.2"], capsys)
    assert rc == 0, err
    train, val = load_tokens(str(tmp_path / "t.bin"), VOCAB), load_tokens(str(tmp_path / "t.val.bin"), VOCAB)
    _check_split(eot_tok, docs, train.tolist(), val.tolist(), 0.2)
    assert json.loads(sidecar_path(tmp_path / "t.val.bin").read_text())["num_documents"] == 12


def test_bos_tokenizer_marks_the_start_and_none_keeps_the_old_stream(tmp_path, bos_tok, eot_tok, capsys):
    docs = _docs(10)
    _jsonl(tmp_path / "d.jsonl", docs)
    rc, lines, _ = _run(["--tokenizer", bos_tok, "--input", tmp_path / "d.jsonl", "--out",
                         tmp_path / "b.bin"], capsys)
    assert rc == 0 and "<s> (id 0) before each" in lines[0]
    assert load_tokens(str(tmp_path / "b.bin"), VOCAB).tolist() == _expected(bos_tok, docs, "<s>", "before")
    rc, _, _ = _run(["--tokenizer", bos_tok, "--input", tmp_path / "d.jsonl", "--out",
                     tmp_path / "e.bin", "--doc-boundary", "eos", "--boundary-token", "</s>"], capsys)
    assert rc == 0
    assert load_tokens(str(tmp_path / "e.bin"), VOCAB).tolist() == _expected(bos_tok, docs, "</s>")
    rc, _, _ = _run(["--tokenizer", eot_tok, "--input", tmp_path / "d.jsonl", "--out",
                     tmp_path / "n.bin", "--doc-boundary", "none"], capsys)
    assert rc == 0
    assert load_tokens(str(tmp_path / "n.bin"), VOCAB).tolist() == [
        t for d in docs for t in _encode(eot_tok, d)]
    assert "doc_boundary" not in json.loads(sidecar_path(tmp_path / "n.bin").read_text())


def test_text_files_split_at_a_separator_and_long_documents_get_one_marker(tmp_path, eot_tok, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(text_pieces, "READ_BLOCK_BYTES", 64)  # separators straddle blocks
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 50)  # long documents are encoded in pieces
    monkeypatch.setattr(text_pieces, "MAX_CARRY_CHARS", 200)
    docs = ["first document\nwith two lines\n", "", "second ☃\n" * 30, "third"]
    (tmp_path / "a.txt").write_text("<|endoftext|>".join(docs) + "<|endoftext|>", encoding="utf-8")
    (tmp_path / "b.txt").write_text("a whole file is one document\n" * 20, encoding="utf-8")
    rc, lines, err = _run(["--tokenizer", eot_tok, "--input", tmp_path / "a.txt", "--out",
                           tmp_path / "s.bin", "--doc-separator", "<|endoftext|>"], capsys)
    assert rc == 0, err
    ids = load_tokens(str(tmp_path / "s.bin"), VOCAB).tolist()
    decoded = [tokenizers.Tokenizer.from_file(str(eot_tok)).decode(d) for d in _split_docs(ids)]
    assert decoded == [d for d in docs if d] and "1 empty document(s) skipped" in lines[0]
    rc, _, _ = _run(["--tokenizer", eot_tok, "--input", tmp_path / "b.txt", "--out", tmp_path / "w.bin"],
                    capsys)
    ids = load_tokens(str(tmp_path / "w.bin"), VOCAB).tolist()
    assert ids.count(0) == 1 and ids[-1] == 0  # pieces of one document: one marker, at its end
    # A separator made of line ends, in documents longer than a piece: never cut in two.
    # The first one ends exactly at the first block's end, its separator's second half in the next.
    paragraphs = ["y" * 63 + "\n"] + [f"paragraph {k}\n" + f"more {k} text line\n" * (k % 4 + 2)
                                      for k in range(11)]
    (tmp_path / "c.txt").write_text("\n".join(paragraphs), encoding="utf-8")
    rc, lines, _ = _run(["--tokenizer", eot_tok, "--input", tmp_path / "c.txt", "--out",
                         tmp_path / "c.bin", "--doc-separator", "\\n\\n"], capsys)
    assert rc == 0 and "12 documents" in lines[0]
    decoded = [tokenizers.Tokenizer.from_file(str(eot_tok)).decode(d)
               for d in _split_docs(load_tokens(str(tmp_path / "c.bin"), VOCAB).tolist())]
    assert decoded == [p[:-1] for p in paragraphs[:-1]] + [paragraphs[-1]]


def test_in_flight_tasks_are_bounded(tmp_path):
    pulled = []

    def tasks():
        for i in range(40):
            pulled.append(i)
            yield Task("text", [f"piece {i}\n"], "x.txt", 0, [True])

    seen = []
    from asyncpp_ext.data.encode import ByteTokenizer
    for task, (ids, lengths, bad) in ordered_encode(tasks(), ByteTokenizer(), "bytes", "text", 2):
        seen.append(bytes(ids.astype(np.uint8)).decode())
        assert len(pulled) - len(seen) <= 2 * 2 + 1  # never more than 2N + 1 in flight
    assert seen == [f"piece {i}\n" for i in range(40)]


class _KillsTheWorker:
    """Task items whose unpickling ends the worker process at once, as a kill -9 or the kernel's
    out-of-memory killer would."""

    def __reduce__(self):
        return os._exit, (3,)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_ends_the_run_with_one_line_not_a_hang(tmp_path):
    from asyncpp_ext.data.encode import ByteTokenizer, PrepareError

    tasks = [Task("text", [f"piece {i}\n"], "x.txt", 0, [True]) for i in range(3)]
    tasks.insert(1, Task("text", _KillsTheWorker(), "x.txt", 0, [True]))
    with pytest.raises(PrepareError, match="a tokenizer worker process stopped .*fewer --workers"):
        for _ in ordered_encode(iter(tasks), ByteTokenizer(), "bytes", "text", 2):
            pass


def test_an_unreadable_directory_inside_an_input_directory_is_named(tmp_path, capsys, monkeypatch):
    """Running as root, permissions cannot be taken away: the directory listing fails instead."""
    (tmp_path / "corpus" / "locked").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("readable text\n")
    (tmp_path / "corpus" / "locked" / "b.txt").write_text("text that must not go missing\n")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    rc, out, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "corpus", "--out",
                         tmp_path / "o.bin"], capsys)
    assert rc == 2 and out == [] and len(err) == 1, err
    assert re.search("input directory .*corpus/locked could not be read \\(Permission denied\\)",
                     err[0]), err[0]
    assert not (tmp_path / "o.bin").exists()


@pytest.mark.parametrize("spec", ["corpus", "corpus/*"])
def test_outputs_inside_the_input_directory_are_not_read_back_as_input(tmp_path, eot_tok, capsys, spec):
    """Token files, sidecars and manifests this tool wrote are not inputs of its next run."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "d.jsonl", _docs(40))
    argv = ["--tokenizer", eot_tok, "--input", tmp_path / spec, "--out", corpus / "o.bin",
            "--shard-tokens", "300", "--val-fraction", "0.1"]
    assert _run(argv, capsys)[0] == 0
    written = {p.name: p.read_bytes() for p in corpus.iterdir() if p.name != "d.jsonl"}
    assert {"o.manifest.json", "o_000000.bin.json", "o.val_000000.bin"} <= set(written)
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and "from 1 input file(s)" in out[0], err
    assert {p.name: p.read_bytes() for p in corpus.iterdir() if p.name != "d.jsonl"} == written


def _bad_case(tmp_path, case, tok, monkeypatch=None):
    good = [json.dumps({"text": "good text"}) + "\n"] * 3
    path = tmp_path / "in.jsonl"
    extra = []
    if case == "malformed JSON":
        path.write_text("".join(good) + '{"text": "broken\n' + good[0])
    elif case == "missing text field":
        path.write_text("".join(good) + json.dumps({"body": "x"}) + "\n")
    elif case == "null text":
        path.write_text("".join(good) + json.dumps({"text": None}) + "\n")
    elif case == "non-UTF-8 record":
        path.write_bytes("".join(good).encode() + b'{"text": "caf\xe9"}\n' + good[0].encode())
    elif case == "not an object":
        path.write_text("".join(good) + "[1, 2]\n")
    elif case == "truncated gzip":
        path = tmp_path / "in.jsonl.gz"
        data = gzip.compress(("".join(good) * 200).encode())
        path.write_bytes(data[: len(data) // 2])
    elif case == "truncated zstd":
        zstandard = pytest.importorskip("zstandard")
        path = tmp_path / "in.jsonl.zst"
        data = zstandard.ZstdCompressor().compress(("".join(good) * 200).encode())
        path.write_bytes(data[: len(data) // 2])
    elif case == "truncated parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": ["good text"] * 50}), path)
        path.write_bytes(path.read_bytes()[:-40])
    elif case == "parquet without the column":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = tmp_path / "in.parquet"
        pq.write_table(pa.table({"content": ["x"]}), path)
    elif case == "empty glob":
        path = tmp_path / "nothing" / "*.parquet"
    elif case == "DatasetDict directory":
        path = tmp_path / "dd"
        path.mkdir()
        (path / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    elif case == "malformed JSON after written shards":
        from asyncpp_ext.data import inputs as inp

        monkeypatch.setattr(inp, "TASK_BYTES", 100)  # shards are written before the bad line
        path.write_text("".join(good) * 40 + "{oops\n")
        extra = ["--shard-tokens", "20"]
    elif case == "unknown boundary token":
        path.write_text("".join(good))
        extra = ["--boundary-token", "<|nope|>"]
    elif case == "bytes tokenizer with eos":
        path.write_text("".join(good))
        return ["--tokenizer", "bytes", "--input", path, "--out", tmp_path / "o.bin",
                "--doc-boundary", "eos"]
    return ["--tokenizer", tok, "--input", path, "--out", tmp_path / "o.bin"] + extra


BAD = [
    ("malformed JSON", "in.jsonl line 4 is not valid JSON .*pass --skip-bad-records"),
    ("malformed JSON after written shards", "in.jsonl line 121 is not valid JSON"),
    ("missing text field", "in.jsonl line 4 has no 'text' field \\(fields: body\\); pass --text-field"),
    ("null text", "in.jsonl line 4 has 'text' = null, not a string"),
    ("non-UTF-8 record", "in.jsonl line 4 is not UTF-8 \\(byte 13 of the line\\)"),
    ("not an object", "in.jsonl line 4 is a JSON list, not an object"),
    ("truncated gzip", "in.jsonl.gz is damaged or cut short"),
    ("truncated zstd", "in.jsonl.zst is damaged or cut short \\(it ends inside a frame"),
    ("truncated parquet", "in.parquet is not a readable Parquet file .*download it again"),
    ("parquet without the column", "in.parquet has no column 'text' \\(columns: content\\)"),
    ("empty glob", "input .*nothing/\\*.parquet matches no file"),
    ("DatasetDict directory", "dd is a DatasetDict saved with save_to_disk \\(splits: train, test\\); "
                              "pass one split's directory, e.g. .*dd/train"),
    ("unknown boundary token", "--boundary-token '<\\|nope\\|>' is not a token of tokenizer"),
    ("bytes tokenizer with eos", "--doc-boundary eos: tokenizer bytes has no end-of-text token"),
]


@pytest.mark.parametrize("case, match", BAD)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, eot_tok, capsys, monkeypatch, case, match):
    argv = _bad_case(tmp_path, case, eot_tok, monkeypatch)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == [] and len(err) == 1, err
    assert err[0].startswith("asyncpp-prepare-data: error: ") and re.search(match, err[0]), err[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("case, skipped", [
    ("malformed JSON", "skipped 1 bad record(s) and 0 damaged file(s) (first: "),
    ("non-UTF-8 record", "skipped 1 bad record(s)"),
    ("missing text field", "skipped 1 bad record(s)"),
    ("truncated parquet", "skipped 0 bad record(s) and 1 damaged file(s)"),
    ("truncated zstd", "skipped 0 bad record(s) and 1 damaged file(s)"),
])
def test_skip_bad_records_counts_and_keeps_the_rest(tmp_path, eot_tok, capsys, case, skipped):
    argv = _bad_case(tmp_path, case, eot_tok)
    good = tmp_path / "good.jsonl"
    _jsonl(good, ["kept document"])
    rc, out, err = _run(argv[:4] + [good] + argv[4:] + ["--skip-bad-records"], capsys)
    assert rc == 0, err
    assert skipped in out[0]
    ids = load_tokens(str(tmp_path / "o.bin"), VOCAB).tolist()
    kept = _expected(eot_tok, ["kept document"])
    good_before = 0 if "parquet" in case or "zstd" in case else (4 if case in ("malformed JSON", "non-UTF-8 record") else 3)
    assert ids == _expected(eot_tok, ["good text"] * good_before) + kept


def test_a_missing_column_is_not_skipped_as_a_damaged_file(tmp_path, eot_tok, capsys):
    """A wrong --text-field (or a file of another schema) is the user's to fix, skipping or not."""
    argv = _bad_case(tmp_path, "parquet without the column", eot_tok)
    _jsonl(tmp_path / "good.jsonl", ["kept document"])
    rc, out, err = _run(argv[:4] + [tmp_path / "good.jsonl"] + argv[4:] + ["--skip-bad-records"], capsys)
    assert rc == 2 and out == [] and len(err) == 1, err
    assert re.search("in.parquet has no column 'text' \\(columns: content\\); pass --text-field", err[0])
    assert not (tmp_path / "o.bin").exists()


def test_progress_shows_documents_and_tokens_per_second(tmp_path, eot_tok, capsys):
    _jsonl(tmp_path / "d.jsonl", _docs(8))
    prep.prepare(str(eot_tok), [str(tmp_path / "d.jsonl")], str(tmp_path / "t.bin"), progress=True)
    err = capsys.readouterr().err
    assert "tokenize: 100%" in err and "8 docs" in err and "tok/s" in err


def test_help_names_the_new_flags():
    done = subprocess.run([sys.executable, "-m", "asyncpp_ext.data.prepare", "--help"],
                          capture_output=True, text=True, timeout=60)
    for flag in ("--text-field", "--doc-boundary", "--shard-tokens", "--workers", "--skip-bad-records",
                 "--doc-separator"):
        assert flag in done.stdout


def test_parquet_folder_to_a_2bw_run_through_the_manifests(tmp_path, eot_tok, capsys, one_intra_op_thread):
    """The README's path: a folder of Parquet shards -> shards + manifests -> a 2-stage 2bw run."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from asyncpp_ext.training.cli import main as train_main
    from asyncpp_ext.training.run_files import read_metrics

    folder = tmp_path / "fineweb"
    folder.mkdir()
    docs = _docs(300, start=1_500_000)
    for i in range(3):
        pq.write_table(pa.table({"text": docs[i * 100: (i + 1) * 100]}), folder / f"{i:03d}_00000.parquet")
    rc, lines, err = _run(["--tokenizer", eot_tok, "--input", folder, "--out", tmp_path / "fw.bin",
                           "--shard-tokens", "5000", "--val-fraction", "0.05"], capsys)
    assert rc == 0, err
    run = tmp_path / "run"
    rc = train_main(["--data", str(tmp_path / "fw.manifest.json"), "--val-data",
                     str(tmp_path / "fw.val.manifest.json"), "--vocab-size", str(VOCAB),
                     "--model", "tiny", "--seq-len", "32", "--stages", "2", "--schedule", "2bw",
                     "--simulate", "--steps", "4", "--eval-every", "2", "--no-progress", "--out", str(run)])
    assert rc == 0, capsys.readouterr().err
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and any("eval_loss" in r for r in rows)


def test_rerun_with_fewer_shards_removes_the_earlier_runs_extra_shards(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("some text to shard\n" * 50)
    argv = ["--tokenizer", "bytes", "--input", tmp_path / "in.txt", "--out", tmp_path / "o.bin"]
    assert _run(argv + ["--shard-tokens", "100"], capsys)[0] == 0
    assert len(list(tmp_path.glob("o_*.bin"))) == 10
    rc, lines, _ = _run(argv + ["--shard-tokens", "400"], capsys)
    assert rc == 0 and "removed 7 token file(s) of an earlier run" in lines[0]
    assert sorted(p.name for p in tmp_path.glob("o_*")) == [
        f"o_00000{i}.bin{s}" for i in range(3) for s in ("", ".json")]
    assert len(load_tokens(str(tmp_path / "o_*.bin"))) == 950
