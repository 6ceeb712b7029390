"""The GPU proof kit on CPU: the no-GPU run, `make -n gpu-check`, and its comparison and report logic."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncpp_ext.gpu_check import compare_losses, parse_junit, render_markdown
from asyncpp_ext.gpu_check.report import overall_status, read_losses
from asyncpp_ext.gpu_check.runner import plan

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_what_it_would_run_writes_a_report_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "asyncpp_ext.gpu_check", "--out", str(tmp_path / "gc"), "--quick"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "nothing was run" in r.stdout
    assert "would run:" in r.stdout and "--transport gloo" in r.stdout and "-m cuda" in r.stdout
    report = json.loads((tmp_path / "gc" / "report.json").read_text())
    assert report["status"] == "not run" and report["gpus"] == 0
    assert {s["key"] for s in report["sections"]} == {"environment", "build_tests", "cuda_tests", "nccl_self_test", "train_one_gpu",
                                                      "train_two_gpus", "bench_optim", "bench_muon_widths",
                                                      "bench_p2p", "bench_attention", "bench_gpu_throughput", "study"}
    assert all(s["status"] == "not run" for s in report["sections"])
    md = (tmp_path / "gc" / "report.md").read_text()
    assert md.startswith("# asyncpp_ext GPU check: NOT RUN") and "nothing was run" in md
    assert not (tmp_path / "gc" / "runs").exists()  # really nothing ran


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_never_downloads():
    # Under `make test` the outer make's settings would leak in (and add "Entering directory" lines).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "PYTHON=/x/python"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=env).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith("/x/python -m asyncpp_ext.gpu_check --out gpu_check")
    installs = [line for line in lines if "pip" in line]
    assert installs and all(line.startswith("/x/python -m pip install") for line in installs)
    for line in installs:
        for flag in ("--no-index", "--no-deps", "--no-build-isolation"):
            assert flag in line, (flag, line)
    assert not any(word in out for word in ("download", "http", "curl", "wget", "venv", "torch=="))


def test_plan_runs_the_two_gpu_sections_only_with_two_gpus(tmp_path):
    one = {key: skip for key, _, _, skip in plan(tmp_path, 1, quick=True)}
    two = {key: skip for key, _, _, skip in plan(tmp_path, 2, quick=True)}
    assert "needs 2 GPUs" in one["train_two_gpus"] and one["bench_p2p"] is None
    p2p = {g: c for g in (1, 2) for key, _, c, _ in plan(tmp_path, g, quick=True) if key == "bench_p2p"}
    assert p2p[1][0][-3:] == ["--backend", "ipc-cuda", "--json"] and p2p[2][0][-3:] == ["--backend", "nccl", "--json"]
    assert all(v is None for key, v in two.items() if key != "study")
    cmds = {key: c for key, _, c, _ in plan(tmp_path, 2, quick=False)}
    sim, sim_cuda, gloo32, gloo16, ipc32 = cmds["train_one_gpu"]
    assert "--simulate" in sim and "--device" not in sim
    assert "--simulate" in sim_cuda and sim_cuda[sim_cuda.index("--device") + 1] == "cuda"
    for c in (gloo32, gloo16):
        assert c[c.index("--transport") + 1] == "gloo" and c[c.index("--device") + 1] == "cuda"
    # fp32 GPU runs pin Newton-Schulz to fp32, as the CPU run has it
    assert ipc32[ipc32.index("--transport") + 1] == "ipc" and ipc32[ipc32.index("--device") + 1] == "cuda"
    for c in [sim_cuda, gloo32, ipc32] + cmds["train_two_gpus"]:
        assert c[c.index("--ns-dtype") + 1] == "fp32"
        # eager: compiled blocks' embedding gradient is summed by atomic adds on CUDA, in no fixed order
        assert "--no-compile" in c
    assert "--no-compile" not in gloo16  # the bf16 run keeps compiled blocks, the CUDA default

    def config(c):  # the run's settings without where and how it runs
        placement = {"--device", "--transport", "--ns-dtype", "--out"}
        kept, skip = [], False
        for a in c:
            if skip or a in ("--simulate", "--no-compile"):
                skip = False
                continue
            if a in placement:
                skip = True
                continue
            kept.append(a)
        return kept
    assert config(sim) == config(sim_cuda) == config(gloo32) == config(ipc32) == config(cmds["train_two_gpus"][0]) \
        == config(cmds["train_two_gpus"][1])
    assert gloo16[gloo16.index("--dtype") + 1] == "bf16" and sim[sim.index("--dtype") + 1] == "fp32"
    assert sim[sim.index("--schedule") + 1] == "2bw" and "--ef-beta" in sim and "muon" in sim


def test_compare_losses_fp32_bound():
    ref = {s: 4.0 - 0.1 * s for s in range(10)}
    assert compare_losses(ref, dict(ref), rel_tol=1e-4, bitwise=True)["ok"]
    close = {s: v * (1 + 5e-5) for s, v in ref.items()}
    c = compare_losses(ref, close, rel_tol=1e-4)
    assert c["ok"] and c["max_rel"] == pytest.approx(5e-5)
    assert not compare_losses(ref, close, bitwise=True)["ok"]
    off = {**ref, 7: ref[7] * (1 + 2e-4)}
    c = compare_losses(ref, off, rel_tol=1e-4)
    assert not c["ok"] and c["worst_step"] == 7 and "step 7" in c["problems"][0]


def test_compare_losses_bf16_band_and_broken_runs():
    ref = {s: 4.0 * 0.95 ** s for s in range(30)}
    jitter = {s: v * (1 + (0.03 if s % 2 else -0.03)) for s, v in ref.items()}  # within 5%, tail mean ~0
    assert compare_losses(ref, jitter, step_band=0.05, tail_band=0.02)["ok"]
    biased = {s: v * 1.03 for s, v in ref.items()}  # every step within 5%, but the tail is 3% off
    c = compare_losses(ref, biased, step_band=0.05, tail_band=0.02)
    assert not c["ok"] and c["tail_rel"] == pytest.approx(0.03)
    stalled = {s: 4.0 for s in ref}  # a run that does not learn
    assert not compare_losses(ref, stalled, step_band=0.05, tail_band=0.02)["ok"]
    assert not compare_losses(ref, {**ref, 3: float("nan")}, rel_tol=1.0)["ok"]
    assert not compare_losses(ref, {s: v for s, v in ref.items() if s < 29}, rel_tol=1.0)["ok"]
    assert not compare_losses({}, {}, rel_tol=1.0)["ok"]


def test_read_losses_skips_rows_without_a_loss(tmp_path):
    rows = [dict(step=1, loss=3.5), dict(step=2, loss=None, eval_loss=3.0), dict(step=3, loss=3.25)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_losses(tmp_path) == {1: 3.5, 3: 3.25}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="2" tests="6"><testcase classname="tests.test_a" name="test_ok"/><testcase classname="tests.test_a"
name="test_bad"><failure message="assert 1 == 2&#10;more">trace</failure></testcase><testcase
classname="tests.test_b" name="test_err"><error message="fixture broke">trace</error></testcase><testcase
classname="t" name="s1"><skipped message="no"/></testcase><testcase classname="t" name="s2"><skipped/></testcase>
<testcase classname="t" name="ok2"/></testsuite></testsuites>"""


def test_parse_junit_counts_and_names_failures(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    j = parse_junit(tmp_path / "j.xml")
    assert (j["tests"], j["passed"], j["failures"], j["errors"], j["skipped"]) == (6, 2, 1, 1, 2)
    assert j["failed"] == [dict(test="tests.test_a::test_bad", kind="failure", message="assert 1 == 2"),
                           dict(test="tests.test_b::test_err", kind="error", message="fixture broke")]


def test_report_status_and_markdown():
    secs = [dict(key="a", title="A", status="pass", seconds=1.0, figures=dict(x=1.5, rows=[dict(y=2)])),
            dict(key="b", title="B", status="skipped", reason="needs 2 GPUs", seconds=0.0)]
    assert overall_status(secs) == "pass"
    assert overall_status(secs + [dict(status="fail")]) == "fail"
    assert overall_status([dict(status="not run")] * 2) == "not run"
    md = render_markdown(dict(status="pass", summary="1 GPU(s)", sections=secs))
    assert md.startswith("# asyncpp_ext GPU check: PASS")
    assert "| B | skipped | 0 | needs 2 GPUs |" in md and "- x: 1.5" in md and "  - y: 2" in md


def test_a_crashing_test_run_is_a_failed_section_naming_the_signal(tmp_path):
    """A test process that dies (as a segfault in the extension would) writes no JUnit report: the
    section fails and says how the process ended."""
    from asyncpp_ext.gpu_check.runner import section_pytest

    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
             f"--junitxml={tmp_path / 'junit.xml'}"]
    result = section_pytest("build_tests")([crash], tmp_path, tmp_path / "commands.log")
    assert result["status"] == "fail", result
    assert result["reason"].startswith("pytest wrote no report (killed by SIGSEGV)"), result


def test_study_section_is_off_unless_asked_and_fails_on_a_diverged_run(tmp_path, monkeypatch):
    from asyncpp_ext.gpu_check import runner

    assert "--study runs it" in {k: skip for k, _, _, skip in plan(tmp_path, 1, quick=False)}["study"]
    study = {k: (c, skip) for k, _, c, skip in plan(tmp_path, 1, quick=False, study=True)}["study"]
    assert study[1] is None
    assert [c[2:5] for c in study[0]] == [["optimizers", "--scale", "gpu"], ["ef", "--scale", "gpu"]]
    losses = {"optimizers": 3.1, "ef": float("nan")}

    def fake_run(cmd, timeout, log):
        table = cmd[2]
        out = {"runs": [{"label": "muon 2bw", "seed": 0, "final_eval_loss": losses[table]}],
               "summary": {"muon 2bw": {"eval": [3.1, 0], "gap": [0.01, 0], "recovered": None,
                                        "per_seed": {"gap": [0.01]}}},
               "flattening": {"muon": {"flattened": True}}, "seconds": 1.0}
        return {"rc": 0, "stdout": "progress\n" + json.dumps(out), "stderr": "", "seconds": 1.0}

    monkeypatch.setattr(runner, "run", fake_run)
    result = runner.section_study(study[0], tmp_path, tmp_path / "log")
    assert result["status"] == "fail" and "ef: muon 2bw seed 0" in result["reason"]
    assert result["figures"]["optimizers"]["muon 2bw"]["gap"] == [0.01, 0]
    losses["ef"] = 3.2
    assert runner.section_study(study[0], tmp_path, tmp_path / "log")["status"] == "pass"
    assert (tmp_path / "study_ef.json").is_file()


def test_a_bench_section_names_the_failed_checks_of_a_bench_that_exits_1(tmp_path):
    # p2p.py exits 1 when a buffer arrived wrong; its JSON still says which size, per transport
    from asyncpp_ext.gpu_check.runner import section_bench

    report = {"rows": [{"bytes": 1024, "asyncpp_check": True, "torch_check": True},
                       {"bytes": 4096, "asyncpp_check": False, "torch_check": True}]}
    bench = [sys.executable, "-c", f"import sys; print({json.dumps(report)!r}); sys.exit(1)"]
    result = section_bench("bench_p2p")([bench], tmp_path, tmp_path / "commands.log")
    assert (result["status"], result["reason"]) == ("fail", "check failed: [4096]"), result
    # attention_kernels.py: a check is "ok" or "FAIL (> tol)", named by shape and kernel choice
    report = {"rows": [{"shape": "smollm-135m", "first": "cudnn", "check": "ok"},
                       {"shape": "smollm-360m", "first": "flash", "check": "FAIL (> 0.02)"}]}
    bench = [sys.executable, "-c", f"import sys; print({json.dumps(report)!r}); sys.exit(1)"]
    result = section_bench("bench_attention")([bench], tmp_path, tmp_path / "commands.log")
    assert (result["status"], result["reason"]) == ("fail", "check failed: ['smollm-360m flash']"), result
    silent = [sys.executable, "-c", "import sys; sys.exit(3)"]  # no report at all: its exit status
    result = section_bench("bench_p2p")([silent], tmp_path, tmp_path / "commands.log")
    assert result["status"] == "fail" and result["reason"] == "exit code 3", result
