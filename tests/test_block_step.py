"""bench/block_step.py on the CPU: the eager row against the float32 reference, a failing check's
exit status, bad input in one line, and the variants' arithmetic equal to the library's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncpp_ext.models.llama import apply_rotary, rotary_cos_sin, signed_sin
from bench_loader import load_bench_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(ROOT / "bench" / "block_step.py"), "--device", "cpu", "--iters", "1"]


def _run(*args):
    return subprocess.run(BENCH + list(args), capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_cpu_row_checks_against_the_float32_block(capsys):
    r = _run("--json", "-")  # as a program once
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    (row,) = report["rows"]
    assert (row["variant"], row["model"], row["dtype"], row["check"]) == ("eager", "llama-tiny", "fp32", "ok")
    assert row["max_rel_err"] == 0.0  # the same float32 module, eager: bit for bit
    assert row["batch"] == 8192 // 32 and row["ms"] > 0
    # bf16 autocast against the float32 reference cannot meet 1e-6: the check fails, exit 1 (in
    # this process: an interpreter start saved)
    bench = load_bench_script("block_step")
    capsys.readouterr()
    assert bench.main(["--device", "cpu", "--iters", "1", "--dtype", "bf16", "--tol", "1e-6", "--no-profile"]) == 1
    assert "FAIL (> 1e-06)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--variants", "eager,fast"], "block_step: --variants: unknown variant 'fast'; choose from "),
    (["--models", "gpt9"], "block_step: --models: unknown model 'gpt9'; choose from "),
    (["--iters", "0"], "block_step: --iters must be at least 1, got 0"),
    (["--variants", "grad-accum-fusion"], "block_step: --variants: grad-accum-fusion fuses the bf16 compute "
                                          "copies' weight gradients; use --dtype bf16"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    # in this process (main's return value is the exit status the script passes to sys.exit):
    # a bad argument is refused before anything is built or measured
    bench = load_bench_script("block_step")
    assert bench.main(["--device", "cpu", "--iters", "1", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1, err


def test_variants_compute_what_the_library_computes():
    bench = load_bench_script("block_step")
    cos, sin = rotary_cos_sin(16, 8, 10000.0, "cpu", torch.float32)
    sin_signed = signed_sin(sin)
    x = torch.randn(2, 3, 16, 8)
    for dtype in (torch.float32, torch.bfloat16):
        args = (x.to(dtype), cos.to(dtype), sin_signed.to(dtype))
        assert torch.equal(bench.rotary_by_halves(*args), apply_rotary(*args))
    # every form with attention code of its own holds the reference's weights and gives its output,
    # eager and float32 (their compiled branch, fused_linear, is the library's; the forms that only
    # compile the library's block differently are the library's block here)
    from asyncpp_ext.models.llama import LlamaBlock, llama_preset_config

    cfg = llama_preset_config("llama-tiny")
    reference = LlamaBlock(cfg)
    h = torch.randn(2, cfg.seq_len, cfg.n_embd)
    own = [name for name, (_, parts, _) in bench.VARIANTS.items() if parts]
    assert own == ["rotary-btd", "separate-qkv", "separate-gate-up", "concat-weights", "rotary-halves", "expanded-kv"]
    for name in own:
        block = bench.build_block(name, cfg, reference, "cpu")
        torch.testing.assert_close(block(h), reference(h), rtol=0, atol=0, msg=name)


def test_the_separate_forms_compile_to_more_products_than_the_library_block():
    # the forms exist to measure the stacked products against separate ones: traced as a compile
    # traces them, separate-qkv makes q, k and v three calls and separate-gate-up gate and up two
    # (the library's block: 4 linear calls, q/k/v and gate/up stacked)
    import torch._dynamo
    from asyncpp_ext.models.llama import LlamaBlock, llama_preset_config

    bench = load_bench_script("block_step")
    cfg = llama_preset_config("llama-tiny")
    reference = LlamaBlock(cfg)
    x = torch.randn(2, 8, cfg.n_embd)
    counts = {}
    for name in ("compiled", "separate-qkv", "separate-gate-up"):
        graphs = []

        def record(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        torch.compile(bench.build_block(name, cfg, reference, "cpu"), backend=record, fullgraph=True)(x)
        counts[name] = len([n for n in graphs[0].graph.nodes if n.target is torch._C._nn.linear])
    assert counts == {"compiled": 4, "separate-qkv": 6, "separate-gate-up": 5}
    # nor do their compute copies carry a stacked weight the form would leave unused
    from asyncpp_ext.pipeline.compute_copies import maybe_compute_copies

    # (concat-weights: neither, its products concatenating the copies in every call)
    for name, parts in (("compiled", set()), ("separate-qkv", {"attn"}), ("separate-gate-up", {"mlp"}),
                        ("concat-weights", {"attn", "mlp"})):
        module = maybe_compute_copies(bench.build_block(name, cfg, reference, "cpu"), torch.bfloat16, True).module
        stacked = {n for n in ("attn", "mlp") if hasattr(getattr(module, n), "stacked_weight")}
        assert stacked == {"attn", "mlp"} - parts, name


def test_a_form_that_ran_eagerly_fails_its_check_and_says_whose_cat_lowering_ran(monkeypatch):
    # compile_blocks' report is read: a compiled form whose compile fell back to eager is not that
    # form (its figures are eager's), so its check fails naming the cause; a form with
    # max_pointwise_cat_inputs=0 says whose lowering built its concatenations
    from types import SimpleNamespace

    bench = load_bench_script("block_step")
    monkeypatch.setattr(bench, "compile_blocks",
                        lambda mods, **kw: SimpleNamespace(fallbacks={"LlamaBlock": "RuntimeError: boom"},
                                                           options={"max_pointwise_cat_inputs": 0}))
    args = bench.parse(["--device", "cpu", "--iters", "1", "--no-profile"])
    row = bench.measure("compiled", "llama-tiny", 32, args, torch.device("cpu"))
    assert row["check"] == "FAIL (ran eagerly: LlamaBlock: RuntimeError: boom)", row
    assert row["concat_lowering"] == ("package" if bench.concat_lowering.installed() else "inductor")
    monkeypatch.setattr(bench, "compile_blocks", lambda mods, **kw: SimpleNamespace(fallbacks={}, options={}))
    row = bench.measure("compiled", "llama-tiny", 32, args, torch.device("cpu"))
    assert row["check"] == "ok" and "concat_lowering" not in row, row


def test_a_preset_form_this_torch_cannot_set_is_refused_and_left_out_by_default(capsys, monkeypatch):
    # a form whose inductor options this torch lacks would compile as `compiled` does under another
    # name: asked for, it is refused in one line; by default it is left out
    bench = load_bench_script("block_step")
    if bench.missing_options("pdl"):
        pytest.skip(f"torch {torch.__version__}'s inductor has no triton.enable_pdl")
    assert "pdl" in bench.CUDA_DEFAULT
    # one option of two present: the form runs with it (as the throughput bench's row does)
    monkeypatch.setitem(bench.INDUCTOR_PRESETS, "pdl", {"triton.enable_pdl": True, "triton.no_such_option": True})
    assert bench.missing_options("pdl") == []
    monkeypatch.setitem(bench.INDUCTOR_PRESETS, "pdl", {"triton.no_such_option": True})
    assert bench.missing_options("pdl") == ["triton.no_such_option"]
    assert bench.main(["--device", "cpu", "--iters", "1", "--variants", "eager,pdl"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("block_step: --variants: pdl needs inductor option(s) triton.no_such_option, which torch ")


def test_the_cuda_default_forms_leave_the_fused_gradients_out_in_float32(monkeypatch):
    # the default list is every form the dtype has: --dtype fp32 runs without the bf16-only one
    bench = load_bench_script("block_step")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "grad-accum-fusion" in bench.parse([]).variants
    fp32 = bench.parse(["--dtype", "fp32"]).variants
    assert "grad-accum-fusion" not in fp32 and "compiled" in fp32
