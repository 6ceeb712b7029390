"""The example training script keeps running, launched plainly and under torchrun, with the same
numbers both ways."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt_pipeline.py"
ARGS = ["--model", "tiny", "--steps", "20", "--micro-batch-size", "4"]


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    losses = [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.]+)", r.stdout, re.M)]
    evals = re.findall(r"^eval loss ([0-9.]+) after 20 steps$", r.stdout, re.M)
    return losses, evals


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The script run plainly once for this file's tests: its losses, its evaluation loss, and the
    directory it exported the trained model to (None without safetensors, which --export needs)."""
    export = tmp_path_factory.mktemp("example") / "gpt-hf" if importlib.util.find_spec("safetensors") else None
    losses, evals = _run([sys.executable, str(SCRIPT), *ARGS, *(["--export", str(export)] if export else [])])
    return losses, evals, export


def test_example_trains_and_torchrun_gives_the_same_numbers(plain_run, free_port):
    under_torchrun = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port), str(SCRIPT), *ARGS])
    losses, evals, _ = plain_run
    assert len(losses) == 2 and len(evals) == 1
    assert losses[1] < losses[0] < 5.6  # it learns (random init: ln 256 = 5.55)
    assert under_torchrun == (losses, evals)


def test_bad_arguments_are_one_line_before_any_rank_starts():
    """--stages 0 started no rank and exited 0 silently; --steps -1 came back from a rank as a
    LaunchError traceback seconds later."""
    for argv, words in ((["--stages", "0"], "--stages must be >= 1, got 0"),
                        (["--steps", "-1"], "--steps must be >= 1, got -1"),
                        (["--text", "/no/such/file.txt"], "--text /no/such/file.txt is not a file")):
        r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and lines[-1] == f"train_gpt_pipeline.py: error: {words}" + (
            "; pass a UTF-8 text file or 'builtin'" if argv[0] == "--text" else ""), r.stderr


def test_ctrl_c_mid_run_is_one_line_per_process_and_exit_130():
    """A terminal's Ctrl-C (SIGINT to the process group) once the first losses are out: every rank
    and the script say "interrupted", no traceback, no abort at exit."""
    import signal

    from group_signals import ctrl_c, sigint_by_default

    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_by_default)

    def first_losses():
        assert proc.stdout.readline().startswith("step ")

    err = ctrl_c(proc, first_losses)
    assert proc.returncode == 128 + signal.SIGINT, err
    lines = err.strip().splitlines()
    assert sorted(lines[:-1]) == ["asyncpp: rank 0: interrupted", "asyncpp: rank 1: interrupted"], err
    assert lines[-1] == "train_gpt_pipeline.py: interrupted", err


def test_the_exported_model_has_the_scripts_eval_loss_in_transformers(plain_run):
    """--export gathers every stage's weights on rank 0 (Pipeline.gather_weights) and writes them as
    a GPT2LMHeadModel: transformers' loss on the script's held-out batches is the one it printed."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install 'asyncpp_ext[hf]'")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    import torch
    import torch.nn.functional as F

    from asyncpp_ext.data import eval_batches, load_tokens, split_tokens
    from asyncpp_ext.models import preset_config

    _, evals, out = plain_run
    printed = float(evals[0])
    config = preset_config("tiny")
    _, eval_tokens = split_tokens(load_tokens("builtin", config.vocab_size), 0.1, 4, config.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
                  for x, y in eval_batches(eval_tokens, 4, config.seq_len, count=4)]
    assert sum(losses) / len(losses) == pytest.approx(printed, abs=1.5e-4)
    assert printed < 5.0  # trained: random init gives ln 256 = 5.55
