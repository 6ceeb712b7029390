"""One row of bench/gpu_throughput.py, start to finish: ours as ``python -m asyncpp_ext.train`` and the
reading of its metrics.jsonl, and a row measured in a worker process (``gpu_throughput.py --worker
SPEC``, throughput_workers.py: the Hugging Face training loop, torchtitan's Llama and the head-loss
pair), whose one RESULT_TAG line it reads. Each row's process (row_process.py) may start ahead of
its turn, while the row before runs, and wait after its imports: what a row costs the run is then
what follows its turn, and each row's timeline says where that went."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from row_process import ROOT, RowProcess, timeline, wall_times  # noqa: F401 (ROOT: re-exported)
from throughput_model import hf_config_dict, model_shape

PROG = "gpu_throughput.py"
SCRIPT = Path(__file__).resolve().with_name(PROG)  # re-invoked per worker row: `gpu_throughput.py --worker SPEC`
RESULT_TAG = "GPU_THROUGHPUT_RESULT "
# Runs `python -m asyncpp_ext.train ARGS` (asyncpp-train) in this process, then records the process's
# peak memory and leaves without the interpreter's finalisation (seconds of a compiled model's
# garbage and CUDA teardown that are no part of the row: its files are written and closed by then).
OURS_DRIVER = r"""
import json, os, resource, runpy, sys
peak_file = sys.argv[1]
sys.argv = ["asyncpp-train"] + sys.argv[2:]
if os.environ.get("GPU_THROUGHPUT_GATED"):  # started ahead: the imports now, then wait for the turn
    import asyncpp_ext.training.cli, torch._dynamo, torch._inductor.compile_fx, matplotlib
    matplotlib.use("Agg")  # as the end's loss.png has it (training/run_files.py)
    import matplotlib.pyplot
    if os.environ["GPU_THROUGHPUT_GATED"] == "forkserver":
        from asyncpp_ext.pipeline.start_method import start_forkserver_early
        start_forkserver_early(("asyncpp_ext.training.distributed", "torch._inductor.compile_fx"))
    sys.path.insert(0, os.environ["GPU_THROUGHPUT_BENCH_DIR"])
    from row_process import wait_for_turn
    sys.path.remove(os.environ["GPU_THROUGHPUT_BENCH_DIR"])  # the run sees the path a row started at its turn would
    wait_for_turn()
rc = 1
try:
    runpy.run_module("asyncpp_ext.train", run_name="__main__", alter_sys=True)
    rc = 0
except SystemExit as exc:
    if isinstance(exc.code, str):
        sys.stderr.write(exc.code + "\n")
    rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
finally:
    import torch
    peak = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_alloc_bytes"] = max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    with open(peak_file, "w") as f:
        json.dump(peak, f)
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
"""


# --------------------------------------------------------------------------------------------
# Running rows


INDUCTOR_PRESETS = {
    # inductor's own concatenations (its defaults for these options in torch 2.11-2.13): a
    # concatenation of up to 8 inputs fused into one kernel of masked loads, against which the
    # compiled blocks' CUDA default (models/compile_support.DEVICE_OPTIONS: each input computed
    # straight into its slice by a kernel of its own) is measured
    "cat-fused": {"max_pointwise_cat_inputs": 8, "max_complex_pointwise_cat_inputs": 8},
    # independent kernels of one graph merged into one launch (inductor's horizontal fusion): fewer
    # of the ~10,700 kernel boundaries per smollm-360m step, whose gaps inside the CUDA graphs came
    # to ~18 ms (docs/gpu.md); the rotary backward's q, k and v parts, say, written in place by three
    # kernels, in one
    "combo-kernels": {"combo_kernels": True},
    # programmatic dependent launch (Hopper and newer): each Triton kernel is launched while the one
    # before it finishes and waits in its prologue for the data it reads -- the gaps between the
    # kernels inside a CUDA graph, the ~18 ms per step above, are what it could shorten
    "pdl": {"triton.enable_pdl": True},
    # the two together: the candidate default if each wins on its own
    "combo-kernels-pdl": {"combo_kernels": True, "triton.enable_pdl": True},
    # the RMSNorm backward's mix-order reduction with 64 rows per partial sum instead of the 16
    # inductor picks for 132 SMs: the two finishing sums per block (aten, ~10 us each, 520 per
    # smollm-360m step) over 128 partial rows instead of 512, the main kernel with fewer programs
    "mix-order-64": {"triton.mix_order_reduction_split_size": 64},
}
"""A row's ``inductor`` name -> the ``--inductor-option`` values it passes."""


VARIANT_SUFFIXES = (
    # (row field, its value -> the suffix it adds to an ours row's name, or ""), in the order the
    # suffixes stand in a name, innermost first. ``eager`` is no variant of a row: an eager row is
    # a plain row of its own (its losses are not checked against the compiled row's).
    ("compile", lambda v: " eager" if v is False else ""),
    ("transport", lambda v: " ipc" if v == "ipc" else ""),
    ("graphs", lambda v: " graphs" if v else ""),
    ("copies", lambda v: " no-copies" if v is False else ""),
    ("dtype", lambda v: " bf16-params" if v == "bf16-params" else ""),
    ("scope", lambda v: " stage-compile" if v == "stage" else ""),
    ("compile_mode", lambda v: f" {v}" if v else ""),
    ("inductor", lambda v: f" {v}" if v else ""),
    ("gradient_accumulation_fusion", lambda v: " grad-accum-fusion" if v else ""),
    ("document_mask", lambda v: " doc-mask" if v is not None else ""),
    ("attention", lambda v: f" {v}-attention" if v else ""),
    ("nonfinite_check", lambda v: f" {v}-check" if v else ""),
    ("clip_grad_norm", lambda v: " clip" if v else ""),
)
"""How an ours row's name says how it computes: the one table the plan names rows by
(throughput_plan.ours) and the report reads them back by (throughput_report: which row a variant
varies)."""


def variant_suffixes(fields: dict) -> list:
    """The suffixes ``fields`` (a row, or the plan's keywords for one) add to an ours row's name, in
    name order; ``eager`` included."""
    return [s for s in (suffix(fields.get(key)) for key, suffix in VARIANT_SUFFIXES) if s]


def inductor_preset(name) -> dict:
    """The options of INDUCTOR_PRESETS[name] this torch's inductor has (the names move between
    releases; asyncpp-train refuses a name it does not have), {} for None."""
    if not name:
        return {}
    from torch._inductor import config

    known = config.get_config_copy()
    return {k: v for k, v in INDUCTOR_PRESETS[name].items() if k in known}


def ours_command(r: dict, args, flags: dict, out_dir: Path, peak_file: Path) -> list:
    shape = model_shape(r["model"], r["seq_len"])
    cmd = [sys.executable, "-c", OURS_DRIVER, str(peak_file), *shape["cli_flags"],
           "--device", args.device, "--dtype", r.get("dtype") or ("bf16" if args.device == "cuda" else "fp32"),
           "--stages", str(r["stages"]), "--schedule", r["schedule"],
           "--micro-batch-size", str(r["micro_batch_size"]), "--microbatches", str(r["microbatches"]),
           "--optimizer", r["optimizer"], "--steps", str(args.warmup + args.steps + PROFILED_STEPS * bool(args.profile)),
           "--seed", "0",
           "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--timeout", "900",
           "--out", str(out_dir), "--data", "builtin"]
    if r["stages"] == 1:
        cmd += ["--ef-beta", "0"]
    if flags.get("no_checkpoints"):
        # Neither the end's evaluation (under --compile a no-grad graph per region to compile) nor
        # the final checkpoint (weights and optimizer state to disk, checksummed): the Hugging Face
        # rows do neither, and on a GPU both cost seconds of each row's wall time, none of its steps.
        cmd += ["--eval-batches", "0", "--no-checkpoints"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if r["transport"]:
        cmd += ["--transport", r["transport"]]
    if flags["compile"] and r["compile"] is not None:
        cmd += ["--compile" if r["compile"] else "--no-compile"]
    if flags["head_loss"]:
        cmd += ["--head-loss", "auto"]
    if args.device == "cuda" and flags.get("cuda_graphs"):
        # Said either way: the CLI's default differs by schedule (on for sync), and a row's name
        # says whether it replays graphs.
        cmd += ["--cuda-graphs" if r.get("graphs") else "--no-cuda-graphs"]
    if r.get("copies") is False:
        cmd += ["--no-compute-copies"]
    if r.get("scope"):
        cmd += ["--compile-scope", r["scope"]]
    if r.get("compile_mode"):
        cmd += ["--compile-mode", r["compile_mode"]]
    if r.get("attention"):
        cmd += ["--attention", r["attention"]]
    if r.get("nonfinite_check"):
        cmd += ["--nonfinite-check", r["nonfinite_check"]]
    if r.get("clip_grad_norm"):
        cmd += ["--clip-grad-norm", str(r["clip_grad_norm"])]
    if r.get("gradient_accumulation_fusion"):
        cmd += ["--gradient-accumulation-fusion"]
    if r.get("document_mask") is not None:
        cmd += ["--document-mask", str(r["document_mask"])]
    for name, value in inductor_preset(r.get("inductor")).items():
        cmd += ["--inductor-option", f"{name}={value}"]
    if args.profile:  # traced after the measured steps, which the tracing therefore never slows
        first = args.warmup + args.steps + 1
        cmd += ["--profile-steps", f"{first}:{first + PROFILED_STEPS - 1}"]
    return cmd


PROFILED_STEPS = 2
"""Steps ``--profile`` traces in ours' rows, after the warm-up and the measured steps."""


def read_profile(out_dir: Path) -> dict | None:
    """``--profile``: each rank's device-busy share, and kernels and device time by kind per step,
    from the run's profile/summary_*.json (training/profiling.py)."""
    ranks = {}
    for path in sorted((out_dir / "profile").glob("summary_*.json")):
        s = json.loads(path.read_text())
        ranks[path.stem.removeprefix("summary_")] = per_step_profile(s, s["steps"][1] - s["steps"][0] + 1)
    return ranks or None


def per_step_profile(s: dict, steps: int) -> dict:
    """A trace summary (training/profiling.summarize_trace) of ``steps`` steps, per step: what a
    row's ``profile`` holds for each process (ours' ranks, a Hugging Face row's one process)."""
    return {
        "device_busy_share": s["device_busy_share"], "kernels_per_step": round(s["kernels"] / steps),
        "device_ms_per_step": {k: round(v / steps, 2) for k, v in s["device_ms_by_kind"].items()},
        "window_ms_per_step": round(s["window_ms"] / steps, 2),
        # the costliest kernels by name (which attention kernel ran, which fusions cost most)
        "top_kernels_ms_per_step": [{"name": k["name"], "kind": k["kind"], "ms": round(k["ms"] / steps, 2),
                                     "launches": round(k["launches"] / steps)}
                                    for k in s.get("top_kernels", [])],
        # where the device waited inside the steps, and the longest waits (not per step)
        "idle_between_ms_per_step": (round(s["idle_between_ms"] / steps, 2)
                                     if s.get("idle_between_ms") is not None else None),
        "idle_gaps": s.get("idle_gaps", [])}


def worker_command(spec: dict) -> list:
    return [sys.executable, str(SCRIPT), "--worker", json.dumps(spec)]


def failure_text(res: dict, timeout: float) -> tuple[str, str]:
    """(status, one-line reason) of a failed process."""
    if res["rc"] is None:
        return "timeout", f"timed out after {timeout:g} s"
    text = res["stderr"] + res["stdout"]
    if re.search(r"out of memory|OutOfMemoryError", text, re.IGNORECASE):
        return "oom", "out of memory"
    lines = [ln for ln in res["stderr"].strip().splitlines() if ln.strip()] or \
            [ln for ln in res["stdout"].strip().splitlines() if ln.strip()]
    return "error", (lines[-1][:300] if lines else f"exit code {res['rc']}")


def package_warnings(stderr: str, limit: int = 3) -> list:
    """The package's own messages in a row's stderr ("asyncpp: ...": a compile, CUDA-graph capture
    or head-kernel fallback, a rank's report), each once, as notes: a variant that fell back ran as
    something other than its name says, and its figures must be read so. Indented lines are left
    out: Python prints a warning's source line under it, indented."""
    seen = []
    for line in stderr.splitlines():
        at = line.find("asyncpp: ")
        text = line[at:].strip()[:200] if at >= 0 and not line[:1].isspace() else ""
        if text and text not in seen:
            seen.append(text)
    more = [f"(+{len(seen) - limit} more in the row's stderr)"] if len(seen) > limit else []
    return [f"warned: {t}" for t in seen[:limit]] + more


def _read_metrics(path: Path) -> list:
    """The rows of a run's metrics.jsonl; a run killed while writing may leave a last line cut
    short, which is not a row."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _ours_paths(r: dict, work: Path) -> tuple[Path, Path]:
    out_dir = work / re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{r['name']}-{r['model']}-{r['seq_len']}")
    return out_dir, out_dir.with_suffix(".peak.json")


def start_row(r: dict, args, flags: dict, work: Path, gated: bool = False) -> RowProcess:
    """The process of row ``r`` (ours' driver or a worker), started now; ``gated``: ahead of its turn."""
    if r["impl"] != "ours":
        return RowProcess(worker_command(worker_spec(r, args)), gated="1" if gated else None)
    out_dir, peak_file = _ours_paths(r, work)
    shutil.rmtree(out_dir, ignore_errors=True)
    peak_file.unlink(missing_ok=True)
    gate = ("forkserver" if r["stages"] > 1 else "1") if gated else None
    return RowProcess(ours_command(r, args, flags, out_dir, peak_file), gated=gate)


def run_ours(r: dict, args, flags: dict, work: Path, proc: RowProcess | None = None) -> dict:
    """Row ``r`` of ours, in ``proc`` (started ahead by start_row) or a process started now."""
    out_dir, peak_file = _ours_paths(r, work)
    proc = proc or start_row(r, args, flags, work)
    cmd = proc.cmd
    r["command"] = " ".join(c if c != OURS_DRIVER else "<driver: python -m asyncpp_ext.train>" for c in cmd[1:])
    multi = r["stages"] > 1
    res = proc.finish(args.row_timeout, sampler_device=args.device if multi else None)
    r["wall_s"] = round(res["seconds"], 1)
    r["notes"] = [*r.get("notes", []), *res.get("notes", []), *package_warnings(res["stderr"])]
    measured = args.warmup + args.steps
    metrics = _read_metrics(out_dir / "metrics.jsonl")
    if res["rc"] != 0:
        status, reason = failure_text(res, args.row_timeout)
        if len(metrics) < measured:
            r["status"], r["error"] = status, reason
            return r
        # it ended badly after its measured steps (while tracing them, say): their figures stand
        r["notes"] = [*r.get("notes", []), f"exited after its measured steps ({status}: {reason})"]
    metrics = metrics[:measured]  # not the traced steps --profile adds
    if args.profile:
        r["profile"] = read_profile(out_dir)
    r["losses"] = [m.get("loss") for m in metrics]
    r["elapsed_s"] = [m["elapsed_s"] for m in metrics]
    r["tokens"] = [m["tokens"] for m in metrics]
    # the steps' clock on the wall clock (a resumed run's elapsed_s would count its earlier runs;
    # the bench's runs start fresh)
    clock = metrics[0]["time"] - metrics[0]["elapsed_s"] if metrics and "time" in metrics[0] else None
    r["times"] = wall_times(res, clock)
    r["timeline"] = timeline(r["times"], r["elapsed_s"])
    peak = json.loads(peak_file.read_text()) if peak_file.exists() else {}
    if multi:
        r["peak_bytes"], r["peak_kind"] = res["sampled_peak"], res["sampled_kind"]
    elif args.device == "cuda":
        r["peak_bytes"], r["peak_kind"] = peak.get("cuda_alloc_bytes"), "alloc"
    else:
        r["peak_bytes"], r["peak_kind"] = peak.get("rss_bytes"), "rss"
    r["status"] = "ok"
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
        peak_file.unlink(missing_ok=True)
    return r


def worker_spec(r: dict, args) -> dict:
    """What the worker process of a Hugging Face, torchtitan or head-loss row measures."""
    if r["impl"] == "head":
        spec = dict(kind="head", modes=r["head_modes"], device=args.device,
                    dtype="bf16" if args.device == "cuda" else "fp32", profile=bool(args.profile),
                    **r["head_shape"])
    else:
        shape = model_shape(r["model"], r["seq_len"])
        spec = dict(kind=r["impl"], hf_config=hf_config_dict(shape, r["seq_len"]), shape=shape,
                    seq_len=r["seq_len"], micro_batch_size=r["micro_batch_size"], microbatches=r["microbatches"],
                    steps=args.warmup + args.steps, optimizer=r["optimizer"], compile=r["compile"],
                    device=args.device, dtype="bf16" if args.device == "cuda" else "fp32", seed=0,
                    threads=args.threads, profile=PROFILED_STEPS if args.profile else 0)  # the head-loss worker keeps torch's default threads: it is all matmul
    return spec


def run_worker_row(r: dict, args, proc: RowProcess | None = None) -> dict:
    """A Hugging Face, torchtitan or head-loss row in its own process (``proc``: started ahead)."""
    proc = proc or RowProcess(worker_command(worker_spec(r, args)))
    r["command"] = f"{PROG} --worker '<{r['impl']} spec>'"
    res = proc.finish(args.row_timeout)
    r["wall_s"] = round(res["seconds"], 1)
    r["notes"] = [*r.get("notes", []), *res.get("notes", []), *package_warnings(res["stderr"])]
    found = [ln[len(RESULT_TAG):] for ln in res["stdout"].splitlines() if ln.startswith(RESULT_TAG)]
    if not found:
        r["status"], r["error"] = failure_text(res, args.row_timeout)
        return r
    out = json.loads(found[-1])
    clock, clock_end = out.pop("clock_start", None), out.pop("clock_end", None)
    r["times"] = wall_times(res, clock, clock_end)
    r["timeline"] = timeline(r["times"], out.get("elapsed_s") or [])
    r.update(out)
    if out.get("status") != "ok":
        r.setdefault("error", "failed")
    return r


def head_row(r: dict, worker: dict) -> dict:
    """The head-loss row of one mode from the worker that measured every mode."""
    r.update(wall_s=worker.get("wall_s"), command=worker.get("command"), timeline=worker.get("timeline"),
             times=worker.get("times"))
    r["notes"] = [*r.get("notes", []), *worker.get("notes", [])]  # one process measured every mode: its warnings are each row's
    if worker.get("status") != "ok":
        r["status"], r["error"] = worker.get("status", "error"), worker.get("error")
        return r
    r.update(worker["modes"].get(r["head_mode"], dict(status="error", error="not measured")))
    return r
