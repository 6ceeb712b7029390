"""The bench scripts as commands: a Ctrl-C or SIGTERM is one line and the signal's exit code, the
script's cleanup runs, and nothing partial is left behind."""
import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def _main_block_calls(path: Path) -> list[str]:
    """Names the ``if __name__ == "__main__"`` block of ``path`` calls."""
    calls = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            calls += [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
    return calls


def test_every_bench_command_runs_through_run_script():
    commands = [p for p in sorted(BENCH.glob("*.py")) if _main_block_calls(p)]
    assert len(commands) >= 15  # the scripts a user runs
    assert not [p.name for p in commands if _main_block_calls(p) != ["run_script"]]


def _script(tmp_path: Path, body: str) -> Path:
    """A command in ``tmp_path`` whose ``main`` is ``body``; it writes ``ready`` when running."""
    path = tmp_path / "cmd.py"
    path.write_text(textwrap.dedent("""\
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {bench!r})
        from bench_command import run_script
        here = Path(__file__).parent

        def main():
        {body}

        if __name__ == "__main__":
            run_script(main)
        """).format(bench=str(BENCH), body=textwrap.indent(textwrap.dedent(body), "    ")))
    return path


def _signals_by_default() -> None:
    """As in a terminal: a test run in the background (CI) starts its children with SIGINT ignored."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


def _start_and_signal(tmp_path: Path, path: Path, sig: int, ready: int = 1) -> subprocess.CompletedProcess:
    """Run ``path`` in its own session, send ``sig`` to its process group once ``ready`` marker
    files ``ready*`` exist (what a terminal's Ctrl-C does), and wait for it."""
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            preexec_fn=_signals_by_default)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready*"))) < ready:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never got ready"
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("sig, code, line", [(signal.SIGINT, 130, "cmd.py: interrupted"),
                                             (signal.SIGTERM, 143, "cmd.py: stopped by SIGTERM")])
def test_a_stopped_command_is_one_line_after_its_cleanup(tmp_path, sig, code, line):
    path = _script(tmp_path, """\
        try:
            (here / "ready").touch()
            time.sleep(60)
        finally:
            (here / "cleaned").touch()
        return 0
        """)
    done = _start_and_signal(tmp_path, path, sig)
    assert (done.returncode, done.stderr, done.stdout) == (code, line + "\n", "")
    assert (tmp_path / "cleaned").exists()


def test_a_commands_own_exit_code_passes_through(tmp_path):
    path = _script(tmp_path, "return 2")
    assert subprocess.run([sys.executable, str(path)], capture_output=True).returncode == 2


def test_sizes_that_do_not_fit_in_memory_are_one_line_and_exit_1(tmp_path):
    path = _script(tmp_path, """\
        import torch
        torch.empty(1 << 50)  # 4 PiB of float32: the allocator refuses at once
        """)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("cmd.py: out of memory (") and done.stderr.count("\n") == 1, done.stderr
    assert "can't allocate memory" in done.stderr and done.stderr.endswith("; lower the sizes given (see --help)\n")


def test_other_failures_keep_their_traceback(tmp_path):
    path = _script(tmp_path, 'raise RuntimeError("a bug")')
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" in done.stderr and "RuntimeError: a bug" in done.stderr


def test_out_of_memory_recognises_allocation_failures_only():
    import torch

    from asyncpp_ext.oom import out_of_memory

    assert out_of_memory(MemoryError()) == "MemoryError"
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")).startswith("CUDA out")
    assert len(out_of_memory(RuntimeError("can't allocate memory " + "x" * 1000))) == 300
    assert out_of_memory(RuntimeError("a bug")) is None and out_of_memory(ValueError("allocate")) is None


def test_a_ctrl_c_stops_a_study_pool_with_one_line(tmp_path):
    """The terminal's Ctrl-C reaches the pool's workers too; the study stops them, and the only
    output is the study's line."""
    (tmp_path / "slow_job.py").write_text(textwrap.dedent("""\
        import time
        from pathlib import Path

        def job(marker):
            Path(marker).touch()
            time.sleep(60)
        """))
    path = _script(tmp_path, f"""\
        import slow_job
        from study_runs import run_pool
        run_pool(slow_job.job, [({str(tmp_path / "ready0")!r},), ({str(tmp_path / "ready1")!r},)], 2, 1)
        """)
    done = _start_and_signal(tmp_path, path, signal.SIGINT, ready=2)
    assert (done.returncode, done.stderr) == (130, "cmd.py: interrupted\n")


def _corpus_root(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    for i in range(8):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * (i + 2))
    return root


@pytest.mark.parametrize("where", ["_texts", "train_tokenizer", "prepare"])
def test_an_interrupted_corpus_build_leaves_nothing(tmp_path, monkeypatch, where):
    pytest.importorskip("tokenizers")
    import study_corpus
    from asyncpp_ext.data import prepare as prepare_module

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "_texts":  # the staging file half written
        real = study_corpus._texts

        def texts(paths):
            yield from list(real(paths))[:3]
            raise KeyboardInterrupt

        monkeypatch.setattr(study_corpus, "_texts", texts)
    elif where == "train_tokenizer":  # the tokenizer saved, the corpus not yet made
        real_train = study_corpus.train_tokenizer

        def train(*args):
            real_train(*args)
            raise KeyboardInterrupt

        monkeypatch.setattr(study_corpus, "train_tokenizer", train)
    else:
        monkeypatch.setattr(prepare_module, "prepare", interrupt)
    root = _corpus_root(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        study_corpus.ensure_corpus(tmp_path / "corpus", 300, roots=[root], workers=1)
    assert not (tmp_path / "corpus").exists()
    (tmp_path / "kept").mkdir()  # a folder the user made stays, empty
    with pytest.raises(KeyboardInterrupt):
        study_corpus.ensure_corpus(tmp_path / "kept", 300, roots=[root], workers=1)
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_corpus_of_another_vocabulary_is_replaced_whole(tmp_path):
    pytest.importorskip("tokenizers")
    import study_corpus

    root = _corpus_root(tmp_path)
    first = study_corpus.ensure_corpus(tmp_path / "corpus", 300, roots=[root], workers=1)
    second = study_corpus.ensure_corpus(tmp_path / "corpus", 320, roots=[root], workers=1)
    assert (first["vocab"], second["vocab"]) == (300, 320)
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == [
        "corpus.bin", "corpus.bin.json", "corpus.json", "tokenizer.json"]


@pytest.mark.parametrize("argv, words", [(["--vocab", "0"], "a vocabulary of 0 ids is below 257"),
                                         (["--vocab", "-5"], "a vocabulary of -5 ids is below 257"),
                                         (["--max-mb", "0"], "--max-mb 0 is not positive")])
def test_corpus_sizes_are_one_line_before_any_work(tmp_path, argv, words):
    done = subprocess.run([sys.executable, str(BENCH / "study_corpus.py"), str(tmp_path / "c"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("script, extra", [("attention_kernels", ["--device", "cpu"]),
                                           ("block_bytes", ["--model", "llama-tiny", "--seq-len", "32",
                                                            "--tokens", "64"]),
                                           ("block_step", ["--device", "cpu"]),
                                           ("gpu_throughput", ["--device", "cpu", "--quick"])])
@pytest.mark.parametrize("case", ["a directory", "under a file"])
def test_a_json_report_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, monkeypatch,
                                                                         script, extra, case):
    import importlib

    module = importlib.import_module(script)
    measured = []
    for name in ("run", "measure", "run_plan"):  # what a run would do first
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: measured.append(name))
    (tmp_path / "file").write_text("")
    path = tmp_path if case == "a directory" else tmp_path / "file" / "report.json"
    assert module.main([*extra, "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--json {path} " in err, err
    assert ("is a directory" if case == "a directory" else "cannot be written") in err
    assert measured == []


COMMANDS = sorted(p.stem for p in BENCH.glob("*.py") if _main_block_calls(p))


@pytest.mark.parametrize("script", COMMANDS)
def test_an_unknown_flag_is_one_line_and_exit_2(script, capsys):
    import importlib

    module = importlib.import_module(script)
    positional = {"paper_study": ["optimizers"], "study_corpus": ["folder"]}.get(script, [])
    try:
        code = module.main([*positional, "--no-such-flag"])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--no-such-flag" in err, err


@pytest.mark.parametrize("script", ["attention_kernels", "block_step"])
@pytest.mark.parametrize("tol", ["0", "-1", "nan", "inf"])
def test_a_tolerance_that_is_not_a_positive_number_is_refused(capsys, script, tol):
    import importlib

    module = importlib.import_module(script)
    assert module.main(["--device", "cpu", "--tol", tol]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tol must be a positive relative difference, got {float(tol)}" in err, err
