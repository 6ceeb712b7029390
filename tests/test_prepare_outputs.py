"""How ``asyncpp-prepare-data`` puts its outputs in place: SIGTERM and SIGHUP leave nothing behind
(as Ctrl-C does), a stop request during the final renames waits for them, a failure among the
renames never leaves a token file without its sidecar, and a rerun with the same ``--out`` removes
what an earlier run of the other mode (shards or one file) wrote."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from asyncpp_ext.data import load_tokens, sidecar_path
from asyncpp_ext.data import prepare as prep
from asyncpp_ext.data import sinks

TEXT = "a line of text for the token files\n" * 40


def _run(argv, capsys):
    rc = prep.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def _in_a_child(tmp_path, patch: str):
    """(exit status, stderr) of main() in a fresh interpreter with ``patch`` applied first: a signal
    this process sent itself must not reach the test runner."""
    (tmp_path / "in.txt").write_text(TEXT)
    code = textwrap.dedent("""
        import os, signal, sys
        import numpy as np
        from asyncpp_ext.data import documents, prepare as prep, sinks, text_pieces
        text_pieces.READ_BLOCK_BYTES, text_pieces.PIECE_CHARS, documents.PIECES_PER_BATCH = 64, 32, 1
        """) + textwrap.dedent(patch) + textwrap.dedent(f"""
        sys.exit(prep.main(["--tokenizer", "bytes", "--input", {str(tmp_path / 'in.txt')!r},
                            "--out", {str(tmp_path / 'o.bin')!r}, "--shard-tokens", "300",
                            "--val-fraction", "0.1"]))
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=_stop_signals_by_default)
    return done.returncode, done.stderr.splitlines()


def _stop_signals_by_default() -> None:
    """The stop signals as a terminal delivers them: a suite run under nohup (or as a background
    job) ignores SIGHUP (SIGINT), and a child that inherits that goes on ignoring them."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_midway_leave_no_file(tmp_path, name):
    rc, err = _in_a_child(tmp_path, f"""
        calls = []
        def encode(self, pieces):
            calls.append(1)
            if len(calls) == 5:  # some shards are written by now
                os.kill(os.getpid(), signal.{name})
            return [np.frombuffer(p.encode(), dtype=np.uint8) for p in pieces]
        prep.ByteTokenizer.encode = encode
        """)
    signum = getattr(signal, name)
    assert rc == 128 + signum and err == [f"asyncpp-prepare-data: stopped by {name}; no file written"], err
    assert [p.name for p in tmp_path.iterdir()] == ["in.txt"]


def test_a_stop_during_the_renames_waits_for_all_of_them(tmp_path):
    rc, err = _in_a_child(tmp_path, """
        real_replace, done = os.replace, []
        def replace(src, dst):
            if not done:  # the first rename: the request arrives while the rest are to come
                os.kill(os.getpid(), signal.SIGTERM)
            done.append(dst)
            real_replace(src, dst)
        sinks.os.replace = replace
        """)
    assert rc == 128 + signal.SIGTERM, err
    assert err == ["asyncpp-prepare-data: SIGTERM arrived as the outputs were put in place; they are "
                   "complete"]
    train = load_tokens(str(tmp_path / "o.manifest.json"))
    val = load_tokens(str(tmp_path / "o.val.manifest.json"))
    assert len(train) + len(val) == len(TEXT) and not list(tmp_path.glob(".*"))


def test_a_failed_rename_never_leaves_a_token_file_without_its_sidecar(tmp_path, capsys, monkeypatch):
    (tmp_path / "in.txt").write_text(TEXT)
    real_replace, count = os.replace, []

    def replace(src, dst):
        count.append(dst)
        if len(count) == 2:
            raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(sinks.os, "replace", replace)
    rc, out, err = _run(["--tokenizer", "bytes", "--input", tmp_path / "in.txt", "--out",
                         tmp_path / "o.bin", "--val-fraction", "0.1"], capsys)
    assert rc == 1 and "No space left on device" in err[0], err  # a failed run, not bad input
    for token_file in tmp_path.glob("*.bin"):
        assert sidecar_path(token_file).exists(), token_file
    assert not list(tmp_path.glob(".*"))


def test_a_rerun_in_the_other_mode_removes_the_earlier_outputs(tmp_path, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    argv = ["--tokenizer", "bytes", "--input", tmp_path / "in.txt", "--out", tmp_path / "data" / "o.bin"]
    (tmp_path / "data").mkdir()
    assert _run(argv + ["--shard-tokens", "300"], capsys)[0] == 0
    (tmp_path / "data" / "o_000009.bin").write_bytes(b"\0\0" * 10)  # not ours: no sidecar
    rc, out, _ = _run(argv, capsys)  # one file now: the shards and their manifest go
    assert rc == 0 and "removed 5 token file(s) of an earlier run" in out[0]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["o.bin", "o.bin.json", "o_000009.bin"]
    (tmp_path / "data" / "o_000009.bin").unlink()
    assert len(load_tokens(str(tmp_path / "data"))) == len(TEXT)  # read once, not twice
    rc, out, _ = _run(argv + ["--shard-tokens", "1000"], capsys)  # shards again: the file goes
    assert rc == 0 and "removed 1 token file(s) of an earlier run" in out[0]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "o.manifest.json", "o_000000.bin", "o_000000.bin.json", "o_000001.bin", "o_000001.bin.json"]
    assert len(load_tokens(str(tmp_path / "data"))) == len(TEXT)
