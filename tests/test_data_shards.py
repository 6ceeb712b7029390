"""Reading several token files as one (--data/--val-data given a glob, a directory or a manifest),
llm.c / modded-nanogpt headered shards, and resuming a run whose windows cross shard boundaries."""
import json

import numpy as np
import pytest
import torch

from asyncpp_ext.data import (BatchStream, DataError, TokenShards, eval_batches, load_tokens,
                              sidecar_path, split_tokens, token_file_info)
from asyncpp_ext.data.shards import resolve_token_paths


def _ours(path, ids, vocab=512):
    """Our token file: raw uint16 + sidecar."""
    ids = np.asarray(ids, dtype="<u2")
    ids.tofile(path)
    sidecar_path(path).write_text(json.dumps({
        "format": "asyncpp-tokens", "version": 1, "dtype": "uint16", "num_tokens": len(ids),
        "vocab_size": vocab, "max_token_id": int(ids.max()), "tokenizer": "bytes"}))
    return path


def _llmc(path, ids, magic=20240520, version=1, count=None, dtype="<u2"):
    """An llm.c shard: 256 int32 (magic, version, token count) then the ids."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype=dtype).tobytes())
    return path


def test_llmc_shard_reads_past_its_header(tmp_path):
    ids = np.arange(1000) % 300
    tokens = load_tokens(str(_llmc(tmp_path / "fineweb_train_000001.bin", ids)), vocab_size=300)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype("<u2")
    assert np.array_equal(tokens, ids)
    info = token_file_info(tmp_path / "fineweb_train_000001.bin")
    assert (info["dtype"], info["num_tokens"], info["max_token_id"]) == ("uint16", 1000, 299)
    llama = load_tokens(str(_llmc(tmp_path / "l3.bin", [5, 70_000, 9], magic=20240801, version=7,
                                  dtype="<u4")), vocab_size=128_256)
    assert llama.dtype == np.dtype("<u4") and llama.tolist() == [5, 70_000, 9]
    with pytest.raises(DataError, match="holds token id 299 .* vocab_size is 256"):
        load_tokens(str(tmp_path / "fineweb_train_000001.bin"))


@pytest.mark.parametrize("case, match", [
    ("bad version", "llm.c token shard \\(magic 20240520\\) of version 2; this asyncpp reads version 1"),
    ("count above size", "header says 600 uint16 tokens .* file has 2024 bytes: it is cut short"),
    ("count below size", "header says 100 uint16 tokens"),
    ("truncated", "header says 500 uint16 tokens .* file has 1524 bytes"),
    ("wrong magic", "llm.c-style header with magic 20240521, not 20240520"),
    ("model checkpoint", "is an llm.c GPT-2 model checkpoint \\(magic 20240326\\)"),
    ("eval file", "is an llm.c eval file"),
])
def test_bad_llmc_header_is_one_clear_line(tmp_path, case, match):
    path = tmp_path / "shard.bin"
    ids = np.arange(500)
    if case == "bad version":
        _llmc(path, ids, version=2)
    elif case.startswith("count"):
        _llmc(path, ids, count=600 if "above" in case else 100)
    elif case == "truncated":
        _llmc(path, ids)
        with open(path, "r+b") as f:
            f.truncate(1024 + 250 * 2)
    elif case == "wrong magic":
        _llmc(path, ids, magic=20240521)
    else:
        _llmc(path, ids, magic=20240326 if case == "model checkpoint" else 20240522)
    with pytest.raises(DataError, match=match) as info:
        load_tokens(str(path), vocab_size=1000)
    assert "shard.bin" in str(info.value) and "\n" not in str(info.value)


def test_glob_directory_and_single_match(tmp_path):
    a = _ours(tmp_path / "t_000000.bin", np.arange(0, 100))
    b = _llmc(tmp_path / "t_000001.bin", np.arange(100, 250))
    c = _ours(tmp_path / "t_000002.bin", np.arange(250, 260))
    for spec in (str(tmp_path / "t_*.bin"), str(tmp_path)):
        tokens = load_tokens(spec, vocab_size=512)
        assert isinstance(tokens, TokenShards) and tokens.num_shards == 3 and len(tokens) == 260
        assert np.array_equal(np.asarray(tokens), np.arange(260))
    assert resolve_token_paths(str(tmp_path / "t_*.bin"))[0] == [a, b, c]  # sorted by name
    one = load_tokens(str(tmp_path / "t_000002*"), vocab_size=512)
    assert isinstance(one, np.memmap) and one.tolist() == list(range(250, 260))
    with pytest.raises(DataError, match=r"t_\*\.bin \(shard t_000002\.bin\) holds token id 259 .* "
                                        "vocab_size is 200; train with --vocab-size 512"):
        load_tokens(str(tmp_path / "t_*.bin"), vocab_size=200)


def test_shards_slice_like_one_array(tmp_path):
    whole = np.arange(1000, dtype=np.int64) % 509
    cuts = [0, 7, 300, 301, 999, 1000]
    parts = [whole[a:b].astype("<u2") for a, b in zip(cuts, cuts[1:])]
    shards = TokenShards(parts)
    assert len(shards) == 1000 and shards.max() == whole.max() and shards[-1] == whole[-1]
    rng = np.random.default_rng(0)
    for _ in range(200):
        lo, hi = sorted(rng.integers(0, 1001, size=2))
        view = shards[lo:hi]
        assert np.array_equal(np.asarray(view, dtype=np.int64), whole[lo:hi])
        if hi - lo > 2:
            inner = view[1:-1]
            assert np.array_equal(np.asarray(inner), whole[lo + 1: hi - 1])
    train, held = split_tokens(shards, 0.1, 2, 16)
    assert np.array_equal(np.asarray(held), whole[900:]) and len(train) == 900
    stream_a = BatchStream(shards, 3, 4, 16, seed=5)
    stream_b = BatchStream(whole, 3, 4, 16, seed=5)
    for _ in range(5):  # windows cross the shard boundaries: same batches as the joined array
        for (xa, ya), (xb, yb) in zip(stream_a.next(), stream_b.next()):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for (xa, _), (xb, _) in zip(eval_batches(held, 2, 16, 3), eval_batches(whole[900:], 2, 16, 3)):
        assert torch.equal(xa, xb)


def test_stream_state_over_shards_refuses_another_set(tmp_path):
    parts = [np.arange(500, dtype="<u2"), np.arange(500, dtype="<u2")]
    stream = BatchStream(TokenShards(parts), 2, 2, 8, seed=1)
    stream.next()
    state = stream.state_dict()
    assert state == {"seed": 1, "position": 1, "num_tokens": 1000, "shards": 2,
                     "fingerprint": state["fingerprint"]}
    same = BatchStream(TokenShards(parts), 2, 2, 8, seed=1)
    same.load_state_dict(state)
    assert same.position == 1
    more = BatchStream(TokenShards(parts + [np.arange(10, dtype="<u2")]), 2, 2, 8, seed=1)
    with pytest.raises(DataError, match="ran over 1000 training tokens in 2 shard\\(s\\) but the "
                                        "data now gives 1010 in 3"):
        more.load_state_dict(state)
    old = BatchStream(TokenShards(parts), 2, 2, 8, seed=1)
    old.load_state_dict({"seed": 1, "position": 4})  # an older checkpoint: no shard fields
    assert old.position == 4


@pytest.mark.parametrize("case, match", [
    ("empty glob", "--data .*nothing_\\*.bin matches no file"),
    ("empty directory", "is a directory without .bin token files"),
    ("glob of text", "not a .bin token file"),
    ("bad shard in glob", "t_000001.bin has an odd byte length"),
    ("manifest count", "holds 100 tokens but the manifest says 99"),
    # a shard whose sidecar is gone beside shards that have theirs: its ids' width is unknown (a
    # uint32 shard read as uint16 gives twice the ids, every other one 0, all below the vocabulary)
    ("shard without its sidecar", "t_000001.bin has no header \\(its .json sidecar\\) but t_000000.bin has one"),
])
def test_bad_shard_sets(tmp_path, case, match):
    _ours(tmp_path / "t_000000.bin", np.arange(100))
    spec = str(tmp_path / "t_*")
    if case == "empty glob":
        spec = str(tmp_path / "nothing_*.bin")
    elif case == "empty directory":
        (tmp_path / "empty").mkdir()
        spec = str(tmp_path / "empty")
    elif case == "glob of text":
        (tmp_path / "t_notes.txt").write_text("x")
    elif case == "bad shard in glob":
        (tmp_path / "t_000001.bin").write_bytes(b"\x01\x00\x02")
    elif case == "shard without its sidecar":
        np.arange(100, dtype="<u4").tofile(tmp_path / "t_000001.bin")
    else:
        spec = str(tmp_path / "t.manifest.json")
        (tmp_path / "t.manifest.json").write_text(json.dumps({
            "format": "asyncpp-token-shards", "version": 1,
            "shards": [{"file": "t_000000.bin", "num_tokens": 99}]}))
    with pytest.raises(DataError, match=match) as info:
        load_tokens(spec, vocab_size=512)
    assert "\n" not in str(info.value)


def _train(argv, capsys):
    from asyncpp_ext.training.cli import main as train_main
    from asyncpp_ext.training.run_files import read_metrics

    rc = train_main([str(a) for a in argv])
    assert rc == 0, capsys.readouterr().err
    return read_metrics(argv[argv.index("--out") + 1])


COMMON = ["--model", "tiny", "--vocab-size", "512", "--seq-len", "32", "--microbatches", "2",
          "--micro-batch-size", "2", "--schedule", "2bw", "--stages", "2", "--simulate",
          "--eval-every", "0", "--no-progress"]


def test_llmc_shard_and_our_shard_train_bitwise_alike(tmp_path, capsys, one_intra_op_thread):
    ids = (np.arange(6000) * 7919) % 512
    ours, llmc = _ours(tmp_path / "ours.bin", ids), _llmc(tmp_path / "llmc.bin", ids)
    runs = [_train(["--data", path, "--steps", "6", "--out", tmp_path / name] + COMMON, capsys)
            for path, name in ((ours, "a"), (llmc, "b"))]
    losses = [[row["loss"] for row in rows] for rows in runs]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_resume_over_shard_boundaries_matches_uninterrupted(tmp_path, capsys, one_intra_op_thread):
    ids = (np.arange(3000) * 104729) % 512
    for i, part in enumerate(np.array_split(ids, 12)):  # 250-token shards: windows cross them
        (_ours if i % 2 else _llmc)(tmp_path / f"s_{i:06d}.bin", part)
    glob = str(tmp_path / "s_*.bin")
    whole = _train(["--data", glob, "--steps", "8", "--out", tmp_path / "whole"] + COMMON, capsys)
    _train(["--data", glob, "--steps", "4", "--ckpt-every", "4", "--out", tmp_path / "cut"] + COMMON,
           capsys)
    resumed = _train(["--resume", tmp_path / "cut", "--steps", "8", "--no-progress", "--out",
                      tmp_path / "cut"], capsys)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    meta = json.loads(next((tmp_path / "cut").glob("ckpt-000004/meta.json")).read_text())
    fingerprint = meta["data"].pop("fingerprint")
    assert meta["data"] == {"seed": 0, "position": 4, "num_tokens": 2700, "shards": 12}
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0


@pytest.mark.parametrize("change", ["swapped", "one id changed", "in range of a slice"])
def test_a_resume_over_changed_shards_is_refused(tmp_path, change):
    parts = [(np.arange(4000) * (i + 3)) % 500 for i in range(3)]
    paths = [_ours(tmp_path / f"s_{i:06d}.bin", part) for i, part in enumerate(parts)]
    glob = str(tmp_path / "s_*.bin")

    def stream():
        tokens = load_tokens(glob, vocab_size=512)
        if change == "in range of a slice":  # a train split: the last shard only partly in range
            tokens = tokens[: 10_000]
        return BatchStream(tokens, microbatches=2, micro_batch_size=2, seq_len=16)

    state = stream().state_dict()
    stream().load_state_dict(state)  # the same data: accepted
    if change == "swapped":
        _ours(paths[0], parts[1])
        _ours(paths[1], parts[0])
    else:
        ids = parts[2].copy()
        ids[-5 if change == "one id changed" else 1_500] += 1  # near the end, or inside the slice's range
        _ours(paths[2], ids)
    with pytest.raises(DataError, match="other training tokens than the data now gives"):
        stream().load_state_dict(state)


def test_a_validation_file_inside_the_training_data_is_refused(tmp_path, capsys):
    # a directory takes every .bin in it: asyncpp-prepare-data's validation shards beside the
    # training ones would be trained on as well as evaluated
    from asyncpp_ext.training.cli import main

    data = tmp_path / "data"
    data.mkdir()
    _ours(data / "t_000000.bin", np.arange(4000) % 500)
    _ours(data / "t.val_000000.bin", np.arange(1000) % 500)
    run = tmp_path / "run"
    flags = ["--vocab-size", "512", "--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2",
             "--steps", "1", "--eval-every", "0", "--no-progress", "--simulate", "--no-compile", "--out", str(run)]
    assert main(["--data", str(data), "--val-data", str(data / "t.val_000000.bin")] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "share 1 file(s), e.g. " in err and "t.val_000000.bin" in err, err
    assert not run.exists()
    # the training shards alone: accepted
    assert main(["--data", str(data / "t_*.bin"), "--val-data", str(data / "t.val_000000.bin")] + flags) == 0


@pytest.mark.multiproc
def test_a_pipeline_resume_over_grown_data_is_refused_before_any_rank_starts(tmp_path, capsys):
    # the data is checked against the checkpoint before the ranks start and before the run
    # directory's config and metrics are touched
    from asyncpp_ext.training.cli import main

    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question. " * 400)
    run = tmp_path / "run"
    flags = ["--model", "tiny", "--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2",
             "--stages", "2", "--no-compile", "--eval-every", "0", "--no-progress"]
    assert main(["--data", str(text), "--steps", "2", "--ckpt-every", "2", "--out", str(run)] + flags) == 0
    before = {p.name: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")}
    with open(text, "a") as f:
        f.write("whether 'tis nobler in the mind to suffer. " * 50)
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "4", "--no-progress", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not fit this run" in err and "a file may have grown" in err, err
    assert "rank" not in err  # refused in the launcher, not by the ranks
    assert {p.name: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")} == before


def _stream_per_rank(differ: bool) -> None:
    import torch.distributed as dist
    from asyncpp_ext.pipeline import init_distributed
    from asyncpp_ext.training.distributed import check_same_data

    init_distributed(30)
    tokens = np.arange(3000, dtype=np.uint16) % 500
    if differ and dist.get_rank() == 1:
        tokens[1500] += 1  # this rank's copy of the data differs in one token
    check_same_data(BatchStream(tokens, 2, 2, 16, seed=0))


@pytest.mark.multiproc
def test_ranks_reading_other_data_are_stopped_at_start():
    from asyncpp_ext.pipeline import LaunchError, spawn

    spawn(_stream_per_rank, 2, (False,))
    with pytest.raises(LaunchError, match=r"rank 1 reads other training data than rank 0 .* every rank must "
                                          r"read the same --data"):
        spawn(_stream_per_rank, 2, (True,))


def test_a_sidecar_that_understates_the_ids_is_one_line_not_an_index_error(tmp_path, capsys):
    """The load trusts a sidecar's max_token_id (no scan); the windows are checked as they are cut."""
    from asyncpp_ext.training.cli import main

    ids = np.arange(6000) % 256
    ids[::50] = 300
    path = _ours(tmp_path / "lie.bin", ids, vocab=256)
    header = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps(dict(header, max_token_id=255)))
    rc = main(["--data", str(path), "--vocab-size", "256", "--model", "tiny", "--seq-len", "32", "--steps", "2",
               "--no-checkpoints", "--no-progress", "--simulate", "--no-compile", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    assert f"--data {path} holds token id 300 >= vocab_size 256, above the max_token_id its sidecar gives" in err
