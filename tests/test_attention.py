"""--attention (models/attention.py): what each choice resolves to per device, the SDPA priority
it holds and gives back, a run holding it while it trains, the refusals; bench/attention_kernels.py
on CPU; and on a GPU that the kernel a run asks for is the one its profile shows."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from asyncpp_ext.models.attention import attention_preference, chosen_kernel, priority_order, resolve_attention
from asyncpp_ext.training.cli import main
from bench_loader import load_bench_script

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--simulate", "--no-progress", "--n-layer", "1", "--micro-batch-size", "2", "--microbatches", "2",
        "--eval-batches", "0", "--no-checkpoints"]


def _state():
    return (list(torch._C._get_sdp_priority_order()), torch.backends.cuda.cudnn_sdp_enabled(),
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled())


@pytest.mark.parametrize("capability, want", [((9, 0), "cudnn"), ((8, 0), "default"), ((10, 0), "default")])
def test_auto_is_cudnn_on_hopper_only(monkeypatch, capability, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_attention("auto", "cuda") == want
    assert resolve_attention("flash", "cuda") == "flash" and resolve_attention("cudnn", "cuda") == "cudnn"


def test_auto_without_a_cuda_runtime_to_ask_is_torchs_choice(monkeypatch):
    # the CPU suite's tests resolve the stage compute of cuda runs without a GPU to ask
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("asked"))
    assert resolve_attention("auto", "cuda") == "default"


def test_off_cuda_torch_chooses_and_an_explicit_kernel_is_refused():
    assert resolve_attention("auto", "cpu") == "default"
    for name in ("cudnn", "flash", "flex"):
        with pytest.raises(ValueError, match=f"^--attention {name} picks a CUDA attention kernel.*--device cuda"):
            resolve_attention(name, "cpu")
    with pytest.raises(ValueError, match="not one of auto, cudnn, flash, flex"):
        resolve_attention("fa3", "cuda")


def test_the_priority_lists():
    every = {SDPBackend(i) for i in torch._C._get_sdp_priority_order()}
    cudnn, flash = priority_order("cudnn"), priority_order("flash")
    assert cudnn[0] == SDPBackend.CUDNN_ATTENTION and set(cudnn) == every  # a preference: all enabled
    assert flash[0] == SDPBackend.FLASH_ATTENTION and set(flash) == every - {SDPBackend.CUDNN_ATTENTION}


def test_a_preference_is_held_then_given_back_even_after_an_error():
    before = _state()
    with attention_preference("cudnn"):
        assert torch._C._get_sdp_priority_order()[0] == SDPBackend.CUDNN_ATTENTION.value
        assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert _state() == before
    with pytest.raises(RuntimeError, match="inside"):
        with attention_preference("flash"):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch._C._get_sdp_priority_order()[0] == SDPBackend.FLASH_ATTENTION.value
            raise RuntimeError("inside")
    assert _state() == before
    with attention_preference("default"):
        assert _state() == before


def test_chosen_kernel_names_what_the_cpu_runs():
    q, kv = torch.randn(2, 6, 16, 8), torch.randn(2, 2, 16, 8)
    assert chosen_kernel(q, kv, kv, enable_gqa=True) in ("flash", "math")  # the CPU's two


def test_a_run_holds_its_preference_while_it_trains_and_gives_it_back(tmp_path, monkeypatch):
    """The one-process run trains inside the preference stage_compute resolved (here made "cudnn"
    on the CPU, where it changes no kernel), and the caller's priority is back afterwards."""
    from asyncpp_ext.models import llama

    monkeypatch.setattr("asyncpp_ext.training.stage_compute.resolve_attention", lambda name, device: "cudnn")
    seen = []
    real = llama.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch._C._get_sdp_priority_order()[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", spy)
    before = _state()
    assert main([*FAST, "--model", "llama-tiny", "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    assert seen and set(seen) == {SDPBackend.CUDNN_ATTENTION.value}
    assert _state() == before


def test_an_explicit_kernel_off_cuda_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*FAST, "--model", "llama-tiny", "--steps", "1", "--attention", "flash", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attention flash picks a CUDA attention kernel" in err[0], err
    assert not out.exists()


def test_an_unknown_attention_in_a_config_is_refused():
    from asyncpp_ext.training.config import ConfigError, RunConfig

    cfg = RunConfig()
    cfg.train.attention = "fa3"
    with pytest.raises(ConfigError, match="train.attention"):
        cfg.validate()


def test_the_kernel_bench_on_cpu(tmp_path, capsys):
    """bench/attention_kernels.py --device cpu: every row's check ok against the float32 reference;
    a tolerance below every row's difference fails the row and the exit status; bad input exits 2 in
    one line (a tolerance of 0 or less is bad input)."""
    args = ["--device", "cpu", "--iters", "1"]
    # as a program once; the other forms in this process (an interpreter start each saved)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "attention_kernels.py"), *args, "--json",
                        str(tmp_path / "a.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert rows and all(row["check"] == "ok" and row["max_rel_err"] < 1e-5 for row in rows)
    bench = load_bench_script("attention_kernels")
    capsys.readouterr()
    assert bench.main([*args, "--json", "-"]) == 0  # the GPU kit's form: the JSON alone on stdout
    assert [row["check"] for row in json.loads(capsys.readouterr().out)["rows"]] == ["ok"] * len(rows)
    assert bench.main([*args, "--tol", "1e-12"]) == 1 and "FAIL" in capsys.readouterr().out
    assert bench.main([*args, "--iters", "0"]) == 2
    assert capsys.readouterr().err.strip() == "attention_kernels.py: --iters must be >= 1, got 0"


def test_the_kernel_bench_within_documents_on_cpu(capsys):
    """--documents L: a row per shape under the document mask (SDPA's alone on the CPU, whose
    flex_attention has no backward), checked against the math kernel under the same mask, its
    FLOPs the allowed pairs'; bad L is one line."""
    bench = load_bench_script("attention_kernels")
    assert bench.main(["--device", "cpu", "--iters", "1", "--documents", "16", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    (causal,), (masked,) = ([r for r in rows if ("documents" in r) is within] for within in (False, True))
    assert masked["first"] == "sdpa+mask" and masked["documents"] == 16 and masked["check"] == "ok"
    assert masked["max_rel_err"] < 1e-5
    b, h, t, d = masked["batch"], masked["heads"], masked["seq_len"], masked["head_dim"]
    ids = bench.document_boundaries(b, t, 16, "cpu")
    assert (ids.sum(dim=1) == t // 16).all() and not torch.equal(ids[0], ids[1])  # other offsets per row
    pairs = int(bench.document_mask(ids, 1).sum())
    assert pairs < b * t * (t + 1) // 2  # fewer than causal attention's
    assert masked["tflops"] == pytest.approx(3.5 * 4 * h * d * pairs / masked["ms"] / 1e9)
    assert bench.main(["--device", "cpu", "--documents", "0"]) == 2
    assert capsys.readouterr().err.strip() == "attention_kernels.py: --documents must be a document length >= 1, got 0"


@pytest.mark.cuda
@pytest.mark.parametrize("name, marker", [("cudnn", "sdpa"), ("flash", "flash_")])
def test_on_a_gpu_a_run_runs_the_kernel_it_asks_for(tmp_path, name, marker):
    """A compiled bf16 smollm-135m step (one layer) profiled: with --attention cudnn cuDNN's
    "..._sdpa_..." kernels run, with flash torch's flash kernels and no cuDNN one (flash's names
    hold "flash_", cuDNN's "sdpa" and "flash" both)."""
    out = tmp_path / name
    assert main(["--no-progress", "--device", "cuda", "--model", "smollm-135m", "--n-layer", "1", "--seq-len", "1024",
                 "--micro-batch-size", "2", "--microbatches", "2", "--steps", "3", "--schedule", "sync", "--dtype", "bf16",
                 "--eval-batches", "0", "--no-checkpoints", "--attention", name, "--profile-steps", "3:3",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "profile" / "summary_stage0.json").read_text())
    kernels = [k["name"] for k in summary["top_kernels"] if k["kind"] == "attention"]
    assert kernels and any(marker in k for k in kernels), kernels
    if name == "flash":
        assert not any("sdpa" in k for k in kernels), kernels



def test_compiled_blocks_are_keyed_by_the_attention_choice(groups_restored):
    """A traced graph keeps the SDPA kernel it was traced with, so blocks compiled under another
    choice get compiled functions of their own (dynamo does not guard on the choice), and the same
    choice again finds the first ones."""
    from asyncpp_ext.models.compile import _GROUPS, compile_blocks
    from asyncpp_ext.models.registry import build_model, model_config

    def traced(resolved):  # graphs traced in this process so far, after a step compiled under ``resolved``
        model = build_model(model_config("llama-tiny", n_layer=1), seed=0)
        with attention_preference(resolved):
            compile_blocks(model, device="cpu", backend="aot_eager")
            idx = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
            model(idx[:, :-1], idx[:, 1:])[1].backward()
        return sum(group.compiles for group in _GROUPS.values())

    assert traced("default") == 3  # embedding, block, head
    assert traced("cudnn") == 6  # traced anew under the other choice
    assert traced("default") == 6  # the first choice again: its graphs, no retrace


def test_the_disk_cache_key_carries_the_choice():
    config = torch.compiler.config
    before = config.cache_key_tag
    with attention_preference("flash"):
        assert "asyncpp-attention=flash" in config.cache_key_tag
        with attention_preference("cudnn"):
            assert config.cache_key_tag.endswith("asyncpp-attention=cudnn")
    assert config.cache_key_tag == before
    with attention_preference("default"):
        assert config.cache_key_tag == before  # torch's own choice: the cache as before
