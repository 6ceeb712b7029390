"""bench/gpu_throughput.py: its CPU smoke run (every row, finite positive numbers in the JSON), the
FLOP formula and peak table, the plan, and bad inputs (one line, exit 2)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_throughput as gt  # noqa: E402


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.multiproc
def test_cpu_smoke_runs_every_row_and_reports_finite_positive_numbers(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--device", "cpu", "--smoke",
                        "--threads", "1", "--peak-tflops", "0.5", "--profile", "--prestart", "--json", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["info"]["device"] == "cpu" and rep["info"]["mode"] == "smoke"
    assert rep["info"]["peak_tflops"] == 0.5
    assert rep["info"]["fused_head_kernel"] == "chunked"  # the CPU's only fused kernel
    rows = {row["name"]: row for row in rep["rows"]}
    train_rows = [row for row in rep["rows"] if row["impl"] != "head"]
    assert {row["impl"] for row in train_rows} == {"ours", "hf"}
    assert any(n.startswith("ours 2bw 2st 1gpu adamw") for n in rows) and "hf eager adamw" in rows
    assert any(n.startswith("ours sync adamw") for n in rows)
    shape = gt.model_shape("llama-tiny", 64)
    for row in train_rows:
        assert row["status"] == "ok" and row["check"] == "ok", row
        assert row["tokens_per_step"] == 8 * 4 * 64
        assert len(row["losses"]) == rep["info"]["warmup"] + rep["info"]["steps"]
        assert all(math.isfinite(v) for v in row["losses"])
        for key in ("tokens_per_s", "tflops", "mfu", "peak_bytes", "wall_s"):
            assert _positive(row[key]), (row["name"], key, row[key])
        assert row["flops_per_token"] == gt.flops_per_token(shape, 64)
        assert row["mfu"] == pytest.approx(row["tflops"] / 0.5)
        assert row["peak_kind"] == ("pss" if row["stages"] == 2 else "rss")
        # --prestart: every row after the first was started ahead and waited for its turn; its steps'
        # clock started after its turn and its process ended after its last step
        t = row["timeline"]
        assert ("ahead" in t) == (row is not rep["rows"][0]) and t.get("ahead", 1) > 0, (row["name"], t)
        assert min(t[k] for k in ("start", "steps", "end")) >= 0 and t["first_step"] > 0, (row["name"], t)
        if row["impl"] == "ours":  # --profile traced 2 steps after the measured ones, on every rank
            assert set(row["profile"]) == {f"stage{s}" for s in range(row["stages"])}
            assert all(p["window_ms_per_step"] > 0 and p["kernels_per_step"] == 0 for p in row["profile"].values())
            assert all(p["top_kernels_ms_per_step"] == [] for p in row["profile"].values())  # no kernels on CPU
    hf = rows["hf eager adamw"]
    assert hf["params"] == gt.total_params(shape) and hf["info"]["attn_implementation"] == "sdpa"
    # --profile traced 2 more steps of the Hugging Face row too, in its worker (no kernels on CPU),
    # and its measured steps are the warm-up and measured ones only
    (prof,) = hf["profile"].values()
    assert set(hf["profile"]) == {"hf"} and prof["window_ms_per_step"] > 0 and prof["kernels_per_step"] == 0
    assert prof["top_kernels_ms_per_step"] == [] and prof["idle_between_ms_per_step"] is None
    assert not [row for row in rep["rows"] if row["impl"] == "head"]  # measured in-process below
    assert any(q["what"].endswith("/ hf eager adamw") and _positive(q["tokens_per_s"]) for q in rep["ratios"])
    assert any(q["what"].startswith("ours 2bw") and _positive(q["tokens_per_s"]) for q in rep["ratios"])
    assert rep["summary"]["checks_failed"] == 0 and rep["info"]["prestart"] is True
    assert "FLOPs/token = 6*N + 12*L*H*Q*T" in r.stdout and "tokens/s" in r.stdout
    assert "# wall time per row" in r.stdout and " ahead)" in r.stdout
    assert "not run: not installed" in r.stdout or gt.importlib.util.find_spec("torchtitan") is not None


def test_head_loss_rows_from_measure_head_loss(capsys):
    modes = ["plain", "fused", "fused@5"]  # and the fused head at 5 rows per chunk (--head-chunk-rows 5)
    spec = dict(kind="head", modes=modes, device="cpu", dtype="fp32", threads=None, **gt.SMOKE_HEAD_SHAPE)
    assert gt.worker_main(spec) == 0
    out = capsys.readouterr().out
    worker = dict(json.loads(out.split(gt.RESULT_TAG)[1]), wall_s=1.0, command="c")
    shape = gt.SMOKE_HEAD_SHAPE
    rows = [gt.head_row(gt.row(f"head-loss {m}", "head", "head", shape["seq"], shape["batch"], 1, head_mode=m,
                               head_shape=shape, status=None), worker) for m in modes]
    args = SimpleNamespace(device="cpu", warmup=1)
    rows = [gt.finish_row(r, args, None) for r in rows]
    gt.head_checks(rows)
    for r in rows:
        assert r["status"] == "ok" and r["check"] == "ok", r
        assert _positive(r["head_seconds"]) and _positive(r["peak_bytes"]) and _positive(r["tokens_per_s"])
    for fused in rows[1:]:
        assert fused["loss_rel_diff"] <= gt.HEAD_LOSS_REL_TOL["fp32"] and _positive(fused["peak_ratio_to_plain"])
    assert rows[1]["head_loss"] != rows[2]["head_loss"]  # another chunking really ran (sums in another order)
    assert gt.head_mode("fused@5") == ("fused", {"chunk_rows": 5}) and gt.head_mode("plain") == ("plain", {})
    report = dict(info=dict(device_name="cpu", device="cpu", torch="t", transformers=None, mode="smoke",
                            peak_tflops=None, peak_source="-", dtype="fp32", warmup=1, steps=1, cli_flags={}),
                  formula="f", rows=rows, skipped=[], ratios=[],
                  summary=dict(rows=2, rows_ok=2, checks_failed=0), seconds=1.0)
    text = gt.format_report(report)
    assert "head-loss fused" in text and "x plain" in text


def test_flop_formula_counts_the_smollm_parameters_once():
    s135, s360 = gt.model_shape("smollm-135m", 1024), gt.model_shape("smollm-360m", 2048)
    # The published sizes with the tied table counted once (asyncpp_ext/models/llama.py).
    assert gt.matmul_params(s135) == gt.total_params(s135) == 134_515_008
    assert gt.matmul_params(s360) == gt.total_params(s360) == 361_821_120
    assert gt.flops_per_token(s135, 1024) == 6 * 134_515_008 + 12 * 30 * 576 * 1024
    assert gt.flops_per_token(s360, 2048) == 6 * 361_821_120 + 12 * 32 * 960 * 2048
    # an untied table: the head's matmul counts, the input lookup does not
    untied = dict(s135, tie_embeddings=False)
    assert gt.total_params(untied) - gt.matmul_params(untied) == 49152 * 576


def test_smollm_hf_dicts_are_the_asyncpp_presets_and_build_the_same_model():
    for name in ("smollm-135m", "smollm-360m"):
        cfg = gt.hf_config_dict(gt.model_shape(name, 2048), 2048)
        assert {k: cfg[k] for k in gt.SMOLLM_HF[name]} == gt.SMOLLM_HF[name]
    pytest.importorskip("transformers")
    shape = gt.model_shape("llama-tiny-4x64", 128)
    model, _, info = gt.build_hf_model(dict(hf_config=gt.hf_config_dict(shape, 128), shape=shape))
    assert sum(p.numel() for p in model.parameters()) == gt.total_params(shape)
    assert info["attn_implementation"] == "sdpa"


def test_a_changed_smollm_dict_stops_the_bench(monkeypatch):
    monkeypatch.setitem(gt.SMOLLM_HF, "smollm-135m", dict(gt.SMOLLM_HF["smollm-135m"], intermediate_size=1024))
    with pytest.raises(RuntimeError, match="intermediate_size"):
        gt.hf_config_dict(gt.model_shape("smollm-135m", 1024), 1024)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
                                        ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("Tesla T4", None)])
def test_peak_table_by_gpu_name(name, peak):
    assert gt.peak_for_gpu(name)[0] == peak


def test_steady_state_skips_the_warmup_steps_and_the_checks():
    tokens, elapsed = [100, 200, 300, 400], [10.0, 10.5, 11.0, 11.5]  # step 1 holds a 10 s compile
    assert gt.steady_tokens_per_s(tokens, elapsed, 1) == pytest.approx(300 / 1.5)
    assert gt.steady_tokens_per_s(tokens, elapsed, 4) is None
    assert gt.loss_check([10.9, 9.0, 8.0, 7.5], 49152) == "ok"
    assert gt.loss_check([10.9, float("nan"), 8.0, 7.5], 49152).startswith("FAIL: non-finite")
    assert gt.loss_check([3.0, 2.0, 1.0, 0.5], 49152).startswith("FAIL: first loss")
    assert gt.loss_check([10.9, 11.0, 11.0, 11.2], 49152) == "FAIL: loss not decreasing"


def _plan_args(device="cuda", mode="full", **kw):
    d = gt.DEFAULTS[device]
    kw = {"only": None, "skip": None, **kw}
    return SimpleNamespace(device=device, mode=mode, models=d["models"], seq_lens=d["seq_lens"],
                           micro_batch_size=8, microbatches=8, cpu_compile=False, **kw)


def _one_variant_at_the_last_point(flags, key, name, cli_flag, value, args, full):
    """The plan's one row with ``key`` set: ``name`` at smollm-360m / 2048 of a full CUDA run, its
    command passing ``cli_flag value`` (the plain row's without it); none in --quick."""
    rows = [r for r in gt.build_plan(_plan_args(), flags, gpus=1)[0] if r.get(key)]
    assert [(r["name"], r["model"], r["seq_len"]) for r in rows] == [(name, "smollm-360m", 2048)]
    cmd = gt.ours_command(rows[0], args, flags, Path("o"), Path("p"))
    assert cmd[cmd.index(cli_flag) + 1] == value and "--compile" in cmd and "--cuda-graphs" in cmd
    assert cli_flag not in gt.ours_command(full[0], args, flags, Path("o"), Path("p"))
    assert not any(r.get(key) for r in gt.build_plan(_plan_args(mode="quick"), flags, gpus=1)[0])


def test_plan_rows_compile_flags_and_gpu_counts():
    flags_on, flags_off = dict(compile=True, head_loss=True), dict(compile=False, head_loss=False)
    rows, skipped = gt.build_plan(_plan_args(), flags_on, gpus=1)
    names = {(r["name"], r["model"], r["seq_len"]) for r in rows}
    for model in ("smollm-135m", "smollm-360m"):
        for seq in (1024, 2048):
            assert ("ours sync adamw", model, seq) in names and ("hf compile adamw", model, seq) in names
    for model, seq in (("smollm-135m", 1024), ("smollm-360m", 2048)):
        for name in ("ours sync adamw eager", "ours 2bw 2st 1gpu adamw"):  # compiled rows carry no suffix
            assert (name, model, seq) in names
    for name in ("ours sync muon", "hf compile muon", "hf eager adamw"):
        assert {(m, t) for n, m, t in names if n == name} == {("smollm-135m", 1024)}
    assert any("2gpu" in name and "needs 2 GPUs" in why for name, why in skipped)
    # same tokens per microbatch: half the sequences at twice the length
    assert {r["micro_batch_size"] for r in rows if r["seq_len"] == 2048 and r["impl"] != "head"} == {4}
    alone = dict(vars(_plan_args()), models=["smollm-360m"], seq_lens=[2048])  # also when 2048 runs alone
    assert {r["micro_batch_size"] for r in gt.build_plan(SimpleNamespace(**alone), flags_on, gpus=1)[0]
            if r["impl"] != "head"} == {4}
    two, _ = gt.build_plan(_plan_args(), flags_on, gpus=2)
    assert any(r["name"] == "ours 2bw 2st 2gpu adamw" and r["transport"] == "nccl" for r in two)
    quick, _ = gt.build_plan(_plan_args(mode="quick"), flags_off, gpus=1)
    # quick: the default configurations at the first point only (under 3 minutes on one GPU)
    assert {(r["model"], r["seq_len"]) for r in quick if r["impl"] != "head"} == {("smollm-135m", 1024)}
    assert [r["name"] for r in quick if r["impl"] == "ours"] == ["ours sync adamw", "ours 2bw 2st 1gpu adamw"]
    assert all(r["compile"] is None and r["notes"] == ["flags absent"] for r in quick if r["impl"] == "ours")
    assert not any(r["name"].endswith("eager") and r["impl"] == "ours" for r in quick)
    assert [r["name"] for r in quick if r["impl"] == "hf"] == ["hf compile adamw"]
    cpu, _ = gt.build_plan(_plan_args("cpu", "quick"), flags_on, gpus=0)
    assert [r["name"] for r in cpu if r["impl"] == "hf"] == ["hf eager adamw"]  # no torch.compile on CPU
    cpu_full, cpu_skipped = gt.build_plan(_plan_args("cpu"), flags_on, gpus=0)
    assert not any(r["impl"] == "hf" and r["compile"] for r in cpu_full)
    assert any(name.startswith("hf compile") and "--cpu-compile" in why for name, why in cpu_skipped)
    # compiled vs eager for llama-tiny on CPU: the one compiled row that runs there by default
    assert [r["compile"] for r in cpu if r["name"].startswith("ours sync adamw") and r["model"] == "llama-tiny"] \
        == [False, True]
    # --cuda-graphs rows where the CLI has the flag: in the full mode, on CUDA, beside the primary
    # points' sync and 2bw rows; --quick runs the CLI's defaults: sync with graphs on CUDA, 2bw without
    with_graphs = dict(flags_on, cuda_graphs=True)
    full, _ = gt.build_plan(_plan_args(), with_graphs, gpus=1)
    assert {(r["name"], r["model"], r["seq_len"]) for r in full if r.get("graphs")} == {
        ("ours sync adamw graphs", "smollm-135m", 1024), ("ours 2bw 2st 1gpu adamw graphs", "smollm-135m", 1024),
        ("ours sync adamw graphs", "smollm-360m", 2048), ("ours 2bw 2st 1gpu adamw graphs", "smollm-360m", 2048)}
    assert [(r["name"], bool(r.get("graphs"))) for r in gt.build_plan(_plan_args(mode="quick"), with_graphs,
                                                                      gpus=1)[0] if r["impl"] == "ours"] == [
        ("ours sync adamw graphs", True), ("ours 2bw 2st 1gpu adamw", False)]
    # where the CLI has the ipc transport, the full mode's one-GPU 2bw rows are gloo, ipc and ipc
    # with graphs; --quick runs ipc alone
    with_ipc = dict(with_graphs, ipc=True)
    full, _ = gt.build_plan(_plan_args(), with_ipc, gpus=1)
    assert [(r["name"], r["transport"], bool(r.get("graphs"))) for r in full
            if r["stages"] == 2 and r["model"] == "smollm-135m"] == [
        ("ours 2bw 2st 1gpu adamw", "gloo", False), ("ours 2bw 2st 1gpu adamw ipc", "ipc", False),
        ("ours 2bw 2st 1gpu adamw ipc graphs", "ipc", True)]
    quick, _ = gt.build_plan(_plan_args(mode="quick"), with_ipc, gpus=1)
    assert [(r["name"], r["transport"]) for r in quick if r["stages"] == 2] == [("ours 2bw 2st 1gpu adamw ipc", "ipc")]
    assert all(r["transport"] == "gloo" for r in gt.build_plan(_plan_args("cpu", "quick"), with_ipc, gpus=0)[0]
               if r["stages"] == 2)
    assert not any(r.get("graphs") for r in gt.build_plan(_plan_args("cpu", "quick"), with_graphs, gpus=0)[0])
    args = SimpleNamespace(device="cuda", warmup=3, steps=5, threads=None, profile=False)
    cmd = gt.ours_command(next(r for r in full if r.get("graphs")), args, with_graphs, Path("o"), Path("p"))
    assert "--cuda-graphs" in cmd and "--no-cuda-graphs" not in cmd
    # a row without graphs says so: the CLI's default for sync on CUDA is on; on CPU neither flag
    plain = gt.ours_command(full[0], args, with_graphs, Path("o"), Path("p"))
    assert (full[0]["name"], "--no-cuda-graphs" in plain, "--cuda-graphs" in plain) == ("ours sync adamw", True, False)
    cpu_args = SimpleNamespace(**{**vars(args), "device": "cpu"})
    assert not any("cuda-graphs" in a for a in gt.ours_command(full[0], cpu_args, with_graphs, Path("o"), Path("p")))
    # --no-compute-copies rows where the CLI has the flag: full mode, CUDA, the primary points
    with_copies = dict(with_ipc, compute_copies=True)
    full, _ = gt.build_plan(_plan_args(), with_copies, gpus=1)
    no_copies = [r for r in full if r.get("copies") is False]
    assert {(r["name"], r["model"], r["seq_len"]) for r in no_copies} == {
        ("ours sync adamw no-copies", "smollm-135m", 1024), ("ours sync adamw no-copies", "smollm-360m", 2048)}
    assert "--no-compute-copies" in gt.ours_command(no_copies[0], args, with_copies, Path("o"), Path("p"))
    assert "--no-compute-copies" not in gt.ours_command(full[0], args, with_copies, Path("o"), Path("p"))
    assert not any(r.get("copies") is False for r in gt.build_plan(_plan_args(mode="quick"), with_copies, gpus=1)[0])
    assert not any(r.get("copies") is False for r in gt.build_plan(_plan_args("cpu"), with_copies, gpus=0)[0])
    with_params = dict(with_copies, bf16_params=True)  # --dtype bf16-params rows beside them
    full, _ = gt.build_plan(_plan_args(), with_params, gpus=1)
    params = [r for r in full if r.get("dtype") == "bf16-params"]
    assert {(r["name"], r["model"], r["seq_len"]) for r in params} == {
        ("ours sync adamw bf16-params", "smollm-135m", 1024), ("ours sync adamw bf16-params", "smollm-360m", 2048)}
    cmd = gt.ours_command(params[0], args, with_params, Path("o"), Path("p"))
    assert cmd[cmd.index("--dtype") + 1] == "bf16-params"
    assert not any(r.get("dtype") for r in gt.build_plan(_plan_args(mode="quick"), with_params, gpus=1)[0])
    # --compile-scope stage rows where the CLI has the flag: full mode, the primary points on CUDA,
    # the first (compiled, against ours' compiled row) on CPU; never in --quick
    with_scope = dict(with_params, compile_scope=True)
    full, _ = gt.build_plan(_plan_args(), with_scope, gpus=1)
    staged = [r for r in full if r.get("scope") == "stage"]
    assert {(r["name"], r["model"], r["seq_len"], r["compile"]) for r in staged} == {
        ("ours sync adamw stage-compile", "smollm-135m", 1024, True),
        ("ours sync adamw stage-compile", "smollm-360m", 2048, True),
        ("ours sync adamw graphs stage-compile", "smollm-135m", 1024, True),
        ("ours sync adamw graphs stage-compile", "smollm-360m", 2048, True)}
    cmd = gt.ours_command(staged[0], args, with_scope, Path("o"), Path("p"))
    assert cmd[cmd.index("--compile-scope") + 1] == "stage" and "--compile" in cmd
    assert "--compile-scope" not in gt.ours_command(full[0], args, with_scope, Path("o"), Path("p"))
    assert not any(r.get("scope") for r in gt.build_plan(_plan_args(mode="quick"), with_scope, gpus=1)[0])
    cpu_staged = [(r["name"], r["model"], r["seq_len"], r["compile"])
                  for r in gt.build_plan(_plan_args("cpu"), with_scope, gpus=0)[0] if r.get("scope")]
    assert cpu_staged == [("ours sync adamw stage-compile", "llama-tiny", 64, True)]
    # --compile-mode max-autotune: one row, at the last (GPU-bound) point of a full CUDA run
    with_mode = dict(with_scope, compile_mode=True)
    _one_variant_at_the_last_point(with_mode, "compile_mode", "ours sync adamw graphs max-autotune",
                                   "--compile-mode", "max-autotune", args, full)
    assert not any(r.get("compile_mode") for r in gt.build_plan(_plan_args("cpu"), with_mode, gpus=0)[0])
    # --inductor-option: the cat-fused, combo-kernels, pdl, combo-kernels-pdl and mix-order-64 rows,
    # on top of the defaults, at the last CUDA point; their options those of this torch's inductor
    with_options = dict(with_mode, inductor_option=True)
    cats = [r for r in gt.build_plan(_plan_args(), with_options, gpus=1)[0] if r.get("inductor")]
    assert [(r["name"], r["model"], r["seq_len"]) for r in cats] == [
        (f"ours sync adamw graphs {preset}", "smollm-360m", 2048)
        for preset in ("cat-fused", "combo-kernels", "pdl", "combo-kernels-pdl", "mix-order-64")]
    from torch._inductor import config as inductor_config
    known = inductor_config.get_config_copy()
    wanted = (["max_pointwise_cat_inputs=8"], ["combo_kernels=True"], ["triton.enable_pdl=True"],
              ["combo_kernels=True", "triton.enable_pdl=True"], ["triton.mix_order_reduction_split_size=64"])
    for r, want in zip(cats, wanted):
        cmd = gt.ours_command(r, args, with_options, Path("o"), Path("p"))
        given = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--inductor-option"]
        assert set(want) <= set(given) and "--compile" in cmd and "--cuda-graphs" in cmd
        assert all(g.partition("=")[0] in known for g in given)
    assert not any(r.get("inductor") for r in gt.build_plan(_plan_args(mode="quick"), with_options, gpus=1)[0])
    # --nonfinite-check host: the step's check read on the host first, at the last CUDA point
    _one_variant_at_the_last_point(dict(with_mode, nonfinite_check=True), "nonfinite_check",
                                   "ours sync adamw graphs host-check", "--nonfinite-check", "host", args, full)
    assert gt.detect_cli_flags()["nonfinite_check"]
    # --clip-grad-norm 1.0: clipping's cost, at the last CUDA point
    _one_variant_at_the_last_point(dict(with_mode, clip_grad_norm=True), "clip_grad_norm",
                                   "ours sync adamw graphs clip", "--clip-grad-norm", "1.0", args, full)
    assert gt.detect_cli_flags()["clip_grad_norm"]
    # --head-chunk-rows: one more fused head row per chunk size
    heads = [(r["name"], r["head_mode"]) for r in gt.build_plan(_plan_args(head_chunk_rows=[1365, 2730]), flags_on,
                                                                 gpus=1)[0] if r["impl"] == "head"]
    assert heads == [("head-loss plain", "plain"), ("head-loss fused", "fused"),
                     ("head-loss fused 1365 rows", "fused@1365"), ("head-loss fused 2730 rows", "fused@2730")]
    # --only keeps rows holding a substring, --skip then leaves out those holding another
    picked, _ = gt.build_plan(_plan_args(only="ours sync adamw,hf compile adamw smollm-135m", skip="eager,360m,T=2048"),
                              with_params, gpus=1)
    assert [r["name"] for r in picked] == ["ours sync adamw", "ours sync adamw graphs", "ours sync adamw no-copies",
                                           "ours sync adamw bf16-params", "hf compile adamw"]


def test_ours_command_passes_the_new_flags_only_when_the_cli_has_them(tmp_path):
    args = SimpleNamespace(device="cuda", warmup=3, steps=5, threads=None, profile=False)
    r = gt.row("ours sync adamw", "ours", "smollm-360m", 2048, 4, 8, optimizer="adamw", compile=True, schedule="sync")
    on = gt.ours_command(r, args, dict(compile=True, head_loss=True), tmp_path / "o", tmp_path / "p")
    off = gt.ours_command(r, args, dict(compile=False, head_loss=False), tmp_path / "o", tmp_path / "p")
    for cmd in (on, off):
        assert cmd[cmd.index("--model") + 1] == "smollm-360m" and cmd[cmd.index("--seq-len") + 1] == "2048"
        assert cmd[cmd.index("--steps") + 1] == "8" and cmd[cmd.index("--ef-beta") + 1] == "0"
        assert cmd[cmd.index("--dtype") + 1] == "bf16" and cmd[cmd.index("--schedule") + 1] == "sync"
    assert "--compile" in on and on[on.index("--head-loss") + 1] == "auto"
    assert "--compile" not in off and "--head-loss" not in off and "--profile-steps" not in on
    assert "--no-checkpoints" not in on  # an older CLI without the flags
    quiet = gt.ours_command(r, args, dict(compile=True, head_loss=True, no_checkpoints=True), tmp_path / "o", tmp_path / "p")
    assert "--no-checkpoints" in quiet and quiet[quiet.index("--eval-batches") + 1] == "0"
    args.profile = True  # two traced steps after the 3 + 5 measured ones
    traced = gt.ours_command(r, args, dict(compile=True, head_loss=True), tmp_path / "o", tmp_path / "p")
    assert traced[traced.index("--steps") + 1] == "10" and traced[traced.index("--profile-steps") + 1] == "9:10"


@pytest.mark.parametrize("argv, words", [
    (["--device", "cpu", "--models", "gpt-9000"], "unknown model"),
    (["--device", "cpu", "--microbatches", "1"], "--microbatches must be >= 2"),
    (["--device", "cpu", "--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
    (["--device", "cpu", "--steps", "0"], "--steps must be >= 1"),
    (["--device", "cpu", "--seq-lens", "64,x"], "--seq-lens must be a comma-separated list of int"),
    (["--device", "cpu", "--peak-tflops", "-3"], "--peak-tflops must be a positive number"),
    (["--device", "tpu"], "invalid choice"),
    (["--quick", "--smoke"], "not allowed with"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--device", "cpu", "--smoke", "--only", "zzzz"], "--only zzzz: no row's"),
])
def test_bad_inputs_give_one_line_and_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine with a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu_throughput.py: error: ") and words in err, err


@pytest.mark.parametrize("kind, words", [("fifo", "is not a regular file"), ("directory", "is a directory"),
                                         ("under a file", "cannot be written (Not a directory)")])
def test_a_json_path_that_cannot_take_the_report_is_refused_before_any_row(tmp_path, capsys, kind, words):
    """Found before the first row (minutes on a GPU), and never a rename over what is not a file
    (a device such as /dev/full: the paths here are in tmp_path, so a regression cannot harm one)."""
    path = tmp_path / "report.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a missing directory is made; one under a file cannot be
        (tmp_path / "a_file").write_text("")
        path = tmp_path / "a_file" / "new" / "report.json"
    assert gt.main(["--device", "cpu", "--smoke", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: --json {path} {words}" in err, err
    assert not (tmp_path / "report.json.tmp").exists()


def test_a_json_path_in_missing_directories_makes_them_before_any_row(tmp_path):
    """What the GPU runbook passes (OUT/<step>.json, OUT not yet made in its plan mode)."""
    path = tmp_path / "out" / "sub" / "report.json"
    args = gt.parse_args(["--device", "cpu", "--smoke", "--json", str(path)])
    assert args.json == str(path) and path.parent.is_dir() and list(path.parent.iterdir()) == []


def test_an_unbuilt_extension_stops_the_bench_before_any_row(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "asyncpp_ext._ext", None)  # as if asyncpp_ext._C was never built
    assert gt.main(["--device", "cpu", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu_throughput.py: error: "), err


def test_ratios_pair_ours_with_its_variant_rows():
    from throughput_report import ratios

    def ours(name, tps, **kw):
        return dict(gt.row(name, "ours", "m", 1024, 8, 8, optimizer="adamw", compile=True, **kw),
                    status="ok", tokens_per_s=tps, peak_bytes=100)
    rows = [ours("ours sync adamw", 120.0), ours("ours sync adamw no-copies", 100.0, copies=False),
            ours("ours sync adamw graphs", 180.0, graphs=True),
            ours("ours sync adamw bf16-params", 150.0, dtype="bf16-params"),
            ours("ours sync adamw stage-compile", 132.0, scope="stage"),
            ours("ours sync adamw graphs stage-compile", 198.0, scope="stage", graphs=True),
            ours("ours sync adamw max-autotune", 126.0, compile_mode="max-autotune"),
            ours("ours sync adamw graphs flash-attention", 162.0, graphs=True, attention="flash"),
            ours("ours 2bw 2st 1gpu adamw", 90.0, stages=2)]
    got = {q["what"]: q["tokens_per_s"] for q in ratios(rows)}
    assert got["ours sync adamw graphs flash-attention / ours sync adamw graphs"] == pytest.approx(0.9)
    assert got["ours sync adamw bf16-params / ours sync adamw"] == pytest.approx(1.25)
    assert got["ours sync adamw / ours sync adamw no-copies"] == pytest.approx(1.2)
    assert got["ours sync adamw graphs / ours sync adamw"] == pytest.approx(1.5)
    assert got["ours sync adamw stage-compile / ours sync adamw"] == pytest.approx(1.1)
    assert got["ours sync adamw graphs stage-compile / ours sync adamw graphs"] == pytest.approx(1.1)
    assert got["ours sync adamw max-autotune / ours sync adamw"] == pytest.approx(1.05)
    assert got["ours 2bw 2st 1gpu adamw / ours sync adamw"] == pytest.approx(0.75)  # not against no-copies
    assert not any(w.startswith("ours sync adamw no-copies /") for w in got)


def test_variant_rows_are_checked_against_the_row_they_vary():
    # Same seed, data and update rule: graphs, a stage region, ipc compute the same losses up to
    # float order; a variant off by more than VARIANT_LOSS_TOL at some step fails its check;
    # bf16-params (another rounding by design) gets its difference reported only.
    from throughput_report import VARIANT_LOSS_TOL, variant_checks

    base = [10.6, 9.8, 7.6, 6.9, 6.4]

    def ours(name, losses, **kw):
        return dict(gt.row(name, "ours", "m", 1024, 8, 8, optimizer="adamw", compile=True, **kw),
                    status="ok", losses=list(losses), check="ok")
    off = [base[0], base[1], base[2] * 1.1, base[3], base[4]]  # one step 10 % off
    rows = [ours("ours sync adamw", base), ours("ours sync adamw graphs", [v * (1 + 1e-3) for v in base], graphs=True),
            ours("ours sync adamw graphs stage-compile", off, graphs=True, scope="stage"),
            ours("ours sync adamw bf16-params", off, dtype="bf16-params"),
            ours("ours 2bw 2st 1gpu adamw", base, stages=2, transport="gloo"),
            ours("ours 2bw 2st 1gpu adamw ipc", base, stages=2, transport="ipc"),
            ours("ours 2bw 2st 1gpu adamw ipc graphs", off, stages=2, transport="ipc", graphs=True),
            ours("ours sync adamw graphs flash-attention", off, graphs=True, attention="flash"),
            ours("ours sync adamw graphs pdl", off, graphs=True, inductor="pdl"),
            ours("ours sync adamw graphs combo-kernels-pdl", base, graphs=True, inductor="combo-kernels-pdl"),
            ours("ours sync adamw graphs host-check", off, graphs=True, nonfinite_check="host"),
            ours("ours sync adamw graphs clip", off, graphs=True, clip_grad_norm=1.0)]
    variant_checks(rows)
    got = {r["name"]: (r["check"], r.get("loss_vs")) for r in rows}
    assert got["ours sync adamw"] == ("ok", None) and got["ours 2bw 2st 1gpu adamw"] == ("ok", None)
    assert got["ours sync adamw graphs"][0] == "ok"
    assert got["ours sync adamw graphs"][1] == dict(row="ours sync adamw", max_rel_diff=pytest.approx(1e-3))
    assert got["ours 2bw 2st 1gpu adamw ipc"] == ("ok", dict(row="ours 2bw 2st 1gpu adamw", max_rel_diff=0.0))
    # every inductor preset and the host's check against the row they vary (pdl's was not checked)
    assert got["ours sync adamw graphs combo-kernels-pdl"][1]["row"] == "ours sync adamw graphs"
    for name, against in (("ours sync adamw graphs stage-compile", "ours sync adamw graphs"),
                          ("ours sync adamw graphs flash-attention", "ours sync adamw graphs"),
                          ("ours sync adamw graphs pdl", "ours sync adamw graphs"),
                          ("ours sync adamw graphs host-check", "ours sync adamw graphs"),
                          ("ours 2bw 2st 1gpu adamw ipc graphs", "ours 2bw 2st 1gpu adamw ipc")):
        assert re.fullmatch(rf"FAIL: losses differ from {against}'s by up to (9\.9e-02|1\.0e-01) "
                            rf"\(> {VARIANT_LOSS_TOL:g}\)", got[name][0]), got[name]
    assert got["ours sync adamw bf16-params"] == ("ok", dict(row="ours sync adamw", max_rel_diff=pytest.approx(0.1)))
    # clipping scales the steps by design: its difference recorded, not failed
    assert got["ours sync adamw graphs clip"] == ("ok", dict(row="ours sync adamw graphs",
                                                             max_rel_diff=pytest.approx(0.1, rel=0.02)))
    # a run without the graphs row (the runbook's 360m step): graphs with a stage region against plain
    lone = [ours("ours sync adamw", base), ours("ours sync adamw graphs stage-compile", base, graphs=True, scope="stage")]
    variant_checks(lone)
    assert lone[1]["loss_vs"] == dict(row="ours sync adamw", max_rel_diff=0.0) and lone[1]["check"] == "ok"


def test_targets_say_what_this_run_measured_against_its_bounds():
    from throughput_report import targets

    def row(name, impl, model, seq, tps, peak_bytes=None, mfu=None, compile=True, check="ok", **kw):
        return dict(gt.row(name, impl, model, seq, 8, 8, optimizer="adamw", compile=compile, **kw),
                    status="ok", tokens_per_s=tps, peak_bytes=peak_bytes, mfu=mfu, check=check)
    rows = [row("ours sync adamw", "ours", "smollm-360m", 2048, 160.0, peak_bytes=9, mfu=0.42),
            row("ours sync adamw graphs stage-compile", "ours", "smollm-360m", 2048, 170.0, graphs=True,
                scope="stage", peak_bytes=11, mfu=0.45),
            row("hf compile adamw", "hf", "smollm-360m", 2048, 100.0, peak_bytes=10),
            row("ours sync adamw eager", "ours", "smollm-135m", 1024, 50.0, compile=False),  # not a 2bw row's base
            row("ours sync adamw", "ours", "smollm-135m", 1024, 75.0),
            row("ours sync adamw graphs", "ours", "smollm-135m", 1024, 100.0, graphs=True),
            row("ours sync adamw stage-compile", "ours", "smollm-135m", 1024, 300.0, scope="stage",
                check="FAIL: losses differ"),  # faster, but wrong: not counted
            row("hf compile adamw", "hf", "smollm-135m", 1024, 100.0),
            row("ours 2bw 2st 1gpu adamw ipc", "ours", "smollm-135m", 1024, 72.0, stages=2, transport="ipc"),
            row("ours 2bw 2st 1gpu adamw ipc graphs", "ours", "smollm-135m", 1024, 95.0, stages=2,
                transport="ipc", graphs=True)]
    got = {t["what"]: (round(t["value"], 3), t["bound"], t["met"]) for t in targets(rows, 170.0, "quick")}
    assert got == {
        "ours sync adamw smollm-360m T=2048: tokens/s / hf compile adamw's": (1.6, ">= 1.5", True),
        "ours sync adamw smollm-360m T=2048: peak memory / hf compile adamw's": (0.9, "<= 1", True),
        "ours sync adamw smollm-360m T=2048: MFU": (0.42, ">= 0.4", True),
        "ours sync adamw graphs stage-compile smollm-360m T=2048: tokens/s / hf compile adamw's": (1.7, ">= 1.5", True),
        "ours sync adamw graphs stage-compile smollm-360m T=2048: peak memory / hf compile adamw's":
            (1.1, "<= 1", False),
        "ours sync adamw graphs stage-compile smollm-360m T=2048: MFU": (0.45, ">= 0.4", True),
        "ours sync adamw smollm-135m T=1024: tokens/s / hf compile adamw's": (0.75, ">= 1.5", False),
        "ours sync adamw graphs smollm-135m T=1024: tokens/s / hf compile adamw's": (1.0, ">= 1.5", False),
        "ours 2bw 2st 1gpu adamw ipc smollm-135m T=1024: tokens/s / ours sync adamw's": (0.96, ">= 0.9", True),
        "ours 2bw 2st 1gpu adamw ipc graphs smollm-135m T=1024: tokens/s / ours sync adamw graphs's":
            (0.95, ">= 0.9", True),
        "--quick wall time, s": (170.0, "< 180", True)}
    assert not any(t["what"].startswith("--quick") for t in targets(rows, 170.0, "full"))
    # MFU at 360m / 2048 whether or not the run had a Hugging Face row there
    alone = [r for r in rows if r["impl"] == "ours" and r["model"] == "smollm-360m"]
    assert [t["what"] for t in targets(alone, 0.0, "full")] == [
        "ours sync adamw smollm-360m T=2048: MFU", "ours sync adamw graphs stage-compile smollm-360m T=2048: MFU"]


def test_head_profile_summarises_a_traced_call_per_call(monkeypatch):
    """--profile on a GPU traces one more measure_head_loss call (warm-up + timed: two runs of the
    head) and keeps the kernel summary per call; here a CPU stand-in (no kernels) checks the wiring."""
    import torch
    import throughput_workers as tr

    from asyncpp_ext.models import head_loss

    calls = []
    monkeypatch.setattr(head_loss, "measure_head_loss", lambda *a, **k: calls.append(a) or torch.ones(4) @ torch.ones(4))
    spec = dict(batch=1, seq=4, n_embd=4, vocab=8)
    got = tr._profile_head("fused", spec, torch.device("cpu"), torch.float32)
    assert calls == [("fused", 1, 4, 4, 8, torch.device("cpu"), torch.float32)]
    assert got == {"kernels_per_call": 0, "device_ms_per_call": {}, "top_kernels_per_call": []}


def test_a_2bw_row_is_set_against_the_one_stage_row_without_variants_it_lacks():
    # every one-stage variant a 2bw row does not have listed before the plain row: none is its twin
    from throughput_report import _one_stage_twin

    def ours(name, **kw):
        return dict(gt.row(name, "ours", "m", 1024, 8, 8, optimizer="adamw", compile=True, **kw), status="ok")
    variants = [ours("ours sync adamw no-copies", copies=False), ours("ours sync adamw bf16-params", dtype="bf16-params"),
                ours("ours sync adamw max-autotune", compile_mode="max-autotune"),
                ours("ours sync adamw pdl", inductor="pdl"), ours("ours sync adamw flash-attention", attention="flash"),
                ours("ours sync adamw host-check", nonfinite_check="host"),
                ours("ours sync adamw grad-accum-fusion", gradient_accumulation_fusion=True),
                ours("ours sync adamw graphs", graphs=True)]
    plain = ours("ours sync adamw")
    two = ours("ours 2bw 2st 1gpu adamw", stages=2, transport="gloo")
    assert _one_stage_twin(two, variants + [plain]) is plain
    assert _one_stage_twin(two, variants) is None


def test_a_document_mask_row_at_the_last_cuda_point():
    """--document-mask's cost: one row at smollm-360m / 2048 of a full CUDA run, without graphs
    (refused under the mask), each line of the built-in corpus a document; it changes the numbers
    by design, so its loss difference from the row it varies is recorded, not checked."""
    from throughput_report import variant_checks

    flags = dict(compile=True, head_loss=True, cuda_graphs=True, document_mask=True)
    rows = [r for r in gt.build_plan(_plan_args(), flags, gpus=1)[0] if r.get("document_mask") is not None]
    assert [(r["name"], r["model"], r["seq_len"]) for r in rows] == [("ours sync adamw doc-mask", "smollm-360m", 2048)]
    args = SimpleNamespace(device="cuda", warmup=3, steps=5, threads=None, profile=False)
    cmd = gt.ours_command(rows[0], args, flags, Path("o"), Path("p"))
    assert cmd[cmd.index("--document-mask") + 1] == "10" and "--no-cuda-graphs" in cmd and "--compile" in cmd
    assert "--attention" not in cmd
    assert not any(r.get("document_mask") is not None for r in gt.build_plan(_plan_args(mode="quick"), flags, gpus=1)[0])
    assert gt.detect_cli_flags()["document_mask"] and gt.detect_cli_flags()["attention_flex"]
    plain = dict(gt.row("ours sync adamw", "ours", "m", 1024, 8, 8, optimizer="adamw", compile=True),
                 status="ok", losses=[10.6, 9.8, 7.6], check="ok")
    masked = dict(gt.row("ours sync adamw doc-mask", "ours", "m", 1024, 8, 8, optimizer="adamw", compile=True,
                         document_mask=10), status="ok", losses=[10.6, 9.0, 7.0], check="ok")
    variant_checks([plain, masked])
    assert masked["check"] == "ok" and masked["loss_vs"]["row"] == "ours sync adamw"


def test_a_flex_attention_row_beside_the_document_mask_row():
    """--attention flex at the same point: the same masked attention by FlexAttention's kernel,
    named after the doc-mask row it varies, whose losses it is checked against (the same math,
    unlike the mask against none)."""
    from throughput_report import variant_checks

    flags = dict(compile=True, head_loss=True, cuda_graphs=True, document_mask=True, attention_flex=True)
    rows = [r for r in gt.build_plan(_plan_args(), flags, gpus=1)[0] if r.get("document_mask") is not None]
    assert [r["name"] for r in rows] == ["ours sync adamw doc-mask", "ours sync adamw doc-mask flex-attention"]
    args = SimpleNamespace(device="cuda", warmup=3, steps=5, threads=None, profile=False)
    cmd = gt.ours_command(rows[1], args, flags, Path("o"), Path("p"))
    assert cmd[cmd.index("--attention") + 1] == "flex" and cmd[cmd.index("--document-mask") + 1] == "10"
    assert "--no-cuda-graphs" in cmd and "--compile" in cmd

    def made(name, losses, **kw):
        return dict(gt.row(name, "ours", "m", 1024, 8, 8, optimizer="adamw", compile=True, document_mask=10, **kw),
                    status="ok", losses=losses, check="ok")

    masked = made("ours sync adamw doc-mask", [10.6, 9.0, 7.0])
    close = made("ours sync adamw doc-mask flex-attention", [10.6, 9.0001, 7.0001], attention="flex")
    far = made("ours sync adamw doc-mask flex-attention", [10.6, 9.5, 7.5], attention="flex")
    variant_checks([masked, close])
    assert close["loss_vs"]["row"] == "ours sync adamw doc-mask" and close["check"] == "ok"
    variant_checks([masked, far])
    assert far["check"].startswith("FAIL: losses differ from ours sync adamw doc-mask's")
