"""``--eval-data PATH`` (and a ``--data-mix`` run's sources): more held-out sets evaluated at every
evaluation beside ``eval_loss``, in each row's ``eval_losses`` by path -- the same number
asyncpp-eval gives for that file, a pipeline's equal to its simulation's."""
import json
import math

import numpy as np
import pytest

from asyncpp_ext.eval import main as evaluate
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.tensorboard_log import row_scalars

COMMON = ["--model", "tiny", "--no-progress", "--threads", "1", "--seq-len", "16", "--micro-batch-size", "2",
          "--microbatches", "2", "--eval-every", "2", "--eval-batches", "2", "--steps", "4"]


@pytest.fixture
def texts(tmp_path):
    rng = np.random.default_rng(1)
    for name, chars, n in (("train", "abcdefghij \n", 8000), ("code", "(){};=+0123", 3000), ("prose", "etaoin ,.", 3000)):
        (tmp_path / f"{name}.txt").write_text("".join(rng.choice(list(chars), size=n)))
    return {name: str(tmp_path / f"{name}.txt") for name in ("train", "code", "prose")}


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _named(rows):
    return [(r["step"], r["eval_losses"]) for r in rows if "eval_losses" in r]


def test_each_set_is_scored_at_each_evaluation_as_asyncpp_eval_scores_it(tmp_path, texts, capsys):
    sim, pipe = tmp_path / "sim", tmp_path / "pipe"
    sets = ["--eval-data", texts["code"], "--eval-data", texts["prose"]]
    assert train([*COMMON, "--data", texts["train"], *sets, "--simulate", "--out", str(sim)]) == 0
    assert train([*COMMON, "--data", texts["train"], *sets, "--stages", "2", "--timeout", "30",
                  "--out", str(pipe)]) == 0
    named = _named(_rows(sim))
    assert [step for step, _ in named] == [2, 4]
    assert all(list(losses) == ["code", "prose"] for _, losses in named)  # the files' short names
    assert named[0][1]["code"] != named[0][1]["prose"]
    assert _named(_rows(pipe)) == named  # exactly
    capsys.readouterr()
    assert evaluate([str(sim), "--data", texts["code"], "--json", str(tmp_path / "eval.json")]) == 0
    (row,) = json.loads((tmp_path / "eval.json").read_text())
    assert math.isclose(row["loss"], named[-1][1]["code"], rel_tol=1e-5)


def test_the_log_line_names_each_set(tmp_path, texts, capsys):
    run = tmp_path / "run"
    assert train([*COMMON, "--data", texts["train"], "--eval-data", texts["code"], "--simulate", "--out", str(run),
                  "--log-every", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{run}: step 4 eval_loss")]
    losses = dict(_named(_rows(run)))[4]
    assert len(lines) == 1 and lines[0].endswith(f"(code {losses['code']:.4f})"), lines


def test_a_mixture_scores_each_sources_held_out_part(tmp_path, texts):
    run = tmp_path / "run"
    mix = ["--data-mix", f"{texts['code']}=1", "--data-mix", f"{texts['prose']}=1"]
    assert train([*COMMON, *mix, "--eval-data", texts["train"], "--simulate", "--out", str(run)]) == 0
    (_, last), = _named(_rows(run))[-1:]
    assert list(last) == ["code", "prose", "train"]


def test_without_more_sets_rows_are_as_before(tmp_path, texts):
    run = tmp_path / "run"
    assert train([*COMMON, "--data", texts["train"], "--simulate", "--out", str(run)]) == 0
    assert not _named(_rows(run)) and any("eval_loss" in r for r in _rows(run))


def test_each_set_gets_a_tag():
    row = {"step": 3, "loss": 2.0, "eval_loss": 1.5, "eval_losses": {"a.bin": 1.25, "b.bin": None}}
    assert row_scalars(row) == {"train/loss": 2.0, "eval/loss": 1.5, "eval/loss/a.bin": 1.25}


@pytest.mark.parametrize("flags, words", [
    (["--eval-data", "{tmp}/none.txt"], "none.txt"),
    (["--eval-data", "{tmp}/train.txt"], "--eval-data {tmp}/train.txt and --data {tmp}/train.txt share 1 file(s)"),
    (["--eval-data", "{tmp}/code.txt", "--eval-data", "{tmp}/code.txt"], "names a set twice"),
])
@pytest.mark.parametrize("where", [["--simulate"], ["--stages", "2", "--timeout", "30"]], ids=["one", "pipeline"])
def test_bad_sets_are_one_line_and_write_nothing(tmp_path, texts, capsys, flags, words, where):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    out = tmp_path / "out"
    assert train([*COMMON, "--data", texts["train"], *where, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.replace("{tmp}", str(tmp_path)) in err[0], err
    assert not out.exists()


def test_sets_are_named_by_their_files():
    from asyncpp_ext.training.build import set_names

    assert set_names(["data/web/*.bin", "val/code.bin", "d/fw.val.manifest.json", "x/prose.txt", "shards/"]) == [
        "web", "code", "fw.val", "prose", "shards"]
    assert set_names(["a/val.bin", "b/val.bin"]) == ["a/val.bin", "b/val.bin"]  # one name for two: the paths


def test_asyncpp_eval_scores_a_runs_sets_as_its_rows_hold_them(tmp_path, texts, capsys):
    run = tmp_path / "run"
    mix = ["--data-mix", f"{texts['code']}=1", "--data-mix", f"{texts['prose']}=1"]
    assert train([*COMMON, *mix, "--eval-data", texts["train"], "--simulate", "--out", str(run)]) == 0
    assert evaluate([str(run), "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    last = [r for r in _rows(run) if "eval_loss" in r][-1]
    assert [r["data"] for r in rows[1:]] == ["code", "prose", "train"]
    assert math.isclose(rows[0]["loss"], last["eval_loss"], rel_tol=1e-5)
    for row in rows[1:]:
        assert math.isclose(row["loss"], last["eval_losses"][row["data"]], rel_tol=1e-5), row["data"]
    assert "data: each row's column" in capsys.readouterr().out


def test_asyncpp_eval_scores_a_small_eval_data_file_as_the_run_did(tmp_path, texts, capsys):
    # 60 tokens hold 44 windows of 16 + 1: 22 batches of 2, fewer than the run's --eval-batches 30.
    # The run scores one pass over them; asyncpp-eval --data, counting the run's 30, does the same,
    # and a --batches of its own past one pass is refused naming --batches.
    small = tmp_path / "small.txt"
    small.write_text(open(texts["code"]).read()[:60])
    run = tmp_path / "run"
    flags = [*COMMON, "--eval-batches", "30", "--data", texts["train"], "--eval-data", str(small), "--simulate"]
    assert train([*flags, "--out", str(run)]) == 0
    logged = _named(_rows(run))[-1][1]["small"]
    capsys.readouterr()
    assert evaluate([str(run), "--data", str(small), "--json", str(tmp_path / "eval.json")]) == 0
    (row,) = json.loads((tmp_path / "eval.json").read_text())
    assert math.isclose(row["loss"], logged, rel_tol=1e-5) and row["tokens"] == 22 * 2 * 16
    capsys.readouterr()
    assert evaluate([str(run), "--data", str(small), "--batches", "30"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the table starts
    assert "--batches 30 needs 60 windows but the eval split has 44 distinct ones; pass --batches 22 or fewer" in err
    assert "--eval-batches" not in err and "--val-data" not in err and err.count("\n") == 1, err
