"""--compile and --head-loss through asyncpp-train: a real 2bw pipeline equals --simulate with each of
them on, and a request that cannot run here is one line, exit 2, nothing written."""
import json

import pytest

from asyncpp_ext.models import compile_support
from asyncpp_ext.training.cli import main

COMMON = ["--model", "llama-tiny", "--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2",
          "--stages", "2", "--schedule", "2bw", "--optimizer", "adamw", "--steps", "4", "--eval-every", "2",
          "--ckpt-every", "0", "--threads", "1", "--no-progress"]


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["eval_loss"] for r in rows if "eval_loss" in r]


def _fails_cleanly(capsys, argv, out, *words):
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("asyncpp-train: error:"), err
    for word in words:
        assert word in err, err
    assert not out.exists()


@pytest.mark.multiproc
def test_fused_head_loss_real_pipeline_equals_the_simulation_bitwise(tmp_path):
    # vocabulary 8192: --head-loss auto picks the fused head; the byte data fits any vocabulary
    flags = COMMON + ["--vocab-size", "8192"]
    assert main(flags + ["--out", str(tmp_path / "real")]) == 0
    assert main(flags + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    assert main(flags + ["--simulate", "--head-loss", "plain", "--out", str(tmp_path / "plain")]) == 0
    real, sim, plain = (_losses(tmp_path / r) for r in ("real", "sim", "plain"))
    assert real == sim  # the same kernel on the same stage split: the same bits
    assert max(abs(a - b) / b for a, b in zip(real[0], plain[0])) < 1e-6  # measured ~1e-7
    assert real[0] != plain[0]  # auto really fused (chunked sums differ in the last bits)
    cfg = json.loads((tmp_path / "real" / "config.json").read_text())
    assert cfg["train"]["head_loss"] == "auto"


@pytest.mark.multiproc  # with test_compile.py on one worker (conftest.XDIST_GROUPS)
def test_compiled_real_pipeline_equals_the_compiled_simulation(tmp_path):
    # (the ranks compile into the run's inductor cache: conftest._share_one_inductor_cache)
    assert main(COMMON + ["--compile", "--out", str(tmp_path / "real")]) == 0
    assert main(COMMON + ["--compile", "--simulate", "--out", str(tmp_path / "sim")]) == 0
    assert main(COMMON + ["--simulate", "--out", str(tmp_path / "eager")]) == 0
    real, sim, eager = (_losses(tmp_path / r) for r in ("real", "sim", "eager"))
    assert real == sim  # compiled blocks are the same graphs whichever stage holds them
    assert max(abs(a - b) / b for a, b in zip(real[0], eager[0])) < 1e-5  # measured <= 5e-8


@pytest.mark.slow  # 17-47 s of inductor compiles on 2 cores; in-process checks: test_compile_regions.py
@pytest.mark.multiproc
def test_stage_scope_real_pipeline_equals_its_simulation(tmp_path):
    # [embedding, layer 0] | [layer 1, head]: stage 0's blocks are one region (stage 1 keeps its
    # blocks alone: a one-block region is none); the simulator compiles the regions of the same
    # split, so the two must agree bit for bit. (More regions and stages: test_compile_regions.py.)
    flags = COMMON + ["--compile", "--compile-scope", "stage"]
    assert main(flags + ["--out", str(tmp_path / "real")]) == 0
    assert main(flags + ["--simulate", "--out", str(tmp_path / "sim")]) == 0
    assert _losses(tmp_path / "real") == _losses(tmp_path / "sim")  # (vs eager: test_compile_regions.py)
    cfg = json.loads((tmp_path / "real" / "config.json").read_text())
    assert cfg["train"]["compile_scope"] == "stage"


def test_a_compile_scope_or_mode_without_compiling_is_one_line(tmp_path, capsys):
    _fails_cleanly(capsys, COMMON + ["--simulate", "--compile-scope", "stage"], tmp_path / "a",
                   "--compile-scope stage", "off by default on cpu", "add --compile")
    _fails_cleanly(capsys, COMMON + ["--simulate", "--compile-scope", "stage", "--no-compile"], tmp_path / "b",
                   "--compile-scope stage", "--no-compile")
    _fails_cleanly(capsys, COMMON + ["--compile-mode", "max-autotune"], tmp_path / "c",
                   "--compile-mode max-autotune", "off by default on cpu", "add --compile")


def test_inductor_options_that_cannot_run_are_one_line(tmp_path, capsys):
    _fails_cleanly(capsys, COMMON + ["--inductor-option", "max_pointwise_cat_inputs=0"], tmp_path / "a",
                   "--inductor-option max_pointwise_cat_inputs=0", "off by default on cpu", "add --compile")
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "max_pointwise_cat_inputs"], tmp_path / "b",
                   "argument --inductor-option: expected NAME=VALUE", "'max_pointwise_cat_inputs'")
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "fast_kernels=1"], tmp_path / "c",
                   "--inductor-option:", "'fast_kernels' is not an option of this torch's inductor")
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "freezing=True"], tmp_path / "d",
                   "--inductor-option:", "freezing stays off", "drop it")
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "max_pointwise_cat_inputs=[0]"],
                   tmp_path / "e", "max_pointwise_cat_inputs takes a value like its default 8, got [0]")
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "max_pointwise_cat_inputs=abc"],
                   tmp_path / "f", "takes a value like its default 8, got 'abc'")
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "coordinate_descent_tuning=1"],
                   tmp_path / "g", "coordinate_descent_tuning takes a value like its default False, got 1")
    # a module attribute of the config that is no option (its imports, its functions)
    _fails_cleanly(capsys, COMMON + ["--compile", "--inductor-option", "os=1"], tmp_path / "h",
                   "'os' is not an option of this torch's inductor")
    # a resumed run's saved options, compile off: the refusal says how to drop them
    _fails_cleanly(capsys, COMMON + ["--simulate", "--inductor-option", "max_pointwise_cat_inputs=0"], tmp_path / "i",
                   "add --compile or pass --inductor-option none")


def test_inductor_options_parse_and_round_trip_the_config():
    from asyncpp_ext.models.compile_support import parse_inductor_option
    from asyncpp_ext.training.config import RunConfig

    assert parse_inductor_option("max_pointwise_cat_inputs=0") == ("max_pointwise_cat_inputs", 0)
    assert parse_inductor_option(" coordinate_descent_tuning = True ") == ("coordinate_descent_tuning", True)
    assert parse_inductor_option("cpp.simdlen=None") == ("cpp.simdlen", None)
    assert parse_inductor_option("triton.descriptive_names=original_aten") == ("triton.descriptive_names", "original_aten")
    assert parse_inductor_option("coordinate_descent_tuning=false") == ("coordinate_descent_tuning", False)
    assert parse_inductor_option("None") == ("", None)  # no options
    from asyncpp_ext.training.arguments import _inductor_options

    given = [("max_pointwise_cat_inputs", 0), ("max_pointwise_cat_inputs", 2), ("", None), ("coordinate_descent_tuning", True)]
    assert _inductor_options(given) == {"coordinate_descent_tuning": True}  # none dropped what came before
    assert _inductor_options(given[:2]) == {"max_pointwise_cat_inputs": 2} and _inductor_options(None) is None
    from asyncpp_ext.models.compile_support import check_inductor_options
    assert check_inductor_options({"triton.descriptive_names": "original_aten", "cpp.simdlen": 8})  # nested, None default
    cfg = RunConfig.from_dict({"train": {"inductor_options": {"max_pointwise_cat_inputs": 0}}})
    cfg.validate()
    assert RunConfig.from_dict(cfg.to_dict()).train.inductor_options == {"max_pointwise_cat_inputs": 0}


def test_a_head_loss_kernel_that_cannot_run_here_is_one_line(tmp_path, capsys):
    _fails_cleanly(capsys, COMMON + ["--simulate", "--head-loss", "liger"], tmp_path / "out",
                   "--head-loss", "CUDA")


def test_compile_where_torch_cannot_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compile_support, "compile_unavailable_reason", lambda device, **kw: "no working C++ compiler")
    _fails_cleanly(capsys, COMMON + ["--simulate", "--compile"], tmp_path / "out", "--compile",
                   "no working C++ compiler")
    # auto stays eager where torch cannot compile: no error
    assert main(COMMON + ["--simulate", "--steps", "1", "--out", str(tmp_path / "auto")]) == 0


def test_each_stage_compute_refusal_starts_with_its_flag(monkeypatch):
    """stage_compute's refusals start with the flag they are about, whichever resolver raised them
    (the library's messages speak of kernels and devices; the CLI prints them as they are)."""
    from asyncpp_ext.training.stage_compute import stage_compute
    from asyncpp_ext.training.config import RunConfig

    def refusal(train):
        with pytest.raises(ValueError) as err:
            stage_compute(RunConfig.from_dict({"train": {"compile": False, **train}}), "cpu")
        return str(err.value)

    assert refusal({"head_loss": "liger"}).startswith("--head-loss: head-loss kernel 'liger' runs on CUDA only")
    assert refusal({"attention": "cudnn"}).startswith("--attention cudnn")  # named already: no second prefix
    assert refusal({"compile_mode": "max-autotune"}).startswith("--compile-mode max-autotune says how")
    monkeypatch.setattr(compile_support, "compile_unavailable_reason", lambda device, **kw: "no working C++ compiler")
    message = refusal({"compile": True})
    assert message.startswith("--compile: ") and "no working C++ compiler" in message
    assert message.count("--compile:") == 1


@pytest.mark.cuda
def test_llama_attention_runs_on_the_flash_kernel_under_bf16_autocast():
    """SmolLM's attention shapes (head width 64, grouped-query 9/3 heads) under the run's autocast:
    restricted to the flash backend, SDPA raises if it would have fallen back to another kernel."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from asyncpp_ext.models.registry import build_model, model_config

    model = build_model(model_config("smollm-135m", n_layer=1, seq_len=256), seed=0).cuda()
    idx = torch.randint(0, 256, (2, 256), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
        loss.backward()
    assert torch.isfinite(loss)


def test_no_compile_on_a_resume_turns_the_runs_compile_settings_off_with_it():
    # a resumed run's compile scope, mode and options say how its blocks compiled; --no-compile
    # drops them with compiling (given again now, they stay, and stage_compute refuses them)
    from asyncpp_ext.training.arguments import build_parser, config_from_args
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.stage_compute import stage_compute

    saved = RunConfig()
    saved.train.compile, saved.train.compile_scope, saved.train.compile_mode = True, "stage", "max-autotune"
    saved.train.inductor_options = {"max_pointwise_cat_inputs": 0}
    parse = build_parser().parse_args
    off = config_from_args(parse(["--resume", "r", "--no-compile"]), saved).train
    assert (off.compile, off.compile_scope, off.compile_mode, off.inductor_options) == (False, "block", "default", {})
    kept = config_from_args(parse(["--resume", "r", "--steps", "9"]), saved).train
    assert (kept.compile, kept.compile_scope, kept.compile_mode) == (True, "stage", "max-autotune")
    given = config_from_args(parse(["--resume", "r", "--no-compile", "--compile-scope", "stage"]), saved)
    with pytest.raises(ValueError, match="--compile-scope stage says how blocks are compiled, but --no-compile; "
                                         "add --compile or drop --compile-scope$"):
        stage_compute(given, "cpu")
    # a run that compiled by default (on CUDA) resumed on the CPU: its scope came with it, so the
    # way out is the default value, not dropping a flag the command line does not hold
    by_default = RunConfig()
    by_default.train.compile_scope, by_default.train.resume = "stage", "r"
    with pytest.raises(ValueError, match=r"compiling is off by default on cpu; add --compile or pass "
                                         r"--compile-scope block \(the resumed run's setting"):
        stage_compute(by_default, "cpu")
