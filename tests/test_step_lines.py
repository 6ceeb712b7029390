"""``--log-every N``: a line on stdout every N steps (its loss as metrics.jsonl has it, lr, tokens/s,
the time left) and each evaluation's loss, from one process of a pipeline only; none by default."""
import json
import re

import pytest

from asyncpp_ext.training.cli import main as train

FLAGS = ["--model", "tiny", "--seq-len", "16", "--steps", "20", "--eval-every", "10", "--no-checkpoints",
         "--no-progress", "--threads", "1"]


@pytest.mark.parametrize("flags", [["--simulate"], ["--stages", "2", "--timeout", "60"]],
                         ids=["one-process", "2-stage-pipeline"])
def test_a_line_every_n_steps_and_each_evaluation(tmp_path, capfd, flags):
    run = tmp_path / "run"
    assert train([*FLAGS, *flags, "--log-every", "5", "--out", str(run)]) == 0
    out = capfd.readouterr().out.splitlines()
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    steps = [line for line in out if re.match(rf"{re.escape(str(run))}: step \d+/20 ", line)]
    assert [int(re.search(r"step (\d+)/", s).group(1)) for s in steps] == [5, 10, 15, 20]
    for line in steps:
        step = int(re.search(r"step (\d+)/", line).group(1))
        assert f"loss {rows[step]['loss']:.4f} lr {rows[step]['lr']:.2e} | " in line and " tokens/s" in line, line
    assert steps[-1].endswith("ETA 0s")
    evals = [line for line in out if " eval_loss " in line and "/20" not in line and "(" not in line]
    assert evals == [f"{run}: step {s} eval_loss {rows[s]['eval_loss']:.4f}" for s in (10, 20)]


def test_no_lines_by_default(tmp_path, capsys):
    assert train([*FLAGS, "--simulate", "--out", str(tmp_path / "run")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # the summary


def test_a_negative_count_is_one_line(tmp_path, capsys):
    assert train([*FLAGS, "--simulate", "--log-every", "-1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--log-every" in err, err
