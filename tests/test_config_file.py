"""``asyncpp-train --config FILE``: a TOML or JSON file of flags runs as those flags on the command
line would, the command line's flags win, and a file that cannot give flags is one line, exit 2."""
import importlib
import json
import sys

import pytest

from asyncpp_ext.training.arguments import build_parser
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config_file import expand_config

TOML = """\
model = "tiny"
seq-len = 16
steps = 3
simulate = true
[optimizer]
optimizer = "muon"
clip_grad_norm = 1.0
[run]
checkpoints = false
progress = false
eval-every = 0
"""
def _reads_toml() -> bool:
    for module in ("tomllib", "tomli"):
        try:
            importlib.import_module(module)
            return True
        except ImportError:
            pass
    return False


needs_toml = pytest.mark.skipif(not _reads_toml(), reason="reading TOML needs Python 3.11's tomllib or tomli")
SAME_FLAGS = ["--model", "tiny", "--seq-len", "16", "--steps", "3", "--simulate", "--optimizer", "muon",
              "--clip-grad-norm", "1.0", "--no-checkpoints", "--no-progress", "--eval-every", "0"]


def _run(run):
    config = json.loads((run / "config.json").read_text())
    config["train"].pop("out")
    return config, [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@needs_toml
def test_a_toml_file_is_its_flags(tmp_path):
    (tmp_path / "exp.toml").write_text(TOML)
    assert train(["--config", str(tmp_path / "exp.toml"), "--out", str(tmp_path / "file")]) == 0
    assert train([*SAME_FLAGS, "--out", str(tmp_path / "flags")]) == 0
    assert _run(tmp_path / "file") == _run(tmp_path / "flags")
    assert len(_run(tmp_path / "file")[1]) == 3


def test_the_command_line_wins_and_json_reads_too(tmp_path):
    (tmp_path / "exp.json").write_text(json.dumps({"model": "tiny", "seq_len": 16, "steps": 3, "simulate": True,
                                                   "checkpoints": False, "progress": False}))
    assert train([f"--config={tmp_path / 'exp.json'}", "--steps", "5", "--out", str(tmp_path / "r")]) == 0
    config, losses = _run(tmp_path / "r")
    assert len(losses) == 5 and config["model"]["seq_len"] == 16


@needs_toml
def test_values_become_tokens(tmp_path):
    (tmp_path / "c.toml").write_text('inductor-option = ["a=1", "b=2"]\ncompile = false\nauto_resume = true\n'
                                     'lr = 0.5\n')
    tokens = expand_config(["--steps", "2", "--config", str(tmp_path / "c.toml")], build_parser())
    assert tokens == ["--inductor-option", "a=1", "--inductor-option", "b=2", "--no-compile", "--auto-resume",
                      "--lr", "0.5", "--steps", "2"]


@pytest.mark.parametrize("text, name, words", [
    ('stpes = 3\n', "c.toml", "'stpes' is not a flag of asyncpp-train (did you mean 'steps'?)"),
    ('steps = true\n', "c.toml", "steps takes a value, not True"),
    ('simulate = "yes"\n', "c.toml", "simulate is an on/off flag: give true or false"),
    ('steps = [1, 2]\n', "c.toml", "steps takes one value, not a list"),
    ('steps = \n', "c.toml", "not valid TOML"),
    ('{"steps": 3', "c.json", "not valid JSON"),
    ('[1, 2]', "c.json", "must hold a table of flags, not a list"),
    ('steps = 3\n', "c.yaml", "name a .toml or .json file"),
    ('config = "other.toml"\n', "c.toml", "'config' is not a flag of asyncpp-train"),
    # a value the flag's own parsing refuses names the file and its key, as the flags above do
    ('steps = "three"\n', "c.toml", "c.toml: steps = 'three' is not an int value"),
    ('schedule = "2bv"\n', "c.toml", "c.toml: schedule = '2bv' is not one of "),
    ('[run]\ndocument-mask = "x"\n', "c.toml", "c.toml: document-mask = 'x': "),
    ('{"data-mix": ["a.bin=x"]}', "c.json", "c.json: data-mix = 'a.bin=x': "),
])
def test_a_file_that_cannot_give_flags_is_one_line(tmp_path, capsys, text, name, words):
    if name.endswith(".toml") and not _reads_toml():
        pytest.skip("reading TOML needs Python 3.11's tomllib or tomli")
    (tmp_path / name).write_text(text)
    assert train(["--config", str(tmp_path / name), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and err.startswith("asyncpp-train: error: --config"), err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, words", [
    (["--config", "{tmp}/missing.toml"], "cannot read it"),
    (["--config", "{tmp}/c.toml", "--config", "{tmp}/c.toml"], "--config is given twice"),
    (["--conf", "{tmp}/c.toml"], "write --config in full"),
    (["--config"], "--config needs a FILE"),
])
@needs_toml
def test_bad_config_flags_are_one_line(tmp_path, capsys, argv, words):
    (tmp_path / "c.toml").write_text("steps = 3\n")
    assert train([a.format(tmp=tmp_path) for a in argv] + ["--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "r").exists()


def test_toml_without_a_reader_names_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python < 3.11 without tomli
    monkeypatch.setitem(sys.modules, "tomli", None)
    (tmp_path / "c.toml").write_text("steps = 3\n")
    assert train(["--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs Python 3.11 or `pip install tomli`" in err, err


@needs_toml
def test_a_table_named_after_a_key_value_flag_gives_its_values(tmp_path):
    (tmp_path / "mix.toml").write_text('[data-mix]\n"web/*.bin" = 0.7\n"a=b.txt" = 3\n'
                                       '[inductor-option]\nmax_autotune = true\nunroll_reductions_threshold = 4\n')
    tokens = expand_config(["--config", str(tmp_path / "mix.toml"), "--steps", "2"], build_parser())
    assert tokens == ["--data-mix", "web/*.bin=0.7", "--data-mix", "a=b.txt=3", "--inductor-option",
                      "max_autotune=true", "--inductor-option", "unroll_reductions_threshold=4", "--steps", "2"]
    args = build_parser().parse_args(tokens)
    assert args.data_mix == [["web/*.bin", 0.7], ["a=b.txt", 3.0]]  # the last '=' splits
