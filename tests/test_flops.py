"""Model FLOPs per token (models/flops.py) and the TFLOP/s and MFU a run writes (training/
utilisation.py): N counted from the model equals the bench's arithmetic on the SmolLM shapes, tied or
untied, before and after a pipeline unties a tie; each metrics row's tflops is its tokens/s times
6N + 12LCT; the MFU divides by the devices' peak; the summary line shows both."""
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asyncpp_ext.models import flops
from asyncpp_ext.models.registry import build_model, model_config
from asyncpp_ext.pipeline.partition import as_blocks
from asyncpp_ext.pipeline.ties import find_ties, untie
from asyncpp_ext.training import utilisation
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config import RunConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import throughput_model as bench  # noqa: E402


def _meta(name, **overrides):
    with torch.device("meta"):
        return build_model(model_config(name, **overrides))


@pytest.mark.parametrize("name", ["smollm-135m", "smollm-360m"])
@pytest.mark.parametrize("tied", [True, False])
def test_n_counted_from_the_model_is_the_bench_arithmetic(name, tied):
    model = _meta(name, tie_embeddings=tied)
    shape = dict(bench.model_shape(name, 2048), tie_embeddings=tied)
    assert flops.matmul_params(model) == bench.matmul_params(shape)
    assert flops.flops_per_token(model, 2048) == bench.flops_per_token(shape, 2048)
    total = sum(p.numel() for p in model.parameters())
    assert total - flops.matmul_params(model) == (0 if tied else 49152 * model.config.n_embd)


def test_a_pipelines_untied_copies_count_once():
    model = build_model(model_config("llama-tiny"), seed=0)
    before = flops.matmul_params(model)
    blocks = as_blocks(model)
    untie(blocks, find_ties(model, blocks))  # the embedding and the head now hold equal copies
    assert model.embed.tok.weight is not model.head.proj.weight
    assert flops.matmul_params(model) == before


def test_the_gpt_leaves_out_its_token_and_position_tables():
    model = build_model(model_config("small"), seed=0)
    tables = model.embed.tok.weight.numel() + model.embed.pos.weight.numel()
    assert flops.matmul_params(model) == sum(p.numel() for p in model.parameters()) - tables
    c, layers = model.config.n_embd, model.config.n_layer
    assert flops.flops_per_token(model, 64) == 6 * flops.matmul_params(model) + 12 * layers * c * 64


_HF_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("config, width", [
    (dict(model_type="qwen3", head_dim=32, **_HF_SHAPE), 4 * 32),  # heads wider than hidden / heads
    (dict(model_type="llama", **_HF_SHAPE), 64),                      # no head_dim: hidden / heads each
    (dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64), 64)])
def test_the_attention_term_is_as_wide_as_the_query_heads(config, width):
    # The score and value products of T queries are (query heads x head width) wide: a Hugging Face
    # config's head_dim, not its hidden size, where it sets one.
    pytest.importorskip("transformers", reason="needs transformers (pip install 'asyncpp_ext[hf]')")
    from asyncpp_ext.models import hf

    model = hf.from_config(config, seed=0)
    assert model.attention_width == width
    assert flops.flops_per_token(model, 64) == 6 * flops.matmul_params(model) + 12 * 2 * width * 64


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("Tesla V100-SXM2-16GB", None), (None, None)])
def test_peaks_by_device_name(name, peak):
    assert flops.peak_tflops(name) == peak


def _cfg(**train):
    cfg = RunConfig()
    cfg.model = model_config("tiny")
    cfg.train = replace(cfg.train, **train)
    return cfg


def test_devices_in_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for var in ("RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = _cfg(device="cuda")
    cfg.pipeline = replace(cfg.pipeline, stages=4, dp=2)
    assert utilisation.devices_in_use(cfg) == 4  # 8 ranks spawned here share the 4 GPUs
    cfg.pipeline = replace(cfg.pipeline, stages=2, dp=1)
    assert utilisation.devices_in_use(cfg) == 2
    assert utilisation.devices_in_use(replace(cfg, train=replace(cfg.train, simulate=True))) == 1
    assert utilisation.devices_in_use(replace(cfg, train=replace(cfg.train, device="cpu"))) == 1
    # torchrun on 2 machines of 8 ranks and 4 GPUs each
    for var, value in (("RANK", "0"), ("MASTER_PORT", "29500"), ("LOCAL_WORLD_SIZE", "8"), ("WORLD_SIZE", "16")):
        monkeypatch.setenv(var, value)
    cfg.pipeline = replace(cfg.pipeline, stages=8, dp=2)
    assert utilisation.devices_in_use(cfg) == 8
    assert utilisation.devices_in_use(replace(cfg, train=replace(cfg.train, device="cpu"))) == 2


def test_step_figures():
    assert utilisation.step_figures(1000.0, 3e9, None) == {"tflops": 3.0}
    assert utilisation.step_figures(1000.0, 3e9, 12.0) == {"tflops": 3.0, "mfu": 0.25}
    assert utilisation.step_figures(None, 3e9, 12.0) == {} == utilisation.step_figures(1.0, None, 1.0)
    assert utilisation.step_figures(123456.0, 1e6, None) == {"tflops": 0.1235}  # 4 significant digits


@pytest.mark.parametrize("flags", [["--simulate"], ["--stages", "2"]])
def test_each_rows_tflops_is_its_tokens_per_s_times_the_models_flops(tmp_path, capsys, flags):
    out = tmp_path / "run"
    assert train(["--model", "tiny", "--seq-len", "32", *flags, "--steps", "4", "--no-progress",
                  "--eval-batches", "0", "--peak-tflops", "0.5", "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    model = build_model(model_config("tiny", seq_len=32), seed=0)
    n = sum(p.numel() for p in model.parameters()) - 256 * 32 - 32 * 32  # less the token and position tables
    per_token = 6 * n + 12 * 2 * 32 * 32
    for row in rows:
        assert row["tflops"] == pytest.approx(row["tokens_per_s"] * per_token / 1e12, rel=1e-3)
        assert row["mfu"] == pytest.approx(row["tflops"] / 0.5, rel=1e-3)  # one CPU machine: one device
    rate = (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])
    shown = re.search(r", ([\d.e+-]+) TFLOP/s, MFU ([\d.]+)%", summary)
    assert shown, summary
    # shown to 3 significant digits (TFLOP/s) and 0.1 % (MFU), from rows' figures kept to 4
    assert float(shown[1]) == pytest.approx(rate * per_token / 1e12, rel=6e-3)
    assert float(shown[2]) == pytest.approx(100 * rate * per_token / 1e12 / 0.5, rel=1e-3, abs=0.051)


def test_without_a_peak_a_cpu_run_writes_tflops_only(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(["--model", "tiny", "--simulate", "--steps", "3", "--no-progress", "--eval-batches", "0",
                  "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("tflops" in r and "mfu" not in r for r in rows)
    assert "TFLOP/s" in summary and "MFU" not in summary


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_bad_peak_is_one_line(tmp_path, capsys, value):
    assert train(["--peak-tflops", value, "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--peak-tflops" in err and "train.peak_tflops" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.cuda
def test_a_gpu_run_writes_its_mfu_against_the_gpus_peak(tmp_path, capsys):
    """On a GPU the table knows (H100, H200, A100): every row's mfu is its tflops over the peak of
    torch.cuda.get_device_name (one GPU); on another GPU no mfu is written."""
    out = tmp_path / "run"
    assert train(["--model", "llama-tiny", "--device", "cuda", "--simulate", "--steps", "4", "--no-progress",
                  "--eval-batches", "0", "--no-compile", "--out", str(out)]) == 0
    peak = flops.peak_tflops(torch.cuda.get_device_name(0))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["tflops"] > 0
        if peak is None:
            assert "mfu" not in row
        else:
            assert row["mfu"] == pytest.approx(row["tflops"] / peak, rel=1e-3)
    assert ("MFU" in capsys.readouterr().out.strip().splitlines()[-1]) == (peak is not None)
