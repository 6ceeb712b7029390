"""asyncpp-train on real pretraining inputs: Llama and Hugging Face models (tied embeddings) over
real processes equal --simulate; LR schedules and clipping resume bitwise mid-warmup and mid-decay;
every bad input is one line, exit 2, nothing written."""
import importlib.util
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from asyncpp_ext.optim.lr_schedule import LRSchedule
from asyncpp_ext.training.checkpoint import load_checkpoint
from asyncpp_ext.training.cli import main

COMMON = ["--micro-batch-size", "2", "--seq-len", "16", "--no-progress", "--threads", "1",
          "--optimizer", "muon", "--eval-every", "0"]
LLAMA_HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
GPT2_HF = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
           "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.multiproc
@pytest.mark.parametrize("source,stages,layout", [
    ("llama-tiny", 2, []), ("hf-llama", 2, []), ("hf-gpt2", 2, []),
    # The tied embedding/head pair across stages under the flushing schedules and under PP x DP
    # (4 ranks: the tie's gradient is summed across stages and averaged across replicas).
    ("llama-tiny", 2, ["--schedule", "1f1b"]), ("llama-tiny", 2, ["--schedule", "gpipe"]),
    ("llama-tiny", 2, ["--dp", "2"])], ids=["llama-2bw", "hf-llama-2bw", "hf-gpt2-2bw", "llama-1f1b",
                                              "llama-gpipe", "llama-2bw-ppxdp"])
def test_real_processes_equal_the_simulation(tmp_path, source, stages, layout):
    if source.startswith("hf-"):
        pytest.importorskip("transformers")
        config = tmp_path / "config.json"
        config.write_text(json.dumps(LLAMA_HF if source == "hf-llama" else GPT2_HF))
        model = ["--hf-config", str(config)]
    else:
        model = ["--model", source]
    flags = model + COMMON + ["--stages", str(stages), "--microbatches", str(stages), "--steps", "8", *layout]
    assert main(flags + ["--out", str(tmp_path / "real")]) == 0
    assert main(flags + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    real, sim = ([r["loss"] for r in _rows(tmp_path / run)] for run in ("real", "sim"))
    # measured: 0 with one replica (equal thread counts give the same bits); with --dp 2 each
    # replica averages its own sequences first, moving the last bits (test_scale_out: 2e-8)
    assert _rel(real, sim) <= (1e-6 if "--dp" in layout else 1e-5)
    assert real[-1] < real[0]
    shards = load_checkpoint(tmp_path / "real" / "ckpt-000008")[1]
    names = [n for s in shards for n in s["engine"]["params"]]
    assert len(names) == len(set(names))  # the tied tensor once, under its owner's name
    config_json = json.loads((tmp_path / "real" / "config.json").read_text())
    assert config_json["model"]["arch"] == ("llama" if source == "llama-tiny" else "hf")


def test_lr_column_is_the_closed_form_at_every_step(tmp_path):
    flags = ["--model", "llama-tiny", *COMMON, "--simulate", "--steps", "12", "--lr", "0.02",
             "--lr-schedule", "cosine", "--warmup-steps", "3", "--min-lr-ratio", "0.1"]
    assert main(flags + ["--out", str(tmp_path / "run")]) == 0
    rows = _rows(tmp_path / "run")
    for row in rows:
        t = row["step"] - 1  # the update that made this row's step
        want = (t + 1) / 3 if t < 3 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 3) / 9))
        assert row["lr"] == pytest.approx(0.02 * want, rel=1e-12)
        assert row["tokens_per_s"] > 0


@pytest.mark.multiproc
def test_resume_mid_warmup_and_mid_decay_is_bitwise(tmp_path):
    """wsd over 8 steps: warmup 1..3, decay 6..8; checkpoints at 2 (mid-warmup) and 6 (mid-decay);
    2 stages with a tied llama and clipping by the previous step's norm (a state to resume too)."""
    flags = ["--model", "llama-tiny", *COMMON, "--stages", "2", "--microbatches", "2", "--steps", "8",
             "--lr-schedule", "wsd", "--warmup-steps", "3", "--decay-steps", "3", "--clip-grad-norm", "0.5",
             "--ckpt-every", "2"]
    assert main(flags + ["--out", str(tmp_path / "full")]) == 0
    full = _rows(tmp_path / "full")
    lrs = [r["lr"] for r in full]
    assert lrs[0] < lrs[1] < lrs[2] == lrs[4] > lrs[5] > lrs[6] > lrs[7]  # warmup, stable, decay
    for resume_at in (2, 6):
        part = tmp_path / f"from{resume_at}"
        shutil.copytree(tmp_path / "full", part)
        for ckpt in part.glob("ckpt-*"):
            if int(ckpt.name.split("-")[1]) > resume_at:
                shutil.rmtree(ckpt)
        # The run as it stood at the checkpoint: the rows after it must come from resuming.
        rows = (part / "metrics.jsonl").read_text().splitlines()
        (part / "metrics.jsonl").write_text("\n".join(rows[:resume_at]) + "\n")
        assert main(["--resume", str(part), "--no-progress"]) == 0
        rows = _rows(part)
        assert [r["step"] for r in rows] == list(range(1, 9))
        assert [r["loss"] for r in rows] == [r["loss"] for r in full], resume_at


def _fails_cleanly(capsys, argv, out, *words):
    assert main(argv + ["--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("asyncpp-train: error:"), err
    for word in words:
        assert word in err, err
    assert not out.exists()  # nothing written


def test_bad_model_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "missing.json")], out, "missing.json", "does not exist")
    (tmp_path / "bad.json").write_text("{not json")
    _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "bad.json")], out, "not valid JSON")
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 256}))
    _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "bert.json")], out, "bert", "llama")
    if importlib.util.find_spec("transformers") is not None:  # sizes left to transformers' defaults (7B)
        (tmp_path / "bare.json").write_text(json.dumps({"model_type": "llama"}))
        _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "bare.json")], out,
                       "gives no vocab_size, hidden_size, num_hidden_layers, num_attention_heads")
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA_HF))
    _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "llama.json"), "--model", "tiny"], out, "only one")
    if importlib.util.find_spec("transformers") is not None:  # else the missing package is the one line
        _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "llama.json"), "--n-layer", "3"], out, "--n-layer")
    _fails_cleanly(capsys, ["--hf-model", str(tmp_path)], out, "config.json")


def test_bad_schedule_clipping_and_data_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    _fails_cleanly(capsys, ["--steps", "5", "--warmup-steps", "6"], out, "--warmup-steps")
    _fails_cleanly(capsys, ["--lr-schedule", "step"], out, "--lr-schedule")
    _fails_cleanly(capsys, ["--clip-grad-norm", "-1"], out, "--clip-grad-norm")
    _fails_cleanly(capsys, ["--lr-schedule", "cosine", "--decay-steps", "3"], out, "--decay-steps")
    tokens = tmp_path / "ids.bin"
    (torch.arange(4000, dtype=torch.int32) % 300).to(torch.int16).numpy().tofile(tokens)
    _fails_cleanly(capsys, ["--data", str(tokens)], out, "299", "vocab")  # ids up to 299, vocabulary 256
    (tmp_path / "ids.bin.json").write_text(json.dumps({"format": "asyncpp-tokens", "version": 1, "dtype": "uint32",
                                                      "num_tokens": 4000, "vocab_size": 300, "max_token_id": 299}))
    _fails_cleanly(capsys, ["--data", str(tokens), "--vocab-size", "300"], out, "ids.bin")


def _refused_without(module: str, argv: list, extra: str, out) -> None:
    """asyncpp-train in a fresh process where ``module`` cannot be imported: exit 2, one line naming
    the extra to install, nothing written."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from asyncpp_ext.training.cli import main\n"
            f"sys.exit(main({argv + ['--out', str(out)]!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"pip install 'asyncpp_ext[{extra}]'" in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert not out.exists()


def test_missing_transformers_names_the_extra(tmp_path):
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA_HF))
    _refused_without("transformers", ["--hf-config", str(tmp_path / "llama.json")], "hf", tmp_path / "o")


def test_hf_models_that_cannot_run_are_refused_before_any_rank_starts(tmp_path, capsys):
    """A config transformers accepts but whose layers cannot run, a damaged weights file and weights
    of another shape: one line, exit 2, nothing written, for a pipeline run too (its ranks would
    otherwise find them after config.json was written)."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    pipe = ["--stages", "2", "--steps", "1"]
    uneven = {**LLAMA_HF, "num_key_value_heads": 3}  # 4 query heads cannot share 3 key/value heads
    (tmp_path / "uneven.json").write_text(json.dumps(uneven))
    _fails_cleanly(capsys, ["--hf-config", str(tmp_path / "uneven.json")] + pipe, out, "uneven.json",
                   "cannot run", "fix the config")
    with torch.random.fork_rng():
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{
            k: v for k, v in LLAMA_HF.items() if k != "model_type"}))
    model.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # transformers' progress bar
    weights = tmp_path / "model" / "model.safetensors"
    shutil.copytree(tmp_path / "model", tmp_path / "cut")
    with open(tmp_path / "cut" / "model.safetensors", "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    _fails_cleanly(capsys, ["--hf-model", str(tmp_path / "cut")] + pipe, out, "model.safetensors",
                   "cannot be read", "save_pretrained")
    shutil.copytree(tmp_path / "model", tmp_path / "wider")
    config = json.loads((tmp_path / "wider" / "config.json").read_text())
    (tmp_path / "wider" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    _fails_cleanly(capsys, ["--hf-model", str(tmp_path / "wider")] + pipe, out, "do not fit",
                   "mlp.up_proj.weight (64, 32) (config: (96, 32))")
    assert main(["--hf-model", str(tmp_path / "model"), "--steps", "1", "--schedule", "sync", "--simulate",
                 "--eval-every", "0", "--no-progress", "--out", str(out)]) == 0  # the intact model runs


def test_lr_schedule_values_used_by_the_cli_are_the_library_schedule():
    s = LRSchedule(kind="wsd", steps=12, warmup_steps=4, decay_steps=4)
    assert [s.multiplier(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.multiplier(11) == pytest.approx(s.min_lr_ratio)


def test_hf_model_dir_first_step_equals_transformers_forward_and_starts_from_its_weights(tmp_path):
    """--hf-model DIR, one stage, sync: the first step's loss is the transformers model's own loss on
    the same batch, and the run started from the directory's weights."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from asyncpp_ext.models import hf
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.build import build_data as run_data

    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{
            k: v for k, v in LLAMA_HF.items() if k != "model_type"}))
    model.save_pretrained(tmp_path / "model")
    flags = ["--hf-model", str(tmp_path / "model"), "--schedule", "sync", "--simulate", "--microbatches", "1",
             "--micro-batch-size", "2", "--seq-len", "16", "--steps", "1", "--eval-every", "0", "--no-progress",
             "--optimizer", "adamw"]
    assert main(flags + ["--out", str(tmp_path / "run")]) == 0
    cfg = RunConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    stream, _ = run_data(cfg)
    (x, y), = stream.minibatch(0)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    got = _rows(tmp_path / "run")[0]["loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)  # measured: equal (0.0)
    loaded = hf.from_pretrained(tmp_path / "model").hf_state_dict()
    for name, value in load_file(tmp_path / "model" / "model.safetensors").items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.multiproc
def test_tensorboard_gets_the_metrics_and_each_stages_shares(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["--model", "llama-tiny", *COMMON, "--stages", "2", "--microbatches", "2", "--steps", "6",
             "--eval-every", "3", "--tensorboard", "--out", str(tmp_path / "run")]
    assert main(flags) == 0
    root = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    root.Reload()
    rows = _rows(tmp_path / "run")
    assert [e.value for e in root.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows])
    assert [e.step for e in root.Scalars("eval/loss")] == [3, 6]
    assert [e.value for e in root.Scalars("train/lr")] == pytest.approx([r["lr"] for r in rows])
    assert len(root.Scalars("train/tokens_per_s")) == 6
    assert [e.value for e in root.Scalars("train/tflops")] == pytest.approx([r["tflops"] for r in rows], rel=1e-6)
    for stage in (0, 1):
        acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / f"stage{stage}"))
        acc.Reload()
        shares = [e.value for e in acc.Scalars(f"stage{stage}/compute_share")]
        waits = [e.value for e in acc.Scalars(f"stage{stage}/wait_share")]
        assert len(shares) == 2 and all(0 < c <= 1 for c in shares)  # one per segment (steps 1-3, 4-6)
        assert all(abs(c + w - 1) < 1e-6 for c, w in zip(shares, waits))  # event files hold float32


def test_missing_tensorboard_is_refused_before_the_run(tmp_path):
    _refused_without("torch.utils.tensorboard", ["--tensorboard", "--stages", "2"], "tensorboard", tmp_path / "o")
