"""``--tokens N``: a run's length as a token budget, the steps that reach it at the run's tokens per
step (microbatches x global micro-batch x seq_len), rounded up."""
import argparse
import json

import pytest

from asyncpp_ext.training.arguments import token_count
from asyncpp_ext.training.cli import main as train

FLAGS = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--microbatches", "2",
         "--eval-every", "0", "--no-checkpoints", "--no-progress", "--threads", "1", "--simulate"]


@pytest.mark.parametrize("text, count", [("1000", 1000), ("1K", 1000), ("2.5B", 2_500_000_000), ("0.3m", 300_000),
                                         ("1T", 10**12), ("1e3", 1000), ("999.5", 1000)])
def test_counts_and_suffixes(text, count):
    assert token_count(text) == count


@pytest.mark.parametrize("text", ["0", "-5", "x", "1.5x", "", "nan", "infB"])
def test_bad_counts(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a token count >= 1"):
        token_count(text)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra, tokens_per_step", [([], 2 * 2 * 32), (["--microbatches", "3"], 3 * 2 * 32),
                                                    (["--dp", "2", "--micro-batch-size", "1"], 2 * 2 * 32)])
def test_the_run_trains_the_steps_that_reach_the_budget(tmp_path, capsys, extra, tokens_per_step):
    run = tmp_path / "run"
    assert train([*FLAGS, *extra, "--tokens", "1K", "--out", str(run)]) == 0
    steps = -(-1000 // tokens_per_step)
    rows = _rows(run)
    assert rows[-1]["step"] == steps and rows[-1]["tokens"] == steps * tokens_per_step >= 1000
    assert rows[-1]["tokens"] - tokens_per_step < 1000  # one step fewer would not reach it
    assert f"--tokens 1,000: {steps:,} steps of {tokens_per_step:,} tokens" in capsys.readouterr().err


def test_a_resume_extends_to_a_larger_budget(tmp_path):
    run = tmp_path / "run"
    flags = [f for f in FLAGS if f != "--no-checkpoints"]
    assert train([*flags, "--tokens", "512", "--out", str(run)]) == 0
    assert train([*flags, "--tokens", "1K", "--resume", str(run)]) == 0
    assert [r["step"] for r in _rows(run)] == list(range(1, 9))


def test_a_decaying_schedules_resume_names_the_budget_that_matches(tmp_path, capsys):
    """wsd places its decay by the run's length: a resume under another budget is one line naming
    the --steps and the --tokens that resume it (a --tokens run's user cannot add --steps), and the
    --tokens named resumes."""
    run = tmp_path / "run"
    flags = [f for f in FLAGS if f != "--no-checkpoints"] + ["--lr-schedule", "wsd", "--ckpt-every", "2"]
    assert train([*flags, "--tokens", "1K", "--out", str(run)]) == 0  # 8 steps of 128
    capsys.readouterr()
    assert train([*flags, "--tokens", "2K", "--resume", str(run), "--rewind", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("resume with --steps 8 (or --tokens 1024, the same steps)"), err
    assert train([*flags, "--tokens", "1024", "--resume", str(run), "--rewind", "4"]) == 0


def test_steps_and_tokens_together_are_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert train([*FLAGS, "--steps", "3", "--tokens", "1K", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 3 and --tokens 1000 both say how long to train" in err[0], err
    assert not out.exists()
