"""``asyncpp-compare RUN [RUN ...]``: runs side by side from their metrics rows. Every figure is
checked against the rows themselves: the mean of the last N train losses, the last eval loss, the
steady tokens/s, the first evaluation at or below the target (by default the largest of the runs'
best eval losses) and the ratios to the first run; bad inputs are one line with nothing written."""
import json

import pytest

from asyncpp_ext.compare import main as compare
from asyncpp_ext.training.cli import main as train

FLAGS = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--microbatches", "2", "--steps", "12",
         "--eval-every", "3", "--eval-batches", "2", "--no-checkpoints", "--no-progress", "--threads", "1",
         "--simulate"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    for schedule in ("sync", "2bw"):
        assert train([*FLAGS, "--schedule", schedule, "--out", str(root / schedule)]) == 0
    return root


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_each_figure_is_the_metrics_rows(runs, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert compare([str(runs / "sync"), str(runs / "2bw"), "--last", "4", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    got = {r["run"]: r for r in json.loads(out.read_text())}
    metrics = {name: _rows(runs / name) for name in ("sync", "2bw")}
    best = {name: min(r["eval_loss"] for r in rows if "eval_loss" in r) for name, rows in metrics.items()}
    target = max(best.values())
    for name, rows in metrics.items():
        r = got[str(runs / name)]
        assert r["how"] == f"{name} 1st adamw+ef simulated"
        assert r["steps"] == 12 and r["tokens"] == rows[-1]["tokens"]
        assert r["train_loss"] == pytest.approx(sum(x["loss"] for x in rows[-4:]) / 4, rel=1e-12)
        assert r["eval_loss"] == rows[-1]["eval_loss"] and r["best_eval_loss"] == best[name]
        rate = (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])
        assert r["tokens_per_s"] == pytest.approx(rate, rel=1e-12)
        first = next(x for x in rows if x.get("eval_loss") is not None and x["eval_loss"] <= target)
        assert (r["target"], r["target_step"], r["target_elapsed_s"]) == (target, first["step"], first["elapsed_s"])
    base, other = got[str(runs / "sync")], got[str(runs / "2bw")]
    assert base["tokens_per_s_ratio"] == 1.0 and base["eval_loss_change"] == 0.0
    assert other["tokens_per_s_ratio"] == pytest.approx(other["tokens_per_s"] / base["tokens_per_s"])
    assert other["eval_loss_change"] == pytest.approx((other["eval_loss"] - base["eval_loss"]) / base["eval_loss"])
    assert other["target_time_ratio"] == pytest.approx(other["target_elapsed_s"] / base["target_elapsed_s"])
    assert f"time to eval loss {target:.4f}:" in table and "loss(last 4)" in table


def test_an_unreached_target_and_a_plot(runs, tmp_path, capsys):
    figure = tmp_path / "plots" / "cmp.png"
    assert compare([str(runs / "2bw"), str(runs / "sync"), "--target", "0.5", "--plot", str(figure)]) == 0
    out = capsys.readouterr().out
    assert out.count("not reached") == 2 and f"plot: {figure}" in out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_last_multiple_choice_scores_and_set_losses_side_by_side(runs, tmp_path, capsys):
    task = tmp_path / "quiz.jsonl"
    task.write_text(json.dumps({"context": "The cat sat on the", "endings": ["mat.", "hat", "x"], "label": 0}) + "\n")
    scored = tmp_path / "scored"
    held_out = tmp_path / "held.txt"
    held_out.write_text("Some held-out prose, not the built-in corpus, long enough for a few windows. " * 40)
    assert train([*FLAGS, "--eval-choices", str(task), "--eval-data", str(held_out), "--out", str(scored)]) == 0
    last = [r["choices"] for r in _rows(scored) if "choices" in r][-1]["quiz"]
    held = [r["eval_losses"] for r in _rows(scored) if "eval_losses" in r][-1]["held"]
    capsys.readouterr()
    out = tmp_path / "rows.json"
    assert compare([str(scored), str(runs / "sync"), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("quiz accuracy_norm"))
    assert line.endswith(f"{scored} {last['accuracy_norm']:.4f}, {runs / 'sync'} none")
    line = next(x for x in lines if x.startswith("eval_loss held (the last): "))
    assert line.endswith(f"{scored} {held:.4f}, {runs / 'sync'} none")
    row = json.loads(out.read_text())[0]
    assert row["choices"] == {"quiz": last} and row["eval_losses"] == {"held": held}


def test_a_run_without_evaluations_has_no_time_to_a_loss(tmp_path, capsys):
    run = tmp_path / "quiet"
    assert train([*FLAGS, "--eval-batches", "0", "--out", str(run)]) == 0
    capsys.readouterr()
    assert compare([str(run)]) == 0
    assert "a run without evaluations has none" in capsys.readouterr().out


@pytest.mark.parametrize("case, message", [
    ("not-a-run", "is not a run directory (no config.json)"),
    ("no-rows", "has no metrics.jsonl rows yet"),
    ("twice", "a run is named twice"),
    ("last", "--last 0: give a number of steps >= 1"),
    ("plot", "matplotlib cannot write .xyz files"),
    ("json", "its directory does not exist"),
    ("json-under-a-file", "is a file, not a directory"),
    ("json-a-directory", "is a directory; name a file such as"),
    ("damaged", "line 2 is not a metrics row"),
])
def test_bad_inputs_are_one_line_and_write_nothing(runs, tmp_path, capsys, case, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    if case in ("no-rows", "damaged"):
        (empty / "config.json").write_text((runs / "sync" / "config.json").read_text())
    if case == "damaged":  # a complete line that is no row: the file was edited or written over
        first = (runs / "sync" / "metrics.jsonl").read_text().splitlines()[0]
        (empty / "metrics.jsonl").write_text(first + '\n{"step": 2, "loss": \n')
    sync = str(runs / "sync")
    argv = {"not-a-run": [str(tmp_path)], "no-rows": [str(empty)], "twice": [sync, sync],
            "last": [sync, "--last", "0"], "plot": [sync, "--plot", str(tmp_path / "x.xyz")],
            "json": [sync, "--json", str(tmp_path / "missing" / "rows.json")], "damaged": [sync, str(empty)],
            "json-under-a-file": [sync, "--json", str(runs / "sync" / "config.json" / "rows.json")],
            "json-a-directory": [sync, "--json", str(empty)]}[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert compare([*argv, "--plot" if case != "plot" else "--json", str(tmp_path / "out.png" if case != "plot"
                                                                         else tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asyncpp-compare: error: ") and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
