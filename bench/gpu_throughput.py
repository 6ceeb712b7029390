"""Training throughput on a GPU: asyncpp-train against Hugging Face transformers (eager and torch.compile).

For smollm-135m and smollm-360m at sequence 1024 and 2048 (bf16 autocast, float32 weights and
optimizer state), every row trains the same number of tokens per optimizer step (default 64
sequences of 1024 = 65,536 tokens: 8 microbatches of 8 sequences at 1024, of 4 at 2048) on the same
data (the built-in corpus, byte ids < 256, the same windows in the same order) and reports:

* tokens/s, steady state: (tokens_K - tokens_W) / (t_K - t_W) over the steps after W warm-up steps
  (the warm-up holds torch.compile, autotuning and allocator growth), t_k being the wall time at
  which step k's loss was on the host. The same formula for every row.
* model TFLOP/s = tokens/s x FLOPs per token, with the PaLM convention (Chowdhery et al. 2022,
  appendix B; also nanoGPT's and torchtitan's MFU):

      FLOPs per token = 6 * N  +  12 * L * H * Q * T

  N = the parameters that take part in a matrix product: every Linear weight of the blocks, the
  head's V x C matrix (a tied embedding table is counted once, as the head: its lookup is no
  matmul; an untied input table is left out), and the RMSNorm weights (0.04 % of N, kept for
  simplicity). L layers, H query heads of width Q (H * Q = C, the model width), T the sequence
  length; the attention term counts the full T x T score and value products, without halving for
  the causal mask (the common convention; a causal kernel does about half of that work).
  smollm-135m: N = 134,515,008, 1.020 GFLOP/token at T=1024; smollm-360m: N = 361,821,120,
  2.926 GFLOP/token at T=2048.
* MFU = model TFLOP/s / peak, peak = --peak-tflops, else by GPU name (dense bf16, no sparsity:
  H100 SXM 989, H100 NVL 835, H100 PCIe 756, H200 989, H200 NVL 835, GH200 989, A100 312);
  an unknown GPU (or the CPU) gives "n/a" unless --peak-tflops is given. A row on G GPUs divides
  by G x peak.
* peak memory: one-process rows (ours with one stage, every Hugging Face row) report
  torch.cuda.max_memory_allocated of the training process over the whole run ("alloc"); on CPU
  the process's peak resident set from resource.getrusage ("rss"). Multi-process rows (2bw with two
  stages) report the GPU memory in use sampled through NVML every 0.2 s, all ranks together, minus
  what was in use before the run, so it includes each rank's CUDA context and allocator cache
  ("nvml"); on CPU the summed proportional set size of the process tree, sampled ("pss").

Rows (names as printed; " eager" marks --no-compile rows when asyncpp-train has --compile): ours
(`asyncpp-train --stages 1 --schedule sync`, and 2bw with two stages on one or two GPUs) with its
variants (graphs, no-copies, bf16-params, stage-compile, max-autotune, cat-fused, combo-kernels, pdl,
combo-kernels-pdl, mix-order-64, ipc, flash- or cudnn-attention), Hugging Face eager and compiled,
torchtitan where installed, and the head-loss rows; docs/gpu.md's table says what each runs, and
`--dry-run` lists a plan's rows.
When asyncpp-train lists --compile/--no-compile and --head-loss (detected once from --help), ours
rows pass --compile (--no-compile for the eager rows) and --head-loss auto; otherwise they run
without and their notes say "flags absent".

Correctness column ("check"): every loss finite; the first step's loss within 10 % of ln V (the
loss of a uniform prediction, what a freshly initialised model gives); and the mean loss of the
last third of the steps below the first step's. Ours and Hugging Face are NOT expected to agree
step by step: they start from different random weights. head-loss rows: the fused loss within
1e-4 (fp32) or 2e-2 (bf16) relative of the plain one. An ours variant row against the row it
varies (same weights, data and update rule): losses within 5 % relative at every step
(throughput_report.VARIANT_LOSS_TOL; bf16-params: the difference reported only). The report ends
with the targets the run measured (throughput_report.targets), met or not.

    python bench/gpu_throughput.py [--quick] [--json PATH]          # one GPU, ~10 min (--quick < 3)
    python bench/gpu_throughput.py --device cpu [--quick|--smoke]   # the same rows at CPU sizes
    python bench/gpu_throughput.py --only "135m,head" --micro-batch-size 16 --microbatches 4
    python bench/gpu_throughput.py --only "ours sync adamw" --skip "eager,graphs"
    python bench/gpu_throughput.py --dry-run                        # the rows and commands only

On CPU the models are llama-tiny (2 layers, width 32) and llama-tiny-4x64 (4 layers, width 64) at
sequence 64 and 128, float32, and rows needing torch.compile are skipped unless --cpu-compile
(compiling even llama-tiny took ~60 s on 2 CPU cores), except ours' compiled llama-tiny row when
asyncpp-train has --compile. Each row runs in its own process with its own timeout; an out-of-memory
error or any other failure ends that row only. Bad inputs: one line on stderr, exit 2.

This file holds the flags and the run; beside it: throughput_plan.py (which rows run, which are
skipped), throughput_model.py (the models, FLOPs, peaks), throughput_rows.py (one row: ours' run,
a worker row's start, what each leaves), row_process.py (a row's process, started ahead of its turn
with --prestart, and where its wall time went), throughput_workers.py (the rows measured in a
worker process) and throughput_report.py (the figures, checks, ratios and table).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # the model, row and report code next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
# Also reached through this module (tests/test_gpu_throughput_smoke.py): the formulas, the checks, ours' command.
from throughput_model import (MODELS, SMOLLM_HF, BenchError, flops_per_token, hf_config_dict,  # noqa: E402,F401
                              matmul_params, model_shape, peak_for_gpu, total_params)
from throughput_report import (HEAD_LOSS_REL_TOL, finish_row, format_report, head_checks,  # noqa: E402,F401
                               loss_check, ratios, steady_tokens_per_s, targets, variant_checks)
from throughput_rows import (PROG, RESULT_TAG, ROOT, head_row, ours_command, start_row,  # noqa: E402,F401
                             run_ours, run_worker_row)
from bench_command import check_report_path, write_json  # noqa: E402
from row_process import RowProcess, beside_measured  # noqa: E402
from throughput_workers import build_hf_model, head_mode, worker_main  # noqa: E402,F401
from throughput_plan import (DEFAULTS, HEAD_SHAPE, SMOKE_HEAD_SHAPE, build_plan, detect_cli_flags,  # noqa: E402,F401
                             row)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (warm-up steps, measured steps) per mode and device.
STEPS = {("full", "cuda"): (4, 10), ("quick", "cuda"): (3, 5), ("smoke", "cuda"): (1, 3),
         ("full", "cpu"): (2, 8), ("quick", "cpu"): (2, 4), ("smoke", "cpu"): (1, 3)}
ROW_TIMEOUT = {"full": 600, "quick": 240, "smoke": 120}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(message)


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default): SmolLM shapes; cpu: the same rows at CPU sizes")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default configurations at the first point, fewer steps (about 3 min on one GPU)")
    mode.add_argument("--smoke", action="store_true", help="the fewest rows and steps (tests)")
    ap.add_argument("--models", help="comma-separated bench models (default per device): " + ", ".join(MODELS))
    ap.add_argument("--seq-lens", help="comma-separated sequence lengths (default 1024,2048 on cuda, 64,128 on cpu)")
    ap.add_argument("--micro-batch-size", type=int,
                    help="sequences per microbatch at sequence 1024 (cpu: 64); other lengths take as many as "
                         "hold the same tokens, e.g. half at 2048 (default 8)")
    ap.add_argument("--microbatches", type=int, help="microbatches per optimizer step (default 8 cuda, 4 cpu)")
    ap.add_argument("--steps", type=int, help="measured steps per row (after the warm-up)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per row, not measured (>= 1)")
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one device for MFU (default: by GPU name)")
    ap.add_argument("--only", help="comma-separated substrings: run only rows whose 'name model T=seq' holds one")
    ap.add_argument("--skip", help="comma-separated substrings: leave out rows whose 'name model T=seq' holds one "
                                   "(after --only)")
    ap.add_argument("--head-chunk-rows", metavar="N[,N...]",
                    help="also measure the fused head with these rows per chunk (one row each, beside the "
                         "default chunk): how the chunk size trades launches for memory")
    ap.add_argument("--cpu-compile", action="store_true", help="on CPU also run the torch.compile rows (slow)")
    ap.add_argument("--row-timeout", type=float, help="seconds per row (default 600, --quick 240, --smoke 120)")
    ap.add_argument("--threads", type=int, metavar="N",
                    help="intra-op threads of every training process (asyncpp-train --threads N, "
                         "torch.set_num_threads(N) in the others); 0 = each process's default (default: 0 on "
                         "cuda; 1 on cpu, where the models are tiny and spinning OpenMP threads on a loaded "
                         "machine made runs 20-70x slower)")
    ap.add_argument("--profile", action="store_true",
                    help="trace 2 more steps of each training row (ours' through asyncpp-train --profile-steps, "
                         "the Hugging Face and torchtitan rows in their worker) and add the share of the time the "
                         "GPU was busy and the kernels per step to its notes")
    ap.add_argument("--prestart", action=argparse.BooleanOptionalAction, default=None,
                    help="start each row's process while the row before it runs: its imports (and a Hugging "
                         "Face row's model on the CPU) overlap that row, the device waits for its turn "
                         "(default: on for cuda, off for cpu, where two cores would share the measured row's)")
    ap.add_argument("--json", metavar="PATH", help="also write every number to PATH")
    ap.add_argument("--keep", action="store_true", help="keep each row's run directory")
    ap.add_argument("--workdir", help="where run directories go (default: a temporary directory, in "
                                      "/dev/shm when it has 32 GiB free)")
    ap.add_argument("--dry-run", action="store_true", help="print the rows that would run and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--smoke-head", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    d = DEFAULTS[args.device]
    args.models = _list(args.models, str, "--models") if args.models else list(d["models"])
    for mdl in args.models:
        if mdl not in MODELS:
            raise BenchError(f"--models: unknown model {mdl!r}; choose from {', '.join(MODELS)}")
    args.seq_lens = _list(args.seq_lens, int, "--seq-lens") if args.seq_lens else list(d["seq_lens"])
    args.micro_batch_size = d["micro_batch_size"] if args.micro_batch_size is None else args.micro_batch_size
    args.microbatches = d["microbatches"] if args.microbatches is None else args.microbatches
    warm, steps = STEPS[(args.mode, args.device)]
    args.warmup = warm if args.warmup is None else args.warmup
    args.steps = steps if args.steps is None else args.steps
    args.row_timeout = ROW_TIMEOUT[args.mode] if args.row_timeout is None else args.row_timeout
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if args.prestart is None:
        args.prestart = args.device == "cuda"
    for name, value, low in (("--micro-batch-size", args.micro_batch_size, 1), ("--microbatches", args.microbatches, 2),
                             ("--steps", args.steps, 1), ("--warmup", args.warmup, 1),
                             ("--threads", 0 if args.threads is None else args.threads, 0)):
        if value < low:
            raise BenchError(f"{name} must be >= {low}, got {value}"
                             + (" (2bw with 2 stages needs >= 2 microbatches)" if name == "--microbatches" else ""))
    for t in args.seq_lens:
        if t < 2:
            raise BenchError(f"--seq-lens: every length must be >= 2, got {t}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise BenchError(f"--peak-tflops must be a positive number, got {args.peak_tflops}")
    if args.row_timeout <= 0:
        raise BenchError(f"--row-timeout must be positive, got {args.row_timeout}")
    args.head_chunk_rows = _list(args.head_chunk_rows, int, "--head-chunk-rows") if args.head_chunk_rows else []
    if any(n < 1 for n in args.head_chunk_rows):
        raise BenchError(f"--head-chunk-rows: every chunk must hold >= 1 row, got {args.head_chunk_rows}")
    if args.json is not None:
        check_report_path(args.json, "gpu_throughput.json")
    return args


def _scratch_dir():
    """Where the run directories go: /dev/shm when it has room (each of ours' runs ends with a
    checkpoint, 4.3 GB for smollm-360m with AdamW: memory is faster than disk), else the default."""
    try:
        if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > 32 * 2**30:
            return "/dev/shm"
    except OSError:
        pass
    return None


def _list(text: str, kind, flag: str) -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise BenchError(f"{flag} is empty")
    try:
        return [kind(s) for s in items]
    except ValueError:
        raise BenchError(f"{flag} must be a comma-separated list of {kind.__name__}, got {text!r}") from None


def run(args) -> dict:
    start = time.monotonic()  # before torch's import: --quick's wall time counts it
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        raise BenchError("--device cuda but no CUDA GPU is visible; use --device cpu")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    if args.peak_tflops is not None:
        peak, source = args.peak_tflops, "--peak-tflops"
    elif args.device == "cuda":
        peak, source = peak_for_gpu(device_name)
    else:
        peak, source = None, "CPU: pass --peak-tflops for MFU"
    try:  # every row needs the built extension (ours, and the data pipeline the other rows share)
        import asyncpp_ext._ext  # noqa: F401
    except ImportError as exc:
        raise BenchError(str(exc)) from None
    for mdl in args.models:  # shapes and the SmolLM dicts are checked before anything runs
        for t in args.seq_lens:
            hf_config_dict(model_shape(mdl, t), t)
    flags = detect_cli_flags()
    args.auto_attention = None  # what ours' --attention auto picks on this GPU
    if args.device == "cuda" and flags["attention"]:
        from asyncpp_ext.models.attention import resolve_attention
        args.auto_attention = resolve_attention("auto", "cuda")
    rows, skipped = build_plan(args, flags, gpus)
    try:  # the installed version, without importing it (a second of the run's wall time)
        from importlib.metadata import PackageNotFoundError, version
        tf_version = version("transformers")
    except PackageNotFoundError:
        tf_version = None
    if tf_version is None:
        skipped += [(f"{r['name']} ({r['model']}, T={r['seq_len']})", "transformers not installed")
                    for r in rows if r["impl"] == "hf"]
        rows = [r for r in rows if r["impl"] != "hf"]
    from asyncpp_ext.models.head_loss import fused_kernel_name

    info = dict(device=args.device, device_name=device_name, gpus=gpus, torch=torch.__version__,
                transformers=tf_version, mode=args.mode, warmup=args.warmup, steps=args.steps,
                peak_tflops=peak, peak_source=source, cli_flags=flags, python=sys.version.split()[0],
                dtype="bf16 autocast, fp32 weights" if args.device == "cuda" else "fp32",
                micro_batch_size=args.micro_batch_size, microbatches=args.microbatches,
                models=args.models, seq_lens=args.seq_lens,
                # what ours' fused head runs where graphs do not (Liger's where liger-kernel is
                # installed); rows with graphs always run the chunked kernel
                fused_head_kernel=fused_kernel_name(args.device), attention_first=args.auto_attention,
                prestart=args.prestart)
    formula = ("6*N + 12*L*H*Q*T (PaLM; N = matmul parameters: block weights + the head's V x C, a tied table "
               "counted once; attention without causal halving)")
    if args.dry_run:
        print(f"# {len(rows)} rows on {device_name}; flags {flags}")
        width = max([len(r["name"]) for r in rows] + [28]) + 2  # names never run into the next column
        for r in rows:
            print(f"  {r['name']:<{width}}{r['model']:<19}T={r['seq_len']:<6}{r['micro_batch_size']} x {r['microbatches']}")
        for name, why in skipped:
            print(f"  {name:<{width + 19}}not run: {why}")
        return dict(info=info, rows=rows, skipped=skipped, dry_run=True)
    work_ctx = tempfile.TemporaryDirectory(prefix="gpu_throughput-", dir=_scratch_dir()) if not args.workdir else None
    work = Path(args.workdir or work_ctx.name)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--workdir {work} cannot be made ({exc.strerror or exc}); "
                         "choose a writable directory") from None
    done, head_results, ahead = [], None, None
    # Rows that start a process of their own: the head-loss pair shares one (it measures every mode).
    first_head = next((i for i, r in enumerate(rows) if r["impl"] == "head"), None)
    own = [i for i, r in enumerate(rows) if r["impl"] != "head" or i == first_head]
    try:
        for i, r in enumerate(rows):
            print(f"[{i + 1}/{len(rows)}] {r['name']} {r['model']} T={r['seq_len']} ...", file=sys.stderr, flush=True)
            proc = None
            if i in own:
                proc = ahead[1] if ahead is not None and ahead[0] == i else start_row(r, args, flags, work)
                later = [k for k in own if k > i]
                # --prestart: the next row's process imports (and builds on the CPU) while this one runs
                ahead = (later[0], start_row(rows[later[0]], args, flags, work, gated=True)) \
                    if args.prestart and later else None
            if r["impl"] == "head":
                if head_results is None:  # one process measures every mode
                    head_results = run_worker_row(dict(r, notes=[]), args, proc)
                r = head_row(r, head_results)
            else:
                r = run_ours(r, args, flags, work, proc) if r["impl"] == "ours" else run_worker_row(r, args, proc)
            done.append(finish_row(r, args, peak))
            if len(done) > 1 and done[-2].get("times") is not r.get("times"):  # a row's own process
                note = beside_measured(done[-2], r, args.warmup)  # its start-up overlapped them
                if note:
                    done[-2]["notes"] = [*done[-2].get("notes", []), note]
            if r.get("status") != "ok":
                print(f"    {r['status']}: {r.get('error')}", file=sys.stderr, flush=True)
            if args.json:  # rows so far, in case the run is cut short; the full report replaces it
                write_json(args.json, dict(info=info, formula=formula, rows=done, skipped=skipped, partial=True))
    finally:
        RowProcess.drop_live()  # a run stopped midway: what has not had its turn, and what still runs
        if work_ctx is not None:
            work_ctx.cleanup()
    head_checks(done)
    variant_checks(done)
    checks_failed = [r["name"] for r in done if r.get("check") not in (None, "ok")]
    summary = dict(rows=len(done), rows_ok=sum(r.get("status") == "ok" for r in done),
                   checks_failed=len(checks_failed), failed=checks_failed,
                   ratios={f"{q['model']} T={q['seq_len']} {q['what']}": round(q["tokens_per_s"], 3)
                           for q in ratios(done)},
                   tokens_per_s={f"{r['name']} {r['model']} T={r['seq_len']}": round(r["tokens_per_s"])
                                 for r in done if r.get("tokens_per_s")},
                   mfu={f"{r['name']} {r['model']} T={r['seq_len']}": round(r["mfu"], 4)
                        for r in done if r.get("mfu") is not None})
    seconds = time.monotonic() - start
    return dict(info=info, formula=formula, rows=done, skipped=skipped, ratios=ratios(done), summary=summary,
                targets=targets(done, seconds, args.mode), seconds=seconds)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.worker:
            rc = worker_main(json.loads(args.worker))  # its result line is printed and flushed
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)  # without the finalisation of a compiled model (seconds, no part of the row)
        report = run(args)
    except BenchError as exc:
        sys.stderr.write(f"{PROG}: error: {' '.join(str(exc).split())}\n")
        return 2
    if report.get("dry_run"):
        return 0
    print(format_report(report), flush=True)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
