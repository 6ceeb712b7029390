"""bench/paper_study.py at its scales (bench/study_scales.py): the cpu-long ef table's rows and
length, the gpu scale refused without a GPU and run end to end at a tiny size on the CPU (the same
code path: corpus built on the machine, Llama model, cosine schedule, epoch sampling, bf16), the
trend over training length, and the corpus builder (bench/study_corpus.py)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bench_loader import load_bench_script

BENCH = Path(__file__).resolve().parent.parent / "bench"
PACKAGE = Path(__file__).resolve().parent.parent / "asyncpp_ext"
if str(BENCH) not in sys.path:  # study_corpus and the modules paper_study imports
    sys.path.insert(0, str(BENCH))

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def study():
    return load_bench_script("paper_study")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A study corpus of this package's own sources (a few hundred kB), 512 BPE ids."""
    from study_corpus import ensure_corpus

    return ensure_corpus(tmp_path_factory.mktemp("corpus"), 512, roots=[PACKAGE / "data", PACKAGE / "schedule"])


# The gpu scale's config with a model small enough for a CPU test: only sizes change.
TINY_GPU = ["--device", "cpu", "--set", "model.vocab_size=512", "--set", "model.n_layer=2", "--set",
            "model.n_embd=32", "--set", "model.n_head=4", "--set", "model.n_kv_head=2", "--set",
            "model.intermediate_size=64", "--set", "model.seq_len=32", "--steps", "4", "--eval-every", "2",
            "--micro-batch-size", "2", "--eval-batches", "1", "--workers", "1", "--threads", "1"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_gpu_scale_is_refused_without_a_gpu(study, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(study, "run_pool", lambda *a, **k: pytest.fail("a run started"))
    assert study.main(["ef", "--scale", "gpu"]) == 2
    line = _one_error_line(capsys)
    assert "--scale gpu trains on a CUDA GPU" in line and "--scale cpu" in line
    assert study.main(["ef", "--device", "cuda"]) == 2  # the flag the user gave is the one named
    line = _one_error_line(capsys)
    assert "--device cuda trains on a CUDA GPU" in line and "use --device cpu" in line


@pytest.mark.parametrize("argv, message", [
    (["optimizers", "--scale", "cpu-long"], "--scale cpu-long defines the ef table(s), not optimizers"),
    (["momentum", "--scale", "gpu", "--device", "cpu"], "--scale gpu defines the optimizers, ef, mitigations"),
    (["ef", "--scale", "cpu-long", "--full"], "--full is the longer cpu setting"),
])
def test_a_table_or_option_a_scale_does_not_define_is_one_line(study, capsys, argv, message):
    assert study.main(argv) == 2
    assert message in _one_error_line(capsys)


def test_cpu_long_is_the_ef_table_ten_times_longer(study):
    a = study.parse_args(["ef", "--scale", "cpu-long"])
    assert (a.steps, a.eval_every, a.seeds, a.model, a.device) == (1200, 100, 3, "small", "cpu")
    assert a.steps == 10 * study.TABLES["ef"].steps
    labels = [s.label for s in study.table_settings(a.table, a.optimizers, a.full, a.ef_rows)]
    assert labels == ["muon sync", "muon 2bw", "muon 2bw+ef0.5 buffer", "muon 2bw+ef1 buffer",
                      "muon 2bw+ef1.5 buffer", "muon 2bw+ef0.5 weights", "muon 2bw+ef1 weights"]
    # The default scale is unchanged: every beta x source.
    cpu = study.parse_args(["ef"])
    assert (cpu.steps, cpu.ef_rows) == (120, None)
    assert len(study.table_settings("ef", ("muon",), False)) == 2 + 8


def test_gpu_scale_config(study):
    a = study.parse_args(["ef", "--scale", "gpu", "--device", "cpu"])
    assert a.data == "corpus" and a.model == "llama-tiny" and a.seeds == 2
    o = a.overrides
    assert o["optim.lr_schedule"] == "cosine" and o["optim.warmup_steps"] == round(0.05 * a.steps)
    assert o["data.sampling"] == "epoch" and o["train.dtype"] == "bf16" and o["model.seq_len"] == 512
    assert "train.device" not in o  # --device cpu: the runs' default device
    cfg = study.build_config({"model": a.model, "n_layer": None, "data": "builtin", "steps": a.steps,
                              "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size,
                              "eval_every": a.eval_every, "eval_batches": a.eval_batches}, "2bw", 0, o)
    assert cfg.model.arch == "llama" and cfg.model.vocab_size == 16384 and cfg.model.tie_embeddings
    assert 50e6 < study.count_parameters(cfg) < 70e6  # the paper-scale range starts at 50M


def test_gpu_scale_end_to_end_at_a_tiny_size_on_cpu(study, corpus, capsys, tmp_path):
    folder = str(Path(corpus["path"]).parent)
    plot = tmp_path / "optimizers.png"
    assert study.main(["optimizers", "--scale", "gpu", "--optimizers", "adamw,muon", "--corpus-dir", folder,
                       *TINY_GPU, "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["setup"]
    assert (s["scale"], s["device"], s["lr_schedule"], s["warmup_steps"], s["seeds"]) == ("gpu", "cpu", "cosine", 1, 2)
    assert s["data"] == corpus["path"] and s["corpus"]["train_tokens"] == corpus["train_tokens"]
    assert s["tokens_per_step"] == 4 * 2 * 32 and s["tokens_per_run"] == 4 * s["tokens_per_step"]
    assert [x["label"] for x in out["settings"]] == [f"{o} {v}" for o in ("adamw", "muon")
                                                     for v in ("sync", "2bw", "2bw+ef0.5")]
    assert len(out["runs"]) == 12 and all(len(r["train_losses"]) == 4 for r in out["runs"])
    assert [p["step"] for p in out["trend"]] == [2, 4]
    last = out["trend"][-1]["rows"]
    for label, row in out["summary"].items():  # the last trend point is the table itself
        if row["role"] != "sync":
            assert last[label]["gap"] == pytest.approx(row["gap"])
    assert set(out["flattening"]) == {"adamw", "muon"} and plot.stat().st_size > 0


def test_trend_at_step_k_is_the_table_of_a_k_step_run(study, capsys):
    """Constant lr: a run's eval at step k is what a k-step run ends with (same seed, same batches),
    so the trend is the table at each shorter length."""
    tiny = ["--model", "tiny", "--seeds", "1", "--eval-batches", "1", "--workers", "1", "--optimizers", "muon",
            "--json"]
    assert study.main(["optimizers", "--steps", "6", "--eval-every", "3", *tiny]) == 0
    long = json.loads(capsys.readouterr().out)
    assert study.main(["optimizers", "--steps", "3", *tiny]) == 0
    short = json.loads(capsys.readouterr().out)
    at3 = next(p for p in long["trend"] if p["step"] == 3)["rows"]
    for label, row in short["summary"].items():
        if row["role"] != "sync":
            assert at3[label]["gap"][0] == row["gap"][0]
            assert at3[label]["recovered"] == row["recovered"]


def test_corpus_builder_dedupes_orders_and_reuses(tmp_path):
    from study_corpus import ensure_corpus, find_documents

    root = tmp_path / "site"
    (root / "pkg").mkdir(parents=True)
    texts = [f"def f{i}(x):\n    return x * {i}  # document {i}\n" * (i + 1) for i in range(12)]
    for i, text in enumerate(texts):
        (root / "pkg" / f"m{i}.py").write_text(text)
    (root / "pkg" / "copy.py").write_text(texts[0])  # a duplicate: read once
    (root / "pkg" / "data.bin").write_bytes(b"\xff\xfe")  # neither a document suffix nor UTF-8
    (root / "pkg" / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: left out
    found = find_documents([root], 1 << 20)
    assert len(found) == 12 and found == find_documents([root], 1 << 20)
    assert sorted(p.read_text() for p in found) == sorted(texts)
    info = ensure_corpus(tmp_path / "out", 300, roots=[root], workers=1)
    assert info["documents"] == 12 and info["vocab"] == 300
    tokens = np.fromfile(info["path"], dtype=np.uint16)
    from tokenizers import Tokenizer

    eot = Tokenizer.from_file(info["tokenizer"]).token_to_id("<|endoftext|>")
    assert int((tokens == eot).sum()) == 12 and tokens[-1] == eot  # one end-of-text after each document
    again = ensure_corpus(tmp_path / "out", 300, roots=[root])
    assert again == info  # found, not rebuilt
