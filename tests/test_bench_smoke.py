"""Smoke tests of the pipeline benchmarks (tiny settings) so they keep running."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import memory as memory_bench  # noqa: E402
import real_compute  # noqa: E402
import schedule_efficiency  # noqa: E402

pytestmark = pytest.mark.multiproc


def test_real_compute_runs_every_schedule_and_explains_its_time(capsys):
    assert real_compute.main(["--model", "tiny", "--steps", "2", "--warmup", "1", "--repeats", "1",
                              "--micro-batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["impl"], r["schedule"]) for r in result["rows"]] == real_compute.RUNS
    assert result["tokens_per_step"] == 4 * 4 * 32
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["steady_tokens_per_s"] > 0
        assert len(row["cpu_share"]) == 2 and all(c > 0 for c in row["cpu_share"])
    torch_1f1b = next(r for r in result["rows"] if (r["impl"], r["schedule"]) == ("torch", "1f1b"))
    assert torch_1f1b["ratio_to_torch_1f1b"] == 1.0
    assert result["theory_ratio"] == pytest.approx(1.25)
    for row in result["rows"]:
        if row["impl"] != "ours":
            continue
        assert len(row["stages"]) == 2
        for st in row["stages"]:
            # Traced time cannot exceed the wall time it was measured in.
            assert st["forward_ms_per_mb"] > 0 and st["backward_ms_per_mb"] > 0
            assert 0 < st["compute_frac"] + st["wait_frac"] <= 1


def test_real_compute_table_names_the_theory(capsys):
    report = {"model": "tiny", "stages": 2, "microbatches": 4, "micro_batch_size": 2, "tokens_per_step": 256,
              "steps": 10, "warmup": 1, "repeats": 1, "machine": "m", "loadavg_1min_before_after": [0.0, 0.0],
              "ratio_2bw_over_1f1b": 1.2, "steady_ratio_2bw_over_1f1b": 1.22, "theory_ratio": 1.25, "theory_ratio_k_steps": 1.22,
              "trace_predicted_ratio": 1.21,
              "rows": [{"impl": "torch", "schedule": "1f1b", "tokens_per_s": 100.0, "ratio_to_torch_1f1b": 1.0,
                        "steady_tokens_per_s": 110.0, "steady_ratio_to_torch_1f1b": 1.0, "cpu_share": [0.9, 0.8],
                        "tokens_per_cpu_s": 60.0,
                        "tokens_per_s_all": [100.0]}]}
    text = real_compute.format_report(report)
    assert "theory (m+S-1)/m = 1.250" in text and "torch   1f1b" in text


def test_real_compute_ties_measures_six_variants_and_renders_them(capsys):
    assert real_compute.main(["--ties", "--steps", "2", "--warmup", "1", "--repeats", "1",
                              "--micro-batch-size", "2", "--vocab-size", "512", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["variant"], r["schedule"]) for r in result["rows"]] == real_compute.TIE_RUNS
    assert len(result["rows"]) == 6
    assert result["tokens_per_step"] == 4 * 2 * 64
    # Tying removes exactly one vocab x width matrix from the parameter count.
    assert result["tied_matrix_numel"] == 512 * 128
    assert result["parameters"]["untied"] - result["parameters"]["tied"] == 512 * 128
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["steady_tokens_per_s"] > 0
        assert len(row["stages"]) == 2
        assert all(0 < st["compute_frac"] + st["wait_frac"] <= 1 for st in row["stages"])
        if row["variant"] == "untied":
            assert row["ratio_to_untied"] == 1.0 and row["steady_ratio_to_untied"] == 1.0
    assert set(result["ratio_2bw_over_1f1b"]) == set(real_compute.TIE_VARIANTS)
    text = real_compute.format_ties_report(result)
    assert "vocabulary 512" in text and "tied+clip  1f1b" in text


def test_real_compute_ties_rejects_a_vocabulary_below_the_corpus_bytes(capsys):
    with pytest.raises(SystemExit):
        real_compute.main(["--ties", "--vocab-size", "100"])
    assert "vocab_size must be an integer >= 256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        real_compute.main(["--ties", "--model", "tiny"])
    assert "--model does not apply with --ties" in capsys.readouterr().err


@pytest.mark.parametrize("ef,state_copies", [("on", 3), ("weights", 2)])
def test_memory_bench_matches_the_design_formula_on_2bw_with_ef(capsys, ef, state_copies):
    assert memory_bench.main(["--model", "tiny", "--stages", "2", "--microbatches", "4", "--steps", "2",
                              "--schedules", "2bw", "--ef", ef,
                              "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert r["weight_versions"] == 2
        assert r["ef"] and r["ef_source"] == {"on": "buffer", "weights": "weights"}[ef]
        # 2 weight versions, AdamW moments (+ the EF buffer unless EF reads the weight versions),
        # and S - s microbatches in flight.
        assert r["measured"]["weights"] == 2 * r["param_bytes"]
        assert r["measured"]["optimizer_state"] == state_copies * r["param_bytes"]
        assert r["in_flight"] == 2 - r["stage"]
        assert r["measured"]["peak_activations"] == r["predicted"]["peak_activations"] > 0
        assert r["max_rss"] > r["measured_total"]


def test_memory_bench_counts_pipedreams_weight_versions(capsys):
    """pipedream keeps S - s weight versions on stage s: (S - s) x the stage's weight bytes."""
    assert memory_bench.main(["--model", "tiny", "--stages", "3", "--microbatches", "3", "--steps", "3",
                              "--micro-batch-size", "2", "--schedules", "pipedream", "--ef", "off", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["weight_versions"] for r in rows] == [3, 2, 1]
    for r in rows:
        assert r["measured"]["weights"] == (3 - r["stage"]) * r["param_bytes"]
        assert r["measured"] == r["predicted"]


def test_memory_bench_rejects_fewer_microbatches_than_stages(capsys):
    with pytest.raises(SystemExit):
        memory_bench.main(["--stages", "4", "--microbatches", "2"])
    assert "--microbatches must be >= --stages" in capsys.readouterr().err


def test_schedule_efficiency_runs_ours_and_torchs_schedules(capsys):
    """2 stages, 2 microbatches, 4 steps of 5 ms "kernels": every run completes and reports its
    throughput. Which schedule is faster is the benchmark's finding, not a unit test's: a loaded
    machine may reorder them in a run this short."""
    assert schedule_efficiency.main(["--stages", "2", "--microbatches", "2", "--steps", "4",
                                     "--warmup", "1", "--fwd-ms", "5", "--json"]) == 0
    rows = {(r["impl"], r["schedule"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == set(schedule_efficiency.RUNS)
    assert rows["torch", "1f1b"]["ratio_to_torch_1f1b"] == 1.0
    assert all(r["steps_per_s"] > 0 for r in rows.values())
    for r in rows.values():  # the waits end at deadlines: no stage is faster than asked
        assert r["calibrated_fwd_ms"] >= 5 and r["calibrated_last_fwd_ms"] >= 5
        assert r["calibrated_bwd_ms"] >= 10 and r["calibrated_last_bwd_ms"] >= 10
        slowest_ms = max(r["calibrated_fwd_ms"] + r["calibrated_bwd_ms"],
                         r["calibrated_last_fwd_ms"] + r["calibrated_last_bwd_ms"])
        # m = 2 microbatches x 4 steps at the slowest stage's pace (pipedream's 8 one-microbatch
        # steps count as 4)
        assert r["achieved_over_calibrated_ideal"] == pytest.approx(2 * slowest_ms * 1e-3 * 4 / r["seconds"])


def test_optim_step_bench_checks_every_case_and_splits_the_step(capsys):
    import optim_step

    optim_step.main(["--layers", "1", "--width", "64", "--repeats", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    # the row against torch.optim.Muon needs torch >= 2.9; the others run on every torch
    expected = {"muon fp32-NS", "adamw", "muon bf16 EF on (beta 0.5)"} | (
        {"muon bf16-NS"} if hasattr(torch.optim, "Muon") else set())
    assert {r["case"] for r in rows} >= expected
    assert ("muon bf16-NS" in {r["case"] for r in rows}) == hasattr(torch.optim, "Muon")
    for r in rows:
        assert r["ours"]["median_ms"] > 0 and r["ref"]["median_ms"] > 0
        if r["err_bound"] is not None:
            assert r["check"] == "ok", r
    assert result["info"]["cpu_kernel_isa"] in ("avx512f", "avx2", "baseline")
    (cpu,) = [b for b in result["breakdowns"] if b["device"] == "cpu"]
    phases = cpu["phases_ms"]
    assert set(phases) == {"NaN/Inf scan", "momentum kernel", "Newton-Schulz", "apply kernel",
                           "other (Python, lists)"}
    assert all(ms > 0 for label, ms in phases.items() if label != "other (Python, lists)")


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_optim_step_width_sweep_compares_with_torch_muon_at_every_width(capsys):
    import optim_step

    optim_step.main(["--muon-widths", "32,64", "--layers", "1", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [r["case"] for r in rows] == ["muon bf16-NS width 32", "muon bf16-NS width 64"]
    assert [r["params"] for r in rows] == [12 * 32 * 32, 12 * 64 * 64]  # 3w*w + w*w + 2 * 4w*w
    assert all(r["reference"] == "torch.optim.Muon" and r["check"] == "ok" for r in rows), rows
    assert result["info"]["cpu_bf16"] in ("bf16 dot products (AVX512-BF16 or AMX)", "no bf16 dot products")
    assert [r["ns_gflop"] for r in rows] == [optim_step.ns_flops(optim_step.gpt_matrices(1, w)) / 1e9 for w in (32, 64)]
    if optim_step.bf16_matmul_choice()[0] == "native":  # the matmul bound, from the row's own times
        for r in rows:
            assert r["mm_tflops"] > 0 and r["speedup_ceiling"] == pytest.approx(r["mm_tflops"] / r["ref_tflops"])
            assert r["ours_tflops"] == pytest.approx(r["ns_gflop"] / r["ours"]["median_ms"])
    else:
        assert all("speedup_ceiling" not in r for r in rows)
    for r in rows:
        assert r["ref"]["p10_ms"] <= r["ref"]["median_ms"] <= r["ref"]["p90_ms"]


def test_bench_percentiles_stay_inside_the_measured_range():
    import optim_step

    s = optim_step.summary([0.010, 0.001, 0.003])
    assert 1.0 <= s["p10_ms"] <= s["median_ms"] == 3.0 <= s["p90_ms"] <= 10.0


@pytest.mark.parametrize("widths", ["", "256,x", "0", "256,-1"])
def test_optim_step_width_sweep_refuses_bad_widths(widths, capsys):
    import optim_step

    with pytest.raises(SystemExit) as e:
        optim_step.main(["--muon-widths", widths])
    assert e.value.code == 2
    assert "--muon-widths" in capsys.readouterr().err


def test_optim_step_bench_flop_count_matches_torchs_flop_counter():
    """The TFLOP/s the benchmark reports rests on ns_flops; torch's FlopCounterMode counts the
    products orthogonalize actually runs (wide, tall and square shapes)."""
    import optim_step
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from asyncpp_ext.optim import orthogonalize

    shapes = [(192, 64), (64, 64), (256, 64), (64, 256)]
    counted = 0
    for shape in shapes:
        v = torch.randn((1,) + shape)
        with FlopCounterMode(display=False) as counter:
            orthogonalize(v, v.flatten(1).norm(dim=1))
        counted += counter.get_total_flops()
    assert optim_step.ns_flops(shapes) == counted


@pytest.mark.parametrize("backend", ["socket", "gloo", "ipc"])
def test_p2p_moves_every_size_intact_through_our_transports(capsys, monkeypatch, backend):
    import p2p

    monkeypatch.setenv("ASYNCPP_RECV_SPIN_US", "250")  # the ranks' setting, reported as such
    # (--iters 20: the transports' checks, not their timing, are the test's)
    assert p2p.main(["--backend", backend, "--min-kib", "256", "--max-mib", "1", "--iters", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == backend and result["recv_spin_us"] == 250
    assert [r["bytes"] for r in result["rows"]] == [256 << 10, 1 << 20]
    assert [r["iters"] for r in result["rows"]] == [20, 20]
    assert all(r["asyncpp_check"] and r["torch_check"] and r["asyncpp_us"] > 0 for r in result["rows"])


@pytest.mark.parametrize("argv, words", [(["--min-kib", "0"], "--min-kib"), (["--iters", "0"], "--iters"),
                                         (["--backend", "ipc-cuda"], "torch sees none"),
                                         (["--backend", "nccl"], "needs two GPUs"),
                                         (["--max-mib", "4096"], "--max-mib 4096: the two ranks hold about 8 buffers "
                                          "of the largest message, more than this machine's 16384 MiB of memory; "
                                          "use at most 2048")])
def test_p2p_bad_inputs_are_one_line_and_exit_2(capsys, monkeypatch, argv, words):
    import p2p

    monkeypatch.setattr(p2p, "memory_mib", lambda: 16384)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine with GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert p2p.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("p2p.py: error: ") and words in err, err


def test_gpu_runbook_refuses_an_unknown_step_before_any_runs(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_runbook.sh"), "head", "nosuch"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r
    assert r.stderr.startswith("gpu_runbook.sh: unknown step 'nosuch'; choose from build 135m tests")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the steps fail at once only without a GPU")
def test_gpu_runbook_notes_a_failed_step_and_goes_on(tmp_path):
    # Without a GPU the head and attention steps fail at once (no CUDA GPU); the exit status
    # counts both, and each step left its log.
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_runbook.sh"), "head", "attention"], env=env,
                       capture_output=True, text=True, timeout=120)
    steps = (tmp_path / "steps.txt").read_text()
    assert "== head (limit 120 s)" in steps and "== attention (limit 150 s)" in steps
    assert r.returncode == 2 and "no CUDA GPU is visible" in (tmp_path / "head.log").read_text()
    assert "no CUDA GPU is visible" in (tmp_path / "attention.log").read_text()
    assert "== 2 step(s) failed; logs and JSON in" in r.stdout


@pytest.mark.parametrize("argv, words", [
    (["--stages", "0"], "--stages must be >= 2, got 0 (the schedules compared are pipelines)"),
    (["--stages", "1", "--microbatches", "2"], "--stages must be >= 2, got 1 (the schedules compared are pipelines)"),
    (["--stages", "2", "--microbatches", "2", "--steps", "-1"], "--steps must be >= 1, got -1"),
    (["--fwd-ms", "nan"], "--fwd-ms must be a positive number of milliseconds, got nan"),
])
def test_schedule_efficiency_bad_inputs_are_one_line_before_any_rank(capsys, argv, words):
    """--stages 0 was a rank's FileNotFoundError traceback after 12 s, --stages 1 torch's refusal from a
    rank; --fwd-ms nan printed a table of nan."""
    with pytest.raises(SystemExit) as info:
        schedule_efficiency.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].endswith(f"error: {words}"), err


@pytest.mark.parametrize("rounds", ["0", "1"])
def test_omp_contention_needs_two_rounds(capsys, rounds):
    import omp_contention

    with pytest.raises(SystemExit) as info:
        omp_contention.main(["--rounds", rounds])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.endswith(f": error: --rounds must be >= 2 (a spread needs two timings of each case), got {rounds}\n")


def test_memory_refuses_a_selection_with_nothing_to_measure(capsys):
    with pytest.raises(SystemExit) as info:
        memory_bench.main(["--ef", "weights", "--schedules", "gpipe", "1f1b"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert "--ef weights reads the previous weight version, which gpipe and 1f1b do not keep" in err


def test_memory_refuses_one_step(capsys):
    """One step shows neither 2bw's second weight version nor EF's buffer, which its table reports."""
    with pytest.raises(SystemExit) as info:
        memory_bench.main(["--steps", "1"])
    assert info.value.code == 2 and capsys.readouterr().err.strip().endswith("error: --steps must be >= 2 (got 1)")


@pytest.mark.parametrize("argv, words", [
    (["prepare_data.py", "--mb", "0"], "--mb must be a positive number of megabytes, got 0.0"),
    (["prepare_data.py", "--workers", "0"], "--workers must be >= 1, got 0"),
    (["real_compute.py", "--ties", "--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
])
def test_bench_sizes_are_checked_before_the_work_starts(argv, words):
    """Each ran on at its default size before (a corpus of 200 MB written and tokenized, or a
    pipeline started), to fail late or not at all."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(f"error: {words}"), r.stderr
