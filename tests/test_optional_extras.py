"""Without an optional extra the suite still collects, and the tests that need the extra skip.

pytest runs in a subprocess with extras' modules hidden (``--hide-module``, tests/conftest.py:
importing them fails as if they were not installed). In the default suite, with every extra
hidden, the whole default suite must collect without an error. With ``-m slow``, for each extra:
the same collection, plus a run of the in-process tests of every test file that mentions the extra
(its modules or its features by name), where nothing may fail and something must skip.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# extra -> (the modules it installs, words that mark a test file as using it)
EXTRAS = {
    "hf": (["transformers", "tokenizers", "safetensors"], ["hf_config", "hf-config", "hf-model", "hf_model"]),
    "tensorboard": (["tensorboard"], []),
    "wandb": (["wandb"], []),
    "study": (["pytorch_optimizer"], ["lion", "adan", "soap", "mars"]),
    "hypothesis (test)": (["hypothesis"], []),
    "data": (["pyarrow", "zstandard", "datasets"], ["parquet", "zstd"]),
}


def _files_using(words: list) -> list:
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    files = sorted(TESTS.rglob("test_*.py"))
    return [f.stem for f in files if f != Path(__file__).resolve() and pattern.search(f.read_text())]


def _pytest_without(modules: list, args: list, tmp_path) -> tuple:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
           "-W", "ignore::pytest.PytestConfigWarning", "--basetemp", str(tmp_path / "pytest"), *args]
    if "hypothesis" in modules:
        cmd += ["-p", "no:hypothesispytest"]  # hypothesis' own pytest plugin imports it
    for module in modules:
        cmd += ["--hide-module", module]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, (summary, done.stdout[-4000:], done.stderr[-2000:])
    return summary, done.stdout


def test_the_suite_collects_without_any_optional_extra(tmp_path):
    modules = [m for mods, _ in EXTRAS.values() for m in mods]
    summary, out = _pytest_without(modules, ["--collect-only", "-m", "not slow"], tmp_path)
    assert "tests collected" in summary and "error" not in summary, summary
    assert "test_optional_extras.py::test_the_suite_collects_without_any_optional_extra" in out


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(EXTRAS))
def test_the_tests_that_need_a_missing_extra_skip(extra, tmp_path):
    modules, words = EXTRAS[extra]
    files = _files_using(modules + words)
    assert files, f"no test file uses the {extra} extra"
    summary, _ = _pytest_without(modules, ["-m", "not slow and not multiproc", "-k", " or ".join(files)], tmp_path)
    assert " passed" in summary and "skipped" in summary and "error" not in summary, summary
