"""pipedream (weight stashing, per-stage delay S-1-s) over real processes equals the simulator and
resumes bitwise; --delay K is the simulator's constant delay; bad combinations are one line, exit 2."""
import json

import pytest

from asyncpp_ext.training.cli import main

GPT = ["--model", "tiny", "--seq-len", "16", "--no-progress", "--threads", "1", "--eval-every", "0"]
PIPEDREAM = ["--schedule", "pipedream", "--microbatches", "1", "--micro-batch-size", "4"]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", [["--optimizer", "adamw"], ["--optimizer", "muon", "--ef-beta", "0.5"]])
def test_real_pipedream_equals_the_simulator(tmp_path, optimizer):
    flags = GPT + PIPEDREAM + optimizer + ["--stages", "3", "--steps", "10"]
    assert main(flags + ["--out", str(tmp_path / "real")]) == 0
    assert main(flags + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    real, sim = _losses(tmp_path / "real"), _losses(tmp_path / "sim")
    assert real == sim  # equal thread counts: the same arithmetic (rel <= 1e-5 is the promise)
    assert main(GPT + optimizer + ["--schedule", "2bw", "--microbatches", "1", "--micro-batch-size", "4",
                                   "--stages", "1", "--steps", "10", "--simulate", "--out", str(tmp_path / "2bw")]) == 0
    assert _losses(tmp_path / "2bw")[3:] != real[3:]  # stage 0's two-step delay is real


@pytest.mark.multiproc
def test_pipedream_takes_its_one_microbatch_without_being_told(tmp_path):
    flags = GPT + ["--schedule", "pipedream", "--micro-batch-size", "4", "--stages", "2", "--steps", "2", "--simulate"]
    assert main(flags + ["--out", str(tmp_path / "r")]) == 0
    assert json.loads((tmp_path / "r" / "config.json").read_text())["pipeline"]["microbatches"] == 1


def test_pipedream_resume_mid_run_is_bitwise(tmp_path):
    flags = GPT + PIPEDREAM + ["--optimizer", "muon", "--stages", "3", "--ckpt-every", "4"]
    assert main(flags + ["--steps", "8", "--out", str(tmp_path / "full")]) == 0
    assert main(flags + ["--steps", "4", "--out", str(tmp_path / "part")]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--steps", "8", "--no-progress"]) == 0
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")


def test_delay_one_is_2bw_and_delay_two_differs(tmp_path):
    flags = GPT + ["--schedule", "2bw", "--simulate", "--steps", "6", "--micro-batch-size", "2"]
    assert main(flags + ["--out", str(tmp_path / "2bw")]) == 0
    assert main(flags + ["--delay", "1", "--out", str(tmp_path / "d1")]) == 0
    assert main(flags + ["--delay", "2", "--out", str(tmp_path / "d2")]) == 0
    assert _losses(tmp_path / "d1") == _losses(tmp_path / "2bw")
    d2, two_bw = _losses(tmp_path / "d2"), _losses(tmp_path / "2bw")
    assert d2[:2] == two_bw[:2]  # steps 0 and 1 compute on W(0) under both rules
    assert d2[2] != two_bw[2]    # step 2: W(0) with K = 2, W(1) with K = 1


@pytest.mark.parametrize("argv,words", [
    (PIPEDREAM[:2] + ["--microbatches", "2", "--stages", "2"], ["--microbatches", "pipedream"]),
    (["--schedule", "1f1b", "--delay", "2", "--simulate"], ["--delay", "2bw"]),
    (["--schedule", "2bw", "--delay", "2", "--stages", "2"], ["--delay", "real"]),
    (["--schedule", "2bw", "--delay", "0", "--simulate"], ["--delay", "positive"]),
    (["--schedule", "2bw", "--delay", "-1", "--simulate"], ["--delay", "positive"]),
    (PIPEDREAM + ["--stages", "2", "--clip-grad-norm", "1"], ["clip", "pipedream"]),
    (["--model", "llama-tiny"] + PIPEDREAM + ["--stages", "2"], ["tie", "pipedream"]),
])
def test_bad_delay_combinations_are_one_line(tmp_path, capsys, argv, words):
    out = tmp_path / "out"
    assert main(argv + ["--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("asyncpp-train: error:"), err
    for word in words:
        assert word in err, err
    assert not out.exists()
