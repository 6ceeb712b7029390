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

Rows (names as printed; " eager" marks --no-compile rows when asyncpp-train has --compile):
  ours sync <opt>        python -m asyncpp_ext.train --stages 1 --schedule sync (one process),
                         --ef-beta 0 (no delay to correct; the baselines have no EF), <opt> =
                         adamw (the project's fused AdamW) or muon (the project's Muon, bf16
                         Newton-Schulz on CUDA, AdamW for embeddings/head/norms)
  ours 2bw 2st 1gpu <opt>
                         --stages 2 --schedule 2bw --transport gloo: both ranks share one GPU
                         (EF at its default 0.5, the configuration 2bw ships with)
  ours 2bw 2st 2gpu <opt>
                         --stages 2 --schedule 2bw (NCCL), one GPU per stage; only with >= 2 GPUs
  hf eager|compile <opt> transformers.LlamaForCausalLM built from a config dict (no download),
                         attn_implementation="sdpa", use_cache=False, bf16 autocast, the loss
                         computed as cross_entropy(logits.float(), targets) on the T next-token
                         targets of each T+1-token window (the same computation as HF's
                         ForCausalLMLoss, but every row predicts exactly T tokens per sequence);
                         "compile" = torch.compile (default mode) of forward + loss;
                         <opt> = torch.optim.AdamW(fused=True), or torch.optim.Muon (torch >= 2.9)
                         for the 2-D matrices of the blocks + fused AdamW for the rest.
                         Gradient accumulation over the same microbatches.
  torchtitan             a row only when `import torchtitan` works (its Llama model in this
                         bench's loop); otherwise listed as not installed. Nothing is installed.
  head-loss plain|fused  asyncpp_ext.models.head_loss.measure_head_loss at smollm-135m's head
                         (C=576, V=49152), micro-batch 8 x 1024: time, peak memory, loss; listed
                         as not available while that function does not exist.
When asyncpp-train lists --compile/--no-compile and --head-loss (detected once from --help), ours
rows pass --compile (--no-compile for the eager rows) and --head-loss auto; otherwise they run
without and their notes say "flags absent".

Correctness column ("check"): every loss finite; the first step's loss within 10 % of ln V (the
loss of a uniform prediction, what a freshly initialised model gives); and the mean loss of the
last third of the steps below the first step's. Ours and Hugging Face are NOT expected to agree
step by step: they start from different random weights. head-loss rows: the fused loss within
1e-4 (fp32) or 2e-2 (bf16) relative of the plain one.

    python bench/gpu_throughput.py [--quick] [--json PATH]          # one GPU, ~10 min (--quick < 3)
    python bench/gpu_throughput.py --device cpu [--quick|--smoke]   # the same rows at CPU sizes
    python bench/gpu_throughput.py --only "135m,head" --micro-batch-size 16 --microbatches 4
    python bench/gpu_throughput.py --dry-run                        # the rows and commands only

On CPU the models are llama-tiny (2 layers, width 32) and llama-tiny-4x64 (4 layers, width 64) at
sequence 64 and 128, float32, and rows needing torch.compile are skipped unless --cpu-compile
(compiling even llama-tiny took ~60 s on 2 CPU cores), except ours' compiled llama-tiny row when
asyncpp-train has --compile. Each row runs in its own process with its own timeout; an out-of-memory
error or any other failure ends that row only. Bad inputs: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROG = "gpu_throughput.py"
# Dense bf16 tensor-core peaks (TFLOP/s) from NVIDIA's datasheets (the "with sparsity" figure / 2).
# First match wins: more specific names first ("GH200" contains "H200").
PEAK_TFLOPS = [("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0),
               ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0)]
# The published SmolLM shapes as Hugging Face config fields, checked against asyncpp's presets
# (asyncpp_ext/models/llama.py) at run time: a difference stops the bench.
SMOLLM_HF = {
    "smollm-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.02),
    "smollm-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                        intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.02),
}
# Bench model name -> (asyncpp preset, CLI shape overrides).
MODELS = {"smollm-135m": ("smollm-135m", {}), "smollm-360m": ("smollm-360m", {}),
          "llama-tiny": ("llama-tiny", {}), "llama-tiny-4x64": ("llama-tiny", {"n_layer": 4, "n_embd": 64})}
DEFAULTS = {  # per device: models, sequence lengths, micro-batch (at the first length), microbatches
    # --micro-batch-size counts sequences of the first default length (1024 / 64); other lengths take
    # as many sequences as hold the same tokens (4 at 2048), so every row trains the same tokens per step.
    "cuda": dict(models=["smollm-135m", "smollm-360m"], seq_lens=[1024, 2048], micro_batch_size=8, microbatches=8),
    "cpu": dict(models=["llama-tiny", "llama-tiny-4x64"], seq_lens=[64, 128], micro_batch_size=8, microbatches=4),
}
# (warm-up steps, measured steps) per mode and device.
STEPS = {("full", "cuda"): (4, 10), ("quick", "cuda"): (3, 5), ("smoke", "cuda"): (1, 3),
         ("full", "cpu"): (2, 8), ("quick", "cpu"): (2, 4), ("smoke", "cpu"): (1, 3)}
ROW_TIMEOUT = {"full": 600, "quick": 240, "smoke": 120}
HEAD_SHAPE = dict(batch=8, seq=1024, n_embd=576, vocab=49152)  # smollm-135m's head at micro-batch 8 x 1024
SMOKE_HEAD_SHAPE = dict(batch=2, seq=64, n_embd=64, vocab=512)
FIRST_LOSS_BAND = 0.10  # first-step loss within 10 % of ln V
DECREASE_MIN_STEPS = 4  # the decrease is asked for from this many steps on
HEAD_LOSS_REL_TOL = {"fp32": 1e-4, "bf16": 2e-2}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
RESULT_TAG = "GPU_THROUGHPUT_RESULT "
# Runs `python -m asyncpp_ext.train ARGS` (asyncpp-train) in this process, then records the process's peak memory.
OURS_DRIVER = r"""
import json, resource, runpy, sys
peak_file = sys.argv[1]
sys.argv = ["asyncpp-train"] + sys.argv[2:]
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
sys.exit(rc)
"""


class BenchError(ValueError):
    """A bad input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(message)


# --------------------------------------------------------------------------------------------
# Shapes, FLOPs, peaks


def model_shape(name: str, seq_len: int) -> dict:
    """The asyncpp LlamaConfig of a bench model at ``seq_len``, as the CLI builds it (same preset,
    same overrides), plus the flags that make the CLI build it."""
    from asyncpp_ext.models.registry import model_config

    if name not in MODELS:
        raise BenchError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    preset, overrides = MODELS[name]
    cfg = model_config(preset, seq_len=seq_len, **overrides).arch_config()
    flags = ["--model", preset, "--seq-len", str(seq_len)]
    for field, value in overrides.items():
        flags += [f"--{field.replace('_', '-')}", str(value)]
    return dict(name=name, preset=preset, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, intermediate_size=cfg.intermediate_size,
                tie_embeddings=cfg.tie_embeddings, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                init_std=cfg.init_std, max_positions=cfg.seq_len, cli_flags=flags)


def hf_config_dict(shape: dict, seq_len: int) -> dict:
    """transformers.LlamaConfig fields for ``shape``; for the SmolLM models the dict written above,
    after checking that it is the asyncpp preset's shape field by field."""
    derived = dict(hidden_size=shape["n_embd"], num_hidden_layers=shape["n_layer"],
                   num_attention_heads=shape["n_head"], num_key_value_heads=shape["n_kv_head"],
                   intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
                   tie_word_embeddings=shape["tie_embeddings"], rope_theta=float(shape["rope_theta"]),
                   max_position_embeddings=max(2048 if shape["name"] in SMOLLM_HF else seq_len, seq_len),
                   rms_norm_eps=shape["norm_eps"], initializer_range=shape["init_std"])
    if shape["name"] in SMOLLM_HF:
        written = dict(SMOLLM_HF[shape["name"]])
        written["max_position_embeddings"] = max(written["max_position_embeddings"], seq_len)
        diff = {k: (written[k], derived[k]) for k in written if written[k] != derived[k]}
        if diff:
            raise RuntimeError(f"{shape['name']}: the bench's Hugging Face config differs from asyncpp's preset "
                               f"(field: (bench, preset)): {diff}")
        derived = written
    return dict(derived, hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False)


def matmul_params(shape: dict) -> int:
    """N of the FLOP formula: block weights (Linear + RMSNorm), final norm, and the head's V x C
    (a tied table once; an untied input table is not counted: a lookup is no matmul)."""
    c, d = shape["n_embd"], shape["n_embd"] // shape["n_head"]
    attn = c * shape["n_head"] * d + 2 * c * shape["n_kv_head"] * d + shape["n_head"] * d * c
    block = attn + 3 * c * shape["intermediate_size"] + 2 * c
    return shape["n_layer"] * block + c + shape["vocab_size"] * c


def total_params(shape: dict) -> int:
    """Every parameter once (what the model holds): N plus an untied input embedding table."""
    return matmul_params(shape) + (0 if shape["tie_embeddings"] else shape["vocab_size"] * shape["n_embd"])


def flops_per_token(shape: dict, seq_len: int) -> float:
    """6 N + 12 L H Q T (H Q = the model width C)."""
    return 6.0 * matmul_params(shape) + 12.0 * shape["n_layer"] * shape["n_embd"] * seq_len


def peak_for_gpu(name: str | None):
    """(TFLOP/s, source) of a GPU name from the table, or (None, reason)."""
    if name:
        for key, tflops in PEAK_TFLOPS:
            if key.lower() in name.lower():
                return tflops, f"table: {key} dense bf16"
    return None, "unknown device: pass --peak-tflops"


# --------------------------------------------------------------------------------------------
# The plan


def detect_cli_flags() -> dict:
    """Which of the newer asyncpp-train flags exist (from --help, once)."""
    r = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", "--help"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
    text = r.stdout
    return {"compile": "--no-compile" in text and re.search(r"--compile\b", text) is not None,
            "head_loss": "--head-loss" in text}


def row(name, impl, model, seq, mb, m, **kw) -> dict:
    r = dict(name=name, impl=impl, model=model, seq_len=seq, micro_batch_size=mb, microbatches=m,
             optimizer=kw.pop("optimizer", None), compile=kw.pop("compile", None), stages=kw.pop("stages", 1),
             gpus=kw.pop("gpus", 1), schedule=kw.pop("schedule", None), transport=kw.pop("transport", None),
             notes=kw.pop("notes", []))
    r.update(kw)
    return r


def build_plan(args, flags: dict, gpus: int) -> tuple[list, list]:
    """(rows to run, [(row name, why it is not run)])."""
    dev = args.device
    models, seqs = args.models, args.seq_lens
    ref = DEFAULTS[dev]["seq_lens"][0]  # --micro-batch-size counts sequences of this length
    mb_at = {t: max(1, args.micro_batch_size * ref // t) for t in seqs}  # same tokens per microbatch
    m = args.microbatches
    rows, skipped = [], []
    compile_ok = dev == "cuda" or args.cpu_compile
    ours_notes = [] if flags["compile"] else ["flags absent"]

    def ours(model, seq, opt, compile_=True, **kw):
        c = (compile_ if flags["compile"] else None)
        suffix = " eager" if c is False else ""
        if kw.get("stages", 1) == 1:
            name = f"ours sync {opt}{suffix}"
            kw.setdefault("schedule", "sync")
        else:
            name = f"ours 2bw 2st {kw['gpus']}gpu {opt}{suffix}"
            kw.setdefault("schedule", "2bw")
        anyway = kw.pop("cpu_compile_anyway", False)
        if c is True and not compile_ok and not anyway:
            skipped.append((f"{name} ({model}, T={seq})", "torch.compile on CPU: pass --cpu-compile"))
            return
        rows.append(row(name, "ours", model, seq, mb_at[seq], m, optimizer=opt, compile=c, notes=list(ours_notes), **kw))

    def hf(model, seq, opt, compile_):
        name = f"hf {'compile' if compile_ else 'eager'} {opt}"
        if compile_ and not compile_ok:
            skipped.append((f"{name} ({model}, T={seq})", "torch.compile on CPU: pass --cpu-compile"))
            return
        rows.append(row(name, "hf", model, seq, mb_at[seq], m, optimizer=opt, compile=compile_))

    def two_bw(model, seq, opt):
        ours(model, seq, opt, compile_=main_compile, stages=2, gpus=1, transport="gloo")
        if dev == "cuda":
            if gpus >= 2:
                ours(model, seq, opt, compile_=main_compile, stages=2, gpus=2, transport="nccl")
            else:
                skipped.append((f"ours 2bw 2st 2gpu {opt} ({model}, T={seq})", f"needs 2 GPUs ({gpus} visible)"))

    cpu_eager = dev == "cpu" and not args.cpu_compile  # ours' main rows on CPU run eager unless asked
    main_compile = not cpu_eager
    first, last = (models[0], seqs[0]), (models[-1], seqs[-1])
    if args.mode == "smoke":
        mdl, seq = first
        ours(mdl, seq, "adamw", compile_=main_compile)
        two_bw(mdl, seq, "adamw")
        hf(mdl, seq, "adamw", False)
    elif args.mode == "quick":
        mdl, seq = first
        ours(mdl, seq, "adamw", compile_=main_compile)
        if flags["compile"] and cpu_eager:
            # compiled vs eager llama-tiny: the one compiled row that runs on CPU without --cpu-compile
            ours(mdl, seq, "adamw", compile_=True, cpu_compile_anyway=True)
        hf(mdl, seq, "adamw", compile_ok)  # compiled on the GPU, eager on CPU
        two_bw(mdl, seq, "adamw")
        if last != first:
            ours(last[0], last[1], "adamw", compile_=main_compile)
    else:
        for mdl in models:
            for seq in seqs:
                primary = (mdl, seq) in (first, last)
                ours(mdl, seq, "adamw", compile_=main_compile)
                if primary and flags["compile"]:
                    if cpu_eager:
                        if (mdl, seq) == first:
                            ours(mdl, seq, "adamw", compile_=True, cpu_compile_anyway=True)
                    else:
                        ours(mdl, seq, "adamw", compile_=False)
                hf(mdl, seq, "adamw", True)
                if (mdl, seq) == first or (not compile_ok and primary):  # eager HF and Muon: one point on the
                    hf(mdl, seq, "adamw", False)                          # GPU (torch.compile of the whole HF
                    ours(mdl, seq, "muon", compile_=main_compile)         # model costs ~60 s per shape there)
                    hf(mdl, seq, "muon", True)
                    if not compile_ok:
                        hf(mdl, seq, "muon", False)
                if primary:
                    two_bw(mdl, seq, "adamw")
    mdl, seq = first
    if importlib.util.find_spec("torchtitan") is None:
        skipped.append(("torchtitan", "not installed"))
    else:
        rows.append(row(f"torchtitan {'compile' if compile_ok else 'eager'} adamw", "torchtitan", mdl, seq,
                        mb_at[seq], m, optimizer="adamw", compile=compile_ok))
    head = SMOKE_HEAD_SHAPE if args.mode == "smoke" else HEAD_SHAPE
    if args.mode == "smoke" and not args.smoke_head:
        pass  # the test suite measures the head-loss rows in-process (one process start less)
    elif head_loss_available():
        for mode in ("plain", "fused"):
            rows.append(row(f"head-loss {mode}", "head", "head C={n_embd} V={vocab}".format(**head), head["seq"],
                            head["batch"], 1, head_mode=mode, head_modes=["plain", "fused"], head_shape=head))
    else:
        skipped.append(("head-loss plain/fused", "not available: asyncpp_ext.models.head_loss.measure_head_loss "
                                                 "not found"))
    if args.only:
        keep = [s.strip() for s in args.only.split(",") if s.strip()]
        rows = [r for r in rows if any(k in f"{r['name']} {r['model']} T={r['seq_len']}" for k in keep)]
    return rows, skipped


def head_loss_available() -> bool:
    try:
        from asyncpp_ext.models import head_loss
    except ImportError:
        return False
    return hasattr(head_loss, "measure_head_loss")


# --------------------------------------------------------------------------------------------
# Running rows


def child_env() -> dict:
    return dict(os.environ, **OFFLINE_ENV,
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def ours_command(r: dict, args, flags: dict, out_dir: Path, peak_file: Path) -> list:
    shape = model_shape(r["model"], r["seq_len"])
    cmd = [sys.executable, "-c", OURS_DRIVER, str(peak_file), *shape["cli_flags"],
           "--device", args.device, "--dtype", "bf16" if args.device == "cuda" else "fp32",
           "--stages", str(r["stages"]), "--schedule", r["schedule"],
           "--micro-batch-size", str(r["micro_batch_size"]), "--microbatches", str(r["microbatches"]),
           "--optimizer", r["optimizer"], "--steps", str(args.warmup + args.steps), "--seed", "0",
           "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--timeout", "900",
           "--out", str(out_dir), "--data", "builtin"]
    if r["stages"] == 1:
        cmd += ["--ef-beta", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if r["transport"]:
        cmd += ["--transport", r["transport"]]
    if flags["compile"] and r["compile"] is not None:
        cmd += ["--compile" if r["compile"] else "--no-compile"]
    if flags["head_loss"]:
        cmd += ["--head-loss", "auto"]
    return cmd


def worker_command(spec: dict) -> list:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]


class MemorySampler:
    """Peak memory of a multi-process run, sampled: on CUDA the device memory in use (NVML, or
    nvidia-smi) minus what was in use before; on CPU the summed PSS (else RSS) of the process tree."""

    def __init__(self, device: str, root_pid_fn, interval: float = 0.2):
        self.device, self.root_pid_fn, self.interval = device, root_pid_fn, interval
        self.peak, self.kind, self._stop = None, None, threading.Event()
        self._read = self._gpu_reader() if device == "cuda" else self._tree_pss
        self.base = self._read(None) if device == "cuda" else 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _gpu_reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.kind = "nvml"
            return lambda _: sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)
        except Exception:  # no pynvml: nvidia-smi, slower
            if shutil.which("nvidia-smi") is None:
                return lambda _: None
            self.kind = "nvml"

            def smi(_):
                q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True)
                try:
                    return sum(int(x) for x in q.stdout.split()) * 2 ** 20
                except ValueError:
                    return None
            return smi

    def _tree_pss(self, _):
        root = self.root_pid_fn()
        if root is None:
            return None
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        total, todo = 0, [root]
        self.kind = "pss"
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            total += _pss_bytes(pid)
        return total

    def _loop(self):
        while not self._stop.is_set():
            value = self._read(None)
            if value is not None:
                value -= self.base or 0
                self.peak = value if self.peak is None else max(self.peak, value)
            self._stop.wait(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def _pss_bytes(pid: int) -> int:
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def run_process(cmd: list, timeout: float, sampler_device: str | None = None) -> dict:
    """Run ``cmd`` (its own process group, killed whole on timeout); stdout, stderr, rc, seconds and,
    with ``sampler_device``, the sampled peak memory."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    sampler = MemorySampler(sampler_device, lambda: proc.pid) if sampler_device else None
    timed_out = False
    try:
        if sampler:
            sampler.__enter__()
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            stdout, stderr = proc.communicate()
    finally:
        if sampler:
            sampler.__exit__(None, None, None)
    return dict(rc=None if timed_out else proc.returncode, stdout=stdout or "", stderr=stderr or "",
                seconds=time.monotonic() - start, sampled_peak=sampler.peak if sampler else None,
                sampled_kind=sampler.kind if sampler else None)


def _kill_group(proc):
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


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


def run_ours(r: dict, args, flags: dict, work: Path) -> dict:
    out_dir = work / re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{r['name']}-{r['model']}-{r['seq_len']}")
    shutil.rmtree(out_dir, ignore_errors=True)
    peak_file = out_dir.with_suffix(".peak.json")
    cmd = ours_command(r, args, flags, out_dir, peak_file)
    r["command"] = " ".join(c if c != OURS_DRIVER else "<driver: python -m asyncpp_ext.train>" for c in cmd[1:])
    multi = r["stages"] > 1
    res = run_process(cmd, args.row_timeout, sampler_device=args.device if multi else None)
    r["wall_s"] = round(res["seconds"], 1)
    if res["rc"] != 0:
        r["status"], r["error"] = failure_text(res, args.row_timeout)
        return r
    metrics = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    r["losses"] = [m.get("loss") for m in metrics]
    r["elapsed_s"] = [m["elapsed_s"] for m in metrics]
    r["tokens"] = [m["tokens"] for m in metrics]
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


def run_worker_row(r: dict, args) -> dict:
    """A Hugging Face, torchtitan or head-loss row in its own process."""
    if r["impl"] == "head":
        spec = dict(kind="head", modes=r["head_modes"], device=args.device,
                    dtype="bf16" if args.device == "cuda" else "fp32", **r["head_shape"])
    else:
        shape = model_shape(r["model"], r["seq_len"])
        spec = dict(kind=r["impl"], hf_config=hf_config_dict(shape, r["seq_len"]), shape=shape,
                    seq_len=r["seq_len"], micro_batch_size=r["micro_batch_size"], microbatches=r["microbatches"],
                    steps=args.warmup + args.steps, optimizer=r["optimizer"], compile=r["compile"],
                    device=args.device, dtype="bf16" if args.device == "cuda" else "fp32", seed=0,
                    threads=args.threads)  # the head-loss worker keeps torch's default threads: it is all matmul
    cmd = worker_command(spec)
    r["command"] = f"{PROG} --worker '<{spec['kind']} spec>'"
    res = run_process(cmd, args.row_timeout)
    r["wall_s"] = round(res["seconds"], 1)
    found = [ln[len(RESULT_TAG):] for ln in res["stdout"].splitlines() if ln.startswith(RESULT_TAG)]
    if not found:
        r["status"], r["error"] = failure_text(res, args.row_timeout)
        return r
    out = json.loads(found[-1])
    r.update(out)
    if out.get("status") != "ok":
        r.setdefault("error", "failed")
    return r


def head_row(r: dict, worker: dict) -> dict:
    """The head-loss row of one mode from the worker that measured every mode."""
    r["wall_s"], r["command"] = worker.get("wall_s"), worker.get("command")
    if worker.get("status") != "ok":
        r["status"], r["error"] = worker.get("status", "error"), worker.get("error")
        return r
    r.update(worker["modes"].get(r["head_mode"], dict(status="error", error="not measured")))
    return r


# --------------------------------------------------------------------------------------------
# Workers (run in a child process: `gpu_throughput.py --worker SPEC`)


def _result(payload: dict) -> None:
    print(RESULT_TAG + json.dumps(payload), flush=True)


def _is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def worker_main(spec: dict) -> int:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    try:
        payload = worker_head(spec) if spec["kind"] == "head" else worker_train(spec)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's status
        if isinstance(exc, KeyboardInterrupt):
            raise
        status = "oom" if _is_oom(exc) else "error"
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        payload = dict(status=status, error=msg)
    _result(payload)
    return 0


def _peak(device) -> tuple:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "alloc"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def build_hf_model(spec: dict):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**spec["hf_config"])
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if spec["shape"]["tie_embeddings"] and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("LlamaForCausalLM did not tie the head to the embedding")
    info = dict(transformers=transformers.__version__, attn_implementation=model.config._attn_implementation)

    def forward(x):
        return model(input_ids=x, use_cache=False).logits
    return model, forward, info


def build_torchtitan_model(spec: dict):
    """torchtitan's Llama (its own model code) at the bench's shape; best effort across releases."""
    import torchtitan

    s = spec["shape"]
    candidates = [("torchtitan.models.llama3", "TransformerModelArgs", "Transformer"),
                  ("torchtitan.models.llama3.model.args", "TransformerModelArgs", None),
                  ("torchtitan.models.llama", "ModelArgs", "Transformer")]
    args_cls = model_cls = None
    for mod_name, args_name, cls_name in candidates:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        args_cls = getattr(mod, args_name, None) or args_cls
        model_cls = getattr(mod, cls_name, None) if cls_name else model_cls
        if model_cls is None and args_cls is not None:
            try:
                model_cls = importlib.import_module("torchtitan.models.llama3.model.model").Transformer
            except (ImportError, AttributeError):
                pass
        if args_cls is not None and model_cls is not None:
            break
    if args_cls is None or model_cls is None:
        raise RuntimeError("torchtitan is installed but its Llama model classes were not found")
    # torchtitan's SwiGLU width: 2/3 * 4C rounded up to multiple_of (1536 for C=576, 2560 for C=960).
    margs = args_cls(dim=s["n_embd"], n_layers=s["n_layer"], n_heads=s["n_head"], n_kv_heads=s["n_kv_head"],
                     vocab_size=s["vocab_size"], multiple_of=256, norm_eps=s["norm_eps"], rope_theta=s["rope_theta"],
                     max_seq_len=spec["seq_len"])
    model = model_cls(margs)
    if hasattr(model, "init_weights"):
        model.init_weights()
    ffn = [m for n, m in model.named_modules() if n.endswith("feed_forward")]
    width = ffn[0].w1.out_features if ffn and hasattr(ffn[0], "w1") else None
    info = dict(torchtitan=getattr(torchtitan, "__version__", "?"), ffn_width=width,
                note="untied output layer" if hasattr(model, "output") else "")

    def forward(x):
        return model(x)
    return model, forward, info


def make_optimizer(model, name: str, device):
    import torch

    fused = dict(fused=True)
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, **fused)]
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError(f"torch.optim.Muon needs torch >= 2.9 (this is {torch.__version__})")
    embed_like = ("embed", "lm_head", "tok_embeddings", "output")
    matrices, rest = [], []
    for n, p in model.named_parameters():
        (matrices if p.ndim == 2 and not any(k in n for k in embed_like) else rest).append(p)
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0, momentum=0.95),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0, **fused)]


def worker_train(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from asyncpp_ext.data.batches import BatchStream, split_tokens
    from asyncpp_ext.data.sources import builtin_corpus
    from asyncpp_ext.training.config import RunConfig

    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    if spec["kind"] == "hf":
        model, forward, info = build_hf_model(spec)
    else:
        model, forward, info = build_torchtitan_model(spec)
    model.to(device).train()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    opts = make_optimizer(model, spec["optimizer"], device)
    vocab = spec["shape"]["vocab_size"]
    amp = torch.bfloat16 if spec["dtype"] == "bf16" else None

    def fwd_loss(x, y):
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = forward(x)
        return F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))

    step_fn = torch.compile(fwd_loss) if spec["compile"] else fwd_loss
    # The same training windows as asyncpp-train --data builtin --seed 0 (its train split).
    b, m, t = spec["micro_batch_size"], spec["microbatches"], spec["seq_len"]
    train, _ = split_tokens(builtin_corpus(), RunConfig().data.eval_fraction, b, t, source="builtin")
    stream = BatchStream(train, m, b, t, seed=spec["seed"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    losses, elapsed, tokens = [], [], []
    start = time.perf_counter()
    for step in range(spec["steps"]):
        total = torch.zeros((), device=device)
        for x, y in stream.next():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = step_fn(x, y)
            (loss / m).backward()
            total += loss.detach()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        losses.append(total.item() / m)  # the host waits for the step here
        elapsed.append(round(time.perf_counter() - start, 4))
        tokens.append((step + 1) * b * m * t)
    peak, kind = _peak(device)
    return dict(status="ok", losses=[v if math.isfinite(v) else None for v in losses], elapsed_s=elapsed,
                tokens=tokens, peak_bytes=peak, peak_kind=kind, params=params, info=info,
                torch=torch.__version__)


def worker_head(spec: dict) -> dict:
    import torch

    from asyncpp_ext.models.head_loss import measure_head_loss

    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    modes = {}
    for mode in spec["modes"]:  # measure_head_loss measures each call's own peak
        try:
            out = measure_head_loss(mode, spec["batch"], spec["seq"], spec["n_embd"], spec["vocab"], device, dtype)
            modes[mode] = dict(status="ok", head_seconds=float(out["seconds"]), peak_bytes=int(out["peak_bytes"]),
                               head_loss=float(out["loss"]), peak_kind="measure_head_loss", dtype=spec["dtype"])
        except Exception as exc:  # noqa: BLE001 - the mode's row fails, the other still runs
            modes[mode] = dict(status="oom" if _is_oom(exc) else "error",
                               error=" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return dict(status="ok", modes=modes)


# --------------------------------------------------------------------------------------------
# Figures, checks, table


def steady_tokens_per_s(tokens: list, elapsed: list, warmup: int):
    """(tokens_K - tokens_W) / (t_K - t_W): the steps after ``warmup``; None if too few."""
    if len(tokens) <= warmup or warmup < 1 or len(tokens) < 2:
        return None
    dt = elapsed[-1] - elapsed[warmup - 1]
    return (tokens[-1] - tokens[warmup - 1]) / dt if dt > 0 else None


def loss_check(losses: list, vocab: int) -> str:
    if not losses or any(v is None or not math.isfinite(v) for v in losses):
        return "FAIL: non-finite loss"
    ln_v = math.log(vocab)
    if abs(losses[0] - ln_v) > FIRST_LOSS_BAND * ln_v:
        return f"FAIL: first loss {losses[0]:.3f}, ln V = {ln_v:.3f}"
    if len(losses) < DECREASE_MIN_STEPS:
        return "ok"  # too few steps to ask for a decrease (2bw's first update lands a step late)
    tail = losses[-max(1, len(losses) // 3):]
    if not sum(tail) / len(tail) < losses[0]:
        return "FAIL: loss not decreasing"
    return "ok"


def finish_row(r: dict, args, peak_tflops) -> dict:
    if r.get("status") != "ok":
        r["check"] = r.get("status", "error")
        return r
    if r["impl"] == "head":
        r["tokens_per_s"] = r["head_shape"]["batch"] * r["head_shape"]["seq"] / r["head_seconds"]
        return r
    shape = model_shape(r["model"], r["seq_len"])
    r["tokens_per_step"] = r["micro_batch_size"] * r["microbatches"] * r["seq_len"]
    r["flops_per_token"] = flops_per_token(shape, r["seq_len"])
    r["params_matmul"] = matmul_params(shape)
    r["tokens_per_s"] = steady_tokens_per_s(r["tokens"], r["elapsed_s"], args.warmup)
    r["tflops"] = r["tokens_per_s"] * r["flops_per_token"] / 1e12 if r["tokens_per_s"] else None
    gpus = r["gpus"] if args.device == "cuda" else 1
    r["mfu"] = r["tflops"] / (peak_tflops * gpus) if (r["tflops"] and peak_tflops) else None
    r["check"] = loss_check(r["losses"], shape["vocab_size"])
    if r["impl"] == "hf" and r.get("params") not in (None, total_params(shape)):
        r["check"] = f"FAIL: {r['params']} parameters, asyncpp's shape has {total_params(shape)}"
    return r


def head_checks(rows: list) -> None:
    plain = next((r for r in rows if r["impl"] == "head" and r["head_mode"] == "plain" and r.get("status") == "ok"), None)
    fused = next((r for r in rows if r["impl"] == "head" and r["head_mode"] == "fused" and r.get("status") == "ok"), None)
    if plain:
        plain["check"] = "ok" if math.isfinite(plain["head_loss"]) else "FAIL: non-finite loss"
    if fused and plain:
        tol = HEAD_LOSS_REL_TOL[fused["dtype"]]
        rel = abs(fused["head_loss"] - plain["head_loss"]) / max(abs(plain["head_loss"]), 1e-12)
        fused["loss_rel_diff"] = rel
        fused["peak_ratio_to_plain"] = fused["peak_bytes"] / plain["peak_bytes"] if plain["peak_bytes"] else None
        fused["time_ratio_to_plain"] = fused["head_seconds"] / plain["head_seconds"]
        fused["check"] = "ok" if rel <= tol else f"FAIL: loss differs by {rel:.2e} (> {tol:g})"
    elif fused:
        fused["check"] = "ok" if math.isfinite(fused["head_loss"]) else "FAIL: non-finite loss"


def ratios(rows: list) -> list:
    """ours / Hugging Face compiled (and eager) per (model, seq, optimizer); 2bw / ours sync."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s")]
    out = []

    def find(name, model, seq):
        return next((r for r in ok if r["name"] == name and r["model"] == model and r["seq_len"] == seq), None)

    for r in ok:
        if r["impl"] != "ours" or r["stages"] != 1:
            continue
        for base_name in (f"hf compile {r['optimizer']}", f"hf eager {r['optimizer']}"):
            base = find(base_name, r["model"], r["seq_len"])
            if base:
                out.append(dict(what=f"{r['name']} / {base_name}", model=r["model"], seq_len=r["seq_len"],
                                tokens_per_s=r["tokens_per_s"] / base["tokens_per_s"],
                                peak_memory=(r["peak_bytes"] / base["peak_bytes"]
                                             if r.get("peak_bytes") and base.get("peak_bytes") else None)))
        eager = None if r["compile"] is False else find(f"{r['name']} eager", r["model"], r["seq_len"])
        if eager:
            out.append(dict(what=f"{r['name']} (compile) / {eager['name']}", model=r["model"], seq_len=r["seq_len"],
                            tokens_per_s=r["tokens_per_s"] / eager["tokens_per_s"], peak_memory=None))
    for r in ok:
        if r["impl"] == "ours" and r["stages"] == 2:  # against the one-stage row compiled alike
            base = next((b for b in ok if b["impl"] == "ours" and b["stages"] == 1 and b["model"] == r["model"]
                         and b["seq_len"] == r["seq_len"] and b["optimizer"] == r["optimizer"]
                         and b["compile"] == r["compile"]), None)
            if base:
                out.append(dict(what=f"{r['name']} / {base['name']}", model=r["model"], seq_len=r["seq_len"],
                                tokens_per_s=r["tokens_per_s"] / base["tokens_per_s"], peak_memory=None,
                                note="per GPU" if r["gpus"] == 2 else None))
                if r["gpus"] == 2:
                    out[-1]["tokens_per_s"] /= 2
    return out


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def _f(v, fmt) -> str:
    return "n/a" if v is None else format(v, fmt)


def format_report(report: dict) -> str:
    info = report["info"]
    lines = [f"# asyncpp bench/gpu_throughput.py: {info['device_name']} ({info['device']}), torch {info['torch']}, "
             f"transformers {info['transformers'] or 'not installed'}, mode {info['mode']}",
             f"# peak {_f(info['peak_tflops'], 'g')} TFLOP/s ({info['peak_source']}); dtype {info['dtype']}; "
             f"{info['warmup']} warm-up + {info['steps']} measured steps per row; asyncpp-train flags: "
             + ", ".join(f"--{k.replace('_', '-')} {'yes' if v else 'absent'}" for k, v in info["cli_flags"].items()),
             f"# FLOPs/token = {report['formula']}",
             "# tokens/s = (tokens_K - tokens_W) / (t_K - t_W) after W warm-up steps; MFU = TFLOP/s / (GPUs x peak)",
             "# peak mem GiB: A = torch.cuda.max_memory_allocated (one process), R = peak RSS (one process, CPU), "
             "N = NVML device memory in use, sampled, all ranks (incl. CUDA contexts and caches), "
             "P = summed PSS of the process tree, sampled; H = measure_head_loss's own figure",
             "# check: losses finite, first within 10% of ln V, last third's mean below the first "
             "(ours and HF start from different weights: no step-by-step agreement expected)",
             f"# {'row':<30}{'model':<19}{'seq':>5}{'mb x n':>9}{'tok/step':>9}{'tokens/s':>11}{'TFLOP/s':>9}"
             f"{'MFU':>7}{'peak mem':>10}  {'loss 1 -> K':<16}{'check':<8}notes"]
    kinds = {"alloc": "A", "rss": "R", "nvml": "N", "pss": "P", "measure_head_loss": "H"}
    for r in report["rows"]:
        mem = f"{_gib(r.get('peak_bytes'))} {kinds.get(r.get('peak_kind'), '?')}" if r.get("peak_bytes") else "n/a"
        notes = list(r.get("notes", []))
        if r.get("status") != "ok":
            lines.append(f"  {r['name']:<30}{r['model']:<19}{r['seq_len']:>5}"
                         f"{r['micro_batch_size']:>4} x {r['microbatches']:<3}{'':>9}{'':>11}{'':>9}{'':>7}{'':>10}  "
                         f"{'':<16}{r.get('status', 'error'):<8}{r.get('error', '')}")
            continue
        if r["impl"] == "head":
            notes = [f"{r['head_seconds'] * 1e3:.1f} ms", f"loss {r['head_loss']:.4f}", r["dtype"]]
            if "peak_ratio_to_plain" in r:
                notes.append(f"peak {_f(r['peak_ratio_to_plain'], '.3f')}x plain, time "
                             f"{r['time_ratio_to_plain']:.2f}x plain")
            lines.append(f"  {r['name']:<30}{r['model']:<19}{r['seq_len']:>5}{r['micro_batch_size']:>4} x 1  "
                         f"{r['micro_batch_size'] * r['seq_len']:>9}{_f(r['tokens_per_s'], '.0f'):>11}{'':>9}{'':>7}"
                         f"{mem:>10}  {'':<16}{r.get('check', ''):<8}{', '.join(notes)}")
            continue
        if r["impl"] == "ours" and r["stages"] == 2:
            notes.append(f"{r['transport']}, EF 0.5")
        if r.get("info", {}).get("note"):
            notes.append(r["info"]["note"])
        loss = f"{r['losses'][0]:.2f} -> {r['losses'][-1]:.2f}" if r["losses"][0] is not None and \
            r["losses"][-1] is not None else "n/a"
        mfu = _f(r["mfu"] * 100 if r["mfu"] is not None else None, ".1f") + ("%" if r["mfu"] is not None else "")
        check = r["check"] if r["check"] == "ok" else "FAIL"
        if r["check"] != "ok":
            notes.append(r["check"])
        lines.append(f"  {r['name']:<30}{r['model']:<19}{r['seq_len']:>5}{r['micro_batch_size']:>4} x "
                     f"{r['microbatches']:<3}{r['tokens_per_step']:>9}{_f(r['tokens_per_s'], '.0f'):>11}"
                     f"{_f(r['tflops'], '.1f'):>9}{mfu:>7}{mem:>10}  {loss:<16}{check:<8}{', '.join(notes)}")
    for name, why in report["skipped"]:
        lines.append(f"  {name:<45}not run: {why}")
    if report["ratios"]:
        lines.append("# ratios (same model, sequence, optimizer, tokens per step; measured in this run)")
        for q in report["ratios"]:
            mem = f", peak memory {q['peak_memory']:.2f}x" if q.get("peak_memory") else ""
            lines.append(f"  {q['model']:<16} T={q['seq_len']:<5} {q['what']:<56} tokens/s {q['tokens_per_s']:.2f}x"
                         f"{' per GPU' if q.get('note') else ''}{mem}")
    s = report["summary"]
    lines.append(f"# {s['rows_ok']} of {s['rows']} rows ran, {s['checks_failed']} check(s) failed; "
                 f"{report['seconds']:.0f} s in all")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default): SmolLM shapes; cpu: the same rows at CPU sizes")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer rows and steps (< 3 min on one H100)")
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
    ap.add_argument("--cpu-compile", action="store_true", help="on CPU also run the torch.compile rows (slow)")
    ap.add_argument("--row-timeout", type=float, help="seconds per row (default 600, --quick 240, --smoke 120)")
    ap.add_argument("--threads", type=int, metavar="N",
                    help="intra-op threads of every training process (asyncpp-train --threads N, "
                         "torch.set_num_threads(N) in the others); 0 = each process's default (default: 0 on "
                         "cuda; 1 on cpu, where the models are tiny and spinning OpenMP threads on a loaded "
                         "machine made runs 20-70x slower)")
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
    import torch

    start = time.monotonic()
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
    rows, skipped = build_plan(args, flags, gpus)
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    if tf_version is None:
        skipped += [(f"{r['name']} ({r['model']}, T={r['seq_len']})", "transformers not installed")
                    for r in rows if r["impl"] == "hf"]
        rows = [r for r in rows if r["impl"] != "hf"]
    info = dict(device=args.device, device_name=device_name, gpus=gpus, torch=torch.__version__,
                transformers=tf_version, mode=args.mode, warmup=args.warmup, steps=args.steps,
                peak_tflops=peak, peak_source=source, cli_flags=flags, python=sys.version.split()[0],
                dtype="bf16 autocast, fp32 weights" if args.device == "cuda" else "fp32",
                micro_batch_size=args.micro_batch_size, microbatches=args.microbatches,
                models=args.models, seq_lens=args.seq_lens)
    formula = ("6*N + 12*L*H*Q*T (PaLM; N = matmul parameters: block weights + the head's V x C, a tied table "
               "counted once; attention without causal halving)")
    if args.dry_run:
        print(f"# {len(rows)} rows on {device_name}; flags {flags}")
        for r in rows:
            print(f"  {r['name']:<30}{r['model']:<19}T={r['seq_len']:<6}{r['micro_batch_size']} x {r['microbatches']}")
        for name, why in skipped:
            print(f"  {name:<45}not run: {why}")
        return dict(info=info, rows=rows, skipped=skipped, dry_run=True)
    work_ctx = tempfile.TemporaryDirectory(prefix="gpu_throughput-", dir=_scratch_dir()) if not args.workdir else None
    work = Path(args.workdir or work_ctx.name)
    work.mkdir(parents=True, exist_ok=True)
    done, head_results = [], None
    try:
        for i, r in enumerate(rows):
            print(f"[{i + 1}/{len(rows)}] {r['name']} {r['model']} T={r['seq_len']} ...", file=sys.stderr, flush=True)
            if r["impl"] == "head":
                if head_results is None:  # one process measures every mode
                    head_results = run_worker_row(dict(r), args)
                r = head_row(r, head_results)
            else:
                r = run_ours(r, args, flags, work) if r["impl"] == "ours" else run_worker_row(r, args)
            done.append(finish_row(r, args, peak))
            if r.get("status") != "ok":
                print(f"    {r['status']}: {r.get('error')}", file=sys.stderr, flush=True)
            if args.json:  # rows so far, in case the run is cut short; the full report replaces it
                Path(args.json).write_text(json.dumps(dict(info=info, formula=formula, rows=done, skipped=skipped,
                                                           partial=True), indent=1, default=str))
    finally:
        if work_ctx is not None:
            work_ctx.cleanup()
    head_checks(done)
    checks_failed = [r["name"] for r in done if r.get("check") not in (None, "ok")]
    summary = dict(rows=len(done), rows_ok=sum(r.get("status") == "ok" for r in done),
                   checks_failed=len(checks_failed), failed=checks_failed,
                   ratios={f"{q['model']} T={q['seq_len']} {q['what']}": round(q["tokens_per_s"], 3)
                           for q in ratios(done)},
                   tokens_per_s={f"{r['name']} {r['model']} T={r['seq_len']}": round(r["tokens_per_s"])
                                 for r in done if r.get("tokens_per_s")},
                   mfu={f"{r['name']} {r['model']} T={r['seq_len']}": round(r["mfu"], 4)
                        for r in done if r.get("mfu") is not None})
    return dict(info=info, formula=formula, rows=done, skipped=skipped, ratios=ratios(done), summary=summary,
                seconds=time.monotonic() - start)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.worker:
            return worker_main(json.loads(args.worker))
        report = run(args)
    except BenchError as exc:
        sys.stderr.write(f"{PROG}: error: {' '.join(str(exc).split())}\n")
        return 2
    if report.get("dry_run"):
        return 0
    print(format_report(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
