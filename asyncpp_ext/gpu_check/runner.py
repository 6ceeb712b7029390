"""The kit's sections, each a subprocess with its own timeout, and the command line."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .report import (BF16_STEP_BAND, BF16_TAIL_BAND, FP32_REL_TOL, SAME_DEVICE_REL_TOL, compare_losses, overall_status, parse_junit,
                     read_losses, render_markdown)

PKG_PARENT = Path(__file__).resolve().parents[2]  # the directory holding asyncpp_ext (the checkout)
# Seconds per section (limits; the kit takes about 20 minutes on one H100-class GPU).
# The GPU build's own unit tests (not only cuda-marked ones): a crash that only a CUDA build on
# this machine's compiler shows (one did: a refusal in the NCCL bindings) must surface here.
BUILD_TESTS = ["tests/test_nccl_transport.py", "tests/test_optim_api.py", "tests/test_devices.py",
               "tests/test_transports.py"]
TIMEOUTS = dict(build_tests=300, cuda_tests=720, nccl_self_test=120, train_one_gpu=400, train_two_gpus=300, bench_optim=240,
                bench_muon_widths=240, bench_p2p=180, bench_attention=120)
TRAIN_CLI = ["-m", "asyncpp_ext.train"]  # asyncpp-train, as the installed command runs it
SELF_TEST = ("import json, sys; from asyncpp_ext.pipeline.nccl import self_test; "
             "print(json.dumps(self_test('cuda:0', quick=sys.argv[1] == '1')))")


def train_args(out: Path, name: str, steps: int, dtype: str, extra: list) -> list:
    """A 2-stage 2bw Muon+EF run of the tiny model; ``extra`` picks device/transport or --simulate."""
    return [sys.executable, *TRAIN_CLI, "--schedule", "2bw", "--stages", "2", "--optimizer", "muon",
            "--ef-beta", "0.5", "--model", "tiny", "--steps", str(steps), "--seed", "0", "--dtype", dtype,
            "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--out", str(out / "runs" / name), *extra]


def plan(out: Path, gpus: int, quick: bool, study: bool = False) -> list:
    """[(key, title, [commands], reason it is skipped or None)] in running order."""
    steps = 20 if quick else 40
    has_tests = (PKG_PARENT / "tests").is_dir() and (PKG_PARENT / "bench").is_dir()
    no_src = None if has_tests else f"needs a source checkout (tests/ and bench/ beside asyncpp_ext in {PKG_PARENT})"
    # fp32 runs pin Newton-Schulz to fp32 too (auto would be bf16 on CUDA, fp32 on CPU), so only
    # the order of float32 sums differs between the GPU and the CPU. They run eager: compiled
    # blocks sum the embedding's gradient with atomic adds on CUDA (inductor's scatter), whose
    # order varies from run to run, and the transports are compared bit for bit. The bf16 run
    # keeps the CUDA default, compiled blocks.
    fp32_gpu = ["--device", "cuda", "--ns-dtype", "fp32", "--no-compile"]
    one_gpu = [train_args(out, "simulate-fp32", steps, "fp32", ["--simulate"]),
               train_args(out, "simulate-cuda-fp32", steps, "fp32", fp32_gpu + ["--simulate"]),
               train_args(out, "gloo-fp32", steps, "fp32", fp32_gpu + ["--transport", "gloo"]),
               train_args(out, "gloo-bf16", steps, "bf16", ["--device", "cuda", "--transport", "gloo"]),
               train_args(out, "ipc-fp32", steps, "fp32", fp32_gpu + ["--transport", "ipc"])]
    two_gpus = [train_args(out, f"{t}-fp32", steps, "fp32", fp32_gpu + ["--transport", t])
                for t in ("nccl", "torch")]
    two_reason = None if gpus >= 2 else (f"needs 2 GPUs ({gpus} visible): NCCL refuses two ranks on one device; "
                                         "the NCCL self-test covers the transport on one GPU")
    return [
        ("environment", "Environment", [], None),
        ("build_tests", "this build's transport, device and kernel unit tests",
         [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out / 'junit-build.xml'}",
           *BUILD_TESTS]], no_src),
        ("cuda_tests", "cuda-marked tests", [[sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p",
                                              "no:cacheprovider", f"--junitxml={out / 'junit-cuda.xml'}", "tests"]],
         no_src),
        ("nccl_self_test", "NCCL self-test (one GPU)", [[sys.executable, "-c", SELF_TEST, "1" if quick else "0"]],
         None),
        ("train_one_gpu", "2-stage 2bw Muon+EF, both ranks on one GPU (gloo, ipc) vs --simulate (GPU and CPU)",
         one_gpu, None),
        ("train_two_gpus", "2-stage 2bw Muon+EF on 2 GPUs: nccl vs torch transports vs --simulate", two_gpus,
         two_reason),
        ("bench_optim", "bench/optim_step.py on GPU", [[sys.executable, str(PKG_PARENT / "bench" / "optim_step.py"),
                                                        "--device", "cuda", "--json"]], no_src),
        ("bench_muon_widths", "bench/optim_step.py: bf16 Muon vs torch.optim.Muon at widths 256, 1024, 2048 on GPU",
         [[sys.executable, str(PKG_PARENT / "bench" / "optim_step.py"), "--device", "cuda", "--muon-widths",
           "256,1024,2048", "--layers", "2", "--repeats", "10", "--json"]], no_src),
        # two GPUs: the NCCL transport, one rank per GPU; one GPU: the ipc transport with both ranks
        # on it, against gloo through the host (what sharing a GPU cost before)
        ("bench_p2p", "bench/p2p.py on GPU (nccl with 2 GPUs, else ipc-cuda)",
         [[sys.executable, str(PKG_PARENT / "bench" / "p2p.py"), "--backend", "nccl" if gpus >= 2 else "ipc-cuda",
           "--json"]], no_src),
        ("bench_attention", "bench/attention_kernels.py on GPU: torch's, flash's and cuDNN's attention kernels "
         "at the SmolLM shapes against a float32 reference",
         [[sys.executable, str(PKG_PARENT / "bench" / "attention_kernels.py"), "--json", "-"]], no_src),
        ("bench_gpu_throughput", "bench/gpu_throughput.py --quick: asyncpp-train vs Hugging Face tokens/s, MFU, "
         "peak memory", [gpu_throughput_command(out)], no_src),
        ("study", "bench/paper_study.py --scale gpu: the optimizers and ef tables on a 56M Llama (<= 20 min each)",
         study_commands(out), no_src or (None if study else "off by default (about 40 minutes): --study runs it")),
    ]


def run(cmd: list, timeout: float, log: Path) -> dict:
    """Run one command with the kit's asyncpp_ext first on the path; stdout+stderr go to ``log``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PKG_PARENT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    start = time.monotonic()
    # A process group of its own, killed whole on a timeout: a training run's ranks and inductor's
    # compile workers would otherwise go on using the GPU the next sections measure.
    proc = subprocess.Popen(cmd, cwd=PKG_PARENT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_process_group(proc)
        stdout, stderr = proc.communicate()
        rc, stderr = None, (stderr or "") + f"\n[timed out after {timeout:g} s]"
    except BaseException:  # the kit itself is stopping
        kill_process_group(proc)
        raise
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{stdout}\n{stderr}\n[exit {rc}]\n\n")
    return dict(rc=rc, stdout=stdout, stderr=stderr, seconds=time.monotonic() - start)


def kill_process_group(proc) -> None:
    """Kill ``proc``'s whole process group (it was started with start_new_session=True: spawned
    ranks and compile workers go with it, none left to hold the GPU) and reap it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _exit(rc) -> str:
    """How a command ended, in words: a crash names its signal."""
    if rc is None:
        return "timed out"
    if rc < 0:
        import signal

        return f"killed by {signal.Signals(-rc).name}" if -rc in signal.valid_signals() else f"signal {-rc}"
    return f"exit code {rc}"


def _tail(r: dict) -> str:
    lines = (r["stderr"] or r["stdout"]).strip().splitlines()
    return lines[-1][:300] if lines else f"exit code {r['rc']}"


def environment(gpus: int) -> dict:
    from ..info import build_info
    from ..optim._kernels import cuda_arch_coverage

    info = build_info()
    figures = dict(build_info=info, python=sys.version.split()[0])
    try:
        import torch

        figures.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        devices = []
        for i in range(gpus):
            cap = tuple(torch.cuda.get_device_capability(i))
            devices.append(dict(index=i, name=torch.cuda.get_device_name(i), capability=f"{cap[0]}.{cap[1]}",
                                runs_as=cuda_arch_coverage(cap, info["cuda_archs"])))
        figures["gpus"] = devices
    except ImportError:
        figures["torch"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        figures["nvidia_smi"] = q.stdout.strip().splitlines() or q.stderr.strip()
    uncovered = [d for d in figures.get("gpus", []) if d["runs_as"] is None]
    if not info["cuda_compiled"]:
        return dict(status="fail", reason="asyncpp_ext was built without CUDA (no nvcc at build time)", figures=figures)
    if uncovered:
        return dict(status="fail", reason=f"no code for {uncovered[0]['name']} (capability "
                    f"{uncovered[0]['capability']}) in archs {info['cuda_archs']}: set TORCH_CUDA_ARCH_LIST",
                    figures=figures)
    return dict(status="pass", figures=figures)


def section_pytest(key):
    """A pytest run whose --junitxml report gives the counts; no report (a crash) is a failure."""
    def section(cmds, out, log) -> dict:
        junit = Path(next(a for a in cmds[0] if a.startswith("--junitxml=")).split("=", 1)[1])
        junit.unlink(missing_ok=True)
        r = run(cmds[0], TIMEOUTS[key], log)
        return _pytest_outcome(r, junit)
    return section


def _pytest_outcome(r: dict, junit: Path) -> dict:
    if not junit.exists():
        return dict(status="fail", reason=f"pytest wrote no report ({_exit(r['rc'])}): {_tail(r)}",
                    seconds=r["seconds"])
    j = parse_junit(junit)
    failed = j["failures"] + j["errors"]
    status = "fail" if failed or r["rc"] not in (0, 5) else "pass"
    reason = f"{failed} failed" if failed else (None if status == "pass" else _exit(r["rc"]))
    return dict(status=status, reason=reason, figures=j, seconds=r["seconds"])


def section_self_test(cmds, out, log) -> dict:
    r = run(cmds[0], TIMEOUTS["nccl_self_test"], log)
    if r["rc"] != 0:
        return dict(status="fail", reason=_tail(r), seconds=r["seconds"])
    res = json.loads(r["stdout"].strip().splitlines()[-1])
    bad = [c for c in res["cases"] + [res["ordering"]] if c["mismatches"]]
    figures = dict(gpu=res["gpu"], nccl_version=res["nccl_version"], cases=len(res["cases"]),
                   bytes_checked=sum(c["bytes"] for c in res["cases"]), mismatching_cases=bad,
                   ordering_case=res["ordering"], loopback_GBps=res["loopback_gbps"])
    return dict(status="pass" if res["ok"] else "fail", reason=None if res["ok"] else f"{len(bad)} cases differ",
                figures=figures, seconds=r["seconds"])


def _train(cmds, out, log, key) -> tuple:
    """Runs each training command; returns ({run name: losses}, seconds, failure reason or None)."""
    losses, seconds = {}, 0.0
    for cmd in cmds:
        name = Path(cmd[cmd.index("--out") + 1]).name
        shutil.rmtree(out / "runs" / name, ignore_errors=True)
        r = run(cmd, TIMEOUTS[key] / len(cmds), log)
        seconds += r["seconds"]
        if r["rc"] != 0:
            return losses, seconds, f"{name}: {_tail(r)}"
        losses[name] = read_losses(out / "runs" / name)
    return losses, seconds, None


def section_train_one_gpu(cmds, out, log) -> dict:
    losses, seconds, failure = _train(cmds, out, log, "train_one_gpu")
    if failure:
        return dict(status="fail", reason=failure, seconds=seconds)
    sim = losses["simulate-fp32"]
    figures = {"gloo fp32 vs simulate fp32 on the GPU (per-step rel <= %g)" % SAME_DEVICE_REL_TOL:
               compare_losses(losses["simulate-cuda-fp32"], losses["gloo-fp32"], rel_tol=SAME_DEVICE_REL_TOL),
               "gloo fp32 vs simulate fp32 on CPU (per-step rel <= %g)" % FP32_REL_TOL:
               compare_losses(sim, losses["gloo-fp32"], rel_tol=FP32_REL_TOL),
               "gloo bf16 vs simulate fp32 (per-step rel <= %g, last-10 mean rel <= %g)" % (BF16_STEP_BAND, BF16_TAIL_BAND):
               compare_losses(sim, losses["gloo-bf16"], step_band=BF16_STEP_BAND, tail_band=BF16_TAIL_BAND),
               # the same bytes through another transport: the same numbers
               "ipc fp32 vs gloo fp32 (bitwise)": compare_losses(losses["gloo-fp32"], losses["ipc-fp32"], bitwise=True)}
    problems = [p for c in figures.values() for p in c["problems"]]
    return dict(status="fail" if problems else "pass", reason="; ".join(problems) or None, figures=figures,
                seconds=seconds)


def section_train_two_gpus(cmds, out, log) -> dict:
    losses, seconds, failure = _train(cmds, out, log, "train_two_gpus")
    if failure:
        return dict(status="fail", reason=failure, seconds=seconds)
    sim_dir = out / "runs" / "simulate-fp32"  # written by the one-GPU section, same config
    sim = read_losses(sim_dir) if (sim_dir / "metrics.jsonl").exists() else None
    figures = {"nccl vs torch (bitwise)": compare_losses(losses["torch-fp32"], losses["nccl-fp32"], bitwise=True)}
    if sim is not None:
        for t in ("nccl", "torch"):
            figures[f"{t} vs simulate fp32 (per-step rel <= {FP32_REL_TOL:g})"] = compare_losses(
                sim, losses[f"{t}-fp32"], rel_tol=FP32_REL_TOL)
    problems = [p for c in figures.values() for p in c["problems"]]
    return dict(status="fail" if problems else "pass", reason="; ".join(problems) or None, figures=figures,
                seconds=seconds)


def section_bench(key):
    def section(cmds, out, log) -> dict:
        r = run(cmds[0], TIMEOUTS[key], log)
        try:  # read before the exit status: a bench exits 1 when a check failed, and names it here
            data = json.loads(r["stdout"][r["stdout"].index("{"):])
        except ValueError:
            data = None
        if data is None:
            return dict(status="fail", reason=_tail(r) if r["rc"] != 0 else "no JSON report", seconds=r["seconds"])
        (out / f"{key}.json").write_text(json.dumps(data, indent=1))
        rows = data.get("rows", [])
        # optim_step.py's rows carry a check per case; p2p.py's one per transport and size;
        # attention_kernels.py's one per shape and kernel choice ("ok" or "FAIL (> tol)")
        bad = [row.get("case", row.get("bytes", f"{row.get('shape')} {row.get('first')}")) for row in rows
               if any(row.get(k) is False or str(row.get(k, "")).startswith("FAIL")
                      for k in ("check", "asyncpp_check", "torch_check"))]
        reason = f"check failed: {bad}" if bad else (None if r["rc"] == 0 else f"{_exit(r['rc'])}: {_tail(r)}")
        return dict(status="fail" if reason else "pass", reason=reason, figures=data.get("summary", data),
                    seconds=r["seconds"])
    return section


RUNNERS = dict(build_tests=section_pytest("build_tests"), cuda_tests=section_pytest("cuda_tests"), nccl_self_test=section_self_test,
               train_one_gpu=section_train_one_gpu, train_two_gpus=section_train_two_gpus,
               bench_optim=section_bench("bench_optim"),
               bench_muon_widths=section_bench("bench_muon_widths"), bench_p2p=section_bench("bench_p2p"),
               bench_attention=section_bench("bench_attention"))


# --- bench/gpu_throughput.py: tokens/s, TFLOP/s, MFU and peak memory of asyncpp-train against
# Hugging Face eager / torch.compile, in its --quick form (target < 3 min on one H100, not yet timed there; the full bench, ~10 min,
# is run by hand). Passes when every row ran and every row's correctness check held.
TIMEOUTS["bench_gpu_throughput"] = 480


def gpu_throughput_command(out: Path) -> list:
    return [sys.executable, str(PKG_PARENT / "bench" / "gpu_throughput.py"), "--device", "cuda", "--quick",
            "--json", str(out / "gpu_throughput.json")]


def section_gpu_throughput(cmds, out, log) -> dict:
    report = Path(cmds[0][cmds[0].index("--json") + 1])
    report.unlink(missing_ok=True)
    r = run(cmds[0], TIMEOUTS["bench_gpu_throughput"], log)
    if r["rc"] != 0 or not report.exists():
        return dict(status="fail", reason=_tail(r) if r["rc"] != 0 else "the bench wrote no report",
                    seconds=r["seconds"])
    data = json.loads(report.read_text())
    bad = [f"{row['name']} {row['model']} T={row['seq_len']}: {row.get('error') or row.get('check')}"
           for row in data["rows"] if row.get("status") != "ok" or row.get("check") != "ok"]
    figures = dict(data["summary"], device=data["info"]["device_name"], peak_tflops=data["info"]["peak_tflops"],
                   not_run=[f"{name}: {why}" for name, why in data["skipped"]])
    figures.pop("failed", None)
    return dict(status="fail" if bad else "pass", reason="; ".join(bad) or None, figures=figures,
                seconds=r["seconds"])


RUNNERS["bench_gpu_throughput"] = section_gpu_throughput
# --- end of the bench/gpu_throughput.py section


# --- bench/paper_study.py --scale gpu: the paper's comparisons at model scale. Off unless
# --study; each table is sized for <= 20 minutes on one H100. Passes when every run of both tables
# finished with a finite loss; its figures are each row's gap and recovered share (mean, per seed).
STUDY_TABLES = ("optimizers", "ef")
TIMEOUTS["study"] = 2 * 30 * 60  # both tables, with room for the corpus build (~3 min) and compiles


def study_commands(out: Path) -> list:
    return [[sys.executable, str(PKG_PARENT / "bench" / "paper_study.py"), table, "--scale", "gpu", "--json",
             "--plot", str(out / f"study_{table}.png"), "--corpus-dir", str(out / "study_corpus")]
            for table in STUDY_TABLES]


def section_study(cmds, out, log) -> dict:
    figures, bad, seconds = {}, [], 0.0
    for cmd, table in zip(cmds, STUDY_TABLES):
        r = run(cmd, TIMEOUTS["study"] / len(STUDY_TABLES), log)
        seconds += r["seconds"]
        if r["rc"] != 0:
            return dict(status="fail", reason=f"{table}: {_tail(r)}", figures=figures, seconds=seconds)
        data = json.loads(r["stdout"][r["stdout"].index("{"):])
        (out / f"study_{table}.json").write_text(json.dumps(data, indent=1))
        bad += [f"{table}: {run_['label']} seed {run_['seed']}" for run_ in data["runs"]
                if run_["final_eval_loss"] != run_["final_eval_loss"]]  # NaN: the run diverged
        figures[table] = {label: {k: row[k] for k in ("eval", "gap", "recovered")} | {"per_seed": row["per_seed"]}
                          for label, row in data["summary"].items()}
        figures[table]["_flattening"] = data["flattening"]
        figures[table]["_seconds"] = data["seconds"]
    return dict(status="fail" if bad else "pass", reason=f"diverged: {bad}" if bad else None, figures=figures,
                seconds=seconds)


RUNNERS["study"] = section_study


def count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpp_ext.gpu_check", description=__doc__)
    ap.add_argument("--out", default="gpu_check", help="report directory (default gpu_check/)")
    ap.add_argument("--quick", action="store_true", help="fewer training steps, one 64 MiB self-test case")
    ap.add_argument("--study", action="store_true",
                    help="also run the paper-scale study section (bench/paper_study.py --scale gpu, ~40 min)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    log.write_text("")
    gpus = count_gpus()
    sections = []
    for key, title, cmds, skip in plan(out, gpus, args.quick, args.study):
        sec = dict(key=key, title=title, commands=cmds, seconds=0.0)
        if gpus == 0:
            sec.update(status="not run", reason="no GPU visible: nothing was run")
            print(f"[not run] {title}" + "".join(f"\n    would run: {' '.join(c)}" for c in cmds))
        elif skip:
            sec.update(status="skipped", reason=skip)
        else:
            print(f"[running] {title}", flush=True)
            start = time.monotonic()
            try:
                sec.update(environment(gpus) if key == "environment" else RUNNERS[key](cmds, out, log))
            except Exception as e:  # a section's own bug is its failure, not the kit's end
                sec.update(status="fail", reason=f"{type(e).__name__}: {e}")
            sec["seconds"] = sec["seconds"] or time.monotonic() - start  # sections that time themselves keep theirs
        print(f"[{sec['status']}] {title}" + (f": {sec['reason']}" if sec.get("reason") else ""), flush=True)
        sections.append(sec)
    status = overall_status(sections)
    summary = ("No GPU is visible, so nothing was run; the sections below list what a GPU machine runs."
               if gpus == 0 else f"{gpus} GPU(s); {sum(s['status'] == 'fail' for s in sections)} section(s) failed.")
    report = dict(status=status, summary=summary, gpus=gpus, quick=args.quick, sections=sections)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render_markdown(report))
    print(f"{summary}\nreport: {out / 'report.md'}")
    return 1 if status == "fail" else 0
