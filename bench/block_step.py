"""One Llama block alone, forward + backward, per way of compiling it: where a stage's time goes
between matrix products, attention and inductor's fused kernels, and what a change to the block's
code or to inductor's options is worth before a whole training run measures it.

    python bench/block_step.py                          # CUDA: smollm-360m / 2048, every variant but max-autotune
    python bench/block_step.py --variants eager,compiled --models smollm-135m
    python bench/block_step.py --device cpu             # a tiny block, eager (the smoke test)
    python bench/block_step.py --json out.json          # --json -: the JSON alone, on stdout

The block runs as a training stage runs it: its linear weights as bf16 compute copies under bf16
autocast (fp32 throughout with --dtype fp32, the CPU's default), the attention kernel that
``--attention auto`` picks held for the whole run, one microbatch of 8192 tokens (8192 / T
sequences; --tokens). Variants (all the same arithmetic; only kernels and their order differ):

  eager                 the block's Python code, no compiler
  compiled              compile_blocks as training does it (inductor, default mode; on CUDA every
                        concatenation lowered as kernels that compute its inputs into their slices,
                        models/compile_support.DEVICE_OPTIONS, on torch 2.11 through
                        models/concat_lowering.py)
  cat-fused             compiled with inductor's own concatenations instead (a concatenation of a
                        few inputs fused into one kernel of masked loads; max_pointwise_cat_inputs=8)
  combo-kernels         compiled with inductor's horizontal fusion (combo_kernels: independent
                        kernels of the graph merged into one launch)
  pdl                   compiled with programmatic dependent launch (triton.enable_pdl: each
                        Triton kernel launched while the one before it finishes; Hopper and newer)
  mix-order-64          compiled with 64 rows per partial sum in the norms' backward
                        (triton.mix_order_reduction_split_size; inductor picks 16 on 132 SMs)
  rotary-btd            compiled, with rotary positions applied to q and k in the projections'
                        (B, T, heads, D) layout before the heads move to the front for attention
  separate-qkv          compiled, with q, k and v as three products instead of one stacked product
  separate-gate-up      compiled, with SwiGLU's gate and up as two products instead of one stacked
                        product (the compiled blocks' form before they stacked them)
  concat-weights        compiled, the stacked products' weights concatenated in every call instead
                        of read from the compute copies' stacked parameter (pipeline/compute_copies.py)
  coordinate-descent    compiled with inductor's coordinate_descent_tuning (each fused kernel's
                        launch configuration searched on the device)
  rotary-halves         compiled, rotary positions from the two halves of each head as slices
                        instead of a roll (the same arithmetic)
  expanded-kv           compiled, the key/value heads repeated for attention in the compiled graph
                        instead of SDPA's enable_gqa (whether the attention kernel then runs
                        without copies of its own around it)
  grad-accum-fusion     compiled, the weight gradients added into float32 by their products
                        (--gradient-accumulation-fusion, pipeline/main_grad.py) instead of bf16
                        gradients that the accumulate kernel adds after the backward (bf16 only)
  max-autotune          compiled in max-autotune mode (GEMM templates and kernel configs searched)

Per variant: the median milliseconds of a forward + backward, the device time by kind from one
profiled window (training/profiling.py's kinds), the costliest kernels, and a correctness column:
the output and the input's gradient against the float32 eager block (largest absolute difference
over the largest absolute reference value, at most --tol). Exit 1 when a row fails its check, 2 on
bad input (one line).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # the package, and the bench's sibling scripts
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from asyncpp_ext.models.attention import attention_preference, resolve_attention  # noqa: E402
from asyncpp_ext.models import concat_lowering  # noqa: E402
from asyncpp_ext.models.compile import compile_blocks  # noqa: E402
from asyncpp_ext.models.llama import (Attention, LlamaBlock, SwiGLU, apply_rotary, llama_init_,  # noqa: E402
                                      llama_preset_config)
from asyncpp_ext.pipeline.compute_copies import maybe_compute_copies  # noqa: E402
from asyncpp_ext.pipeline.recompute import autocast_context  # noqa: E402
from asyncpp_ext.training.profiling import trace_calls  # noqa: E402
from bench_command import ArgumentParser, BenchError, check_report_path, write_json  # noqa: E402
from attention_kernels import timed  # noqa: E402  (the median of --iters calls, after two warm-ups)
from throughput_rows import INDUCTOR_PRESETS, inductor_preset  # noqa: E402  (the bench's preset rows' options)

CUDA_SHAPES = {"smollm-360m": 2048, "smollm-135m": 1024}  # model -> sequence length
CPU_SHAPES = {"llama-tiny": 32}


class RotaryBTDAttention(Attention):
    """Attention with q and k rotated in the projections' (B, T, heads, D) layout."""

    def forward(self, x, cos, sin_signed):
        q, k, v = self.project(x)
        cos, sin_signed = cos[:, None, :], sin_signed[:, None, :]  # (T, 1, D): broadcast over heads
        q = apply_rotary(q.transpose(1, 2), cos, sin_signed).transpose(1, 2)
        k = apply_rotary(k.transpose(1, 2), cos, sin_signed).transpose(1, 2)
        return self.attend(q, k, v)


class SeparateQKVAttention(Attention):
    """Attention with q, k and v as three products when compiled too."""

    stacked_projections = ()  # no stacked copy of their weights either

    def project(self, x):
        b, t, _ = x.shape
        return (self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2),
                self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2),
                self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2))


def rotary_by_halves(x, cos, sin_signed):
    """``apply_rotary`` with the two halves of each head as strided slices instead of a roll: the
    same products and sums per element (bit for bit, since the cos table repeats its frequencies in
    both halves: ``rotary_cos_sin``), other index expressions for inductor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos[..., :half]
    return torch.cat((x1 * c + x2 * sin_signed[..., :half], x2 * c + x1 * sin_signed[..., half:]), dim=-1)


class RotaryHalvesAttention(Attention):
    """The library's attention with ``rotary_by_halves``."""

    def forward(self, x, cos, sin_signed):
        q, k, v = self.project(x)
        return self.attend(rotary_by_halves(q, cos, sin_signed), rotary_by_halves(k, cos, sin_signed), v)


class ExpandedKVAttention(Attention):
    """The library's attention with the key/value heads repeated to the query heads' count in the
    compiled graph (``repeat_interleave``) instead of SDPA's ``enable_gqa``: the repetition can fuse
    into the kernel that rotates k, and its backward's sum over the group into the rotary backward."""

    def attend(self, q, k, v, causal=True, mask=None):  # the library's signature (llama.Attention.attend)
        b, _, t, _ = q.shape
        group = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, **({"is_causal": causal} if mask is None else {"attn_mask": mask}))
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class SeparateGateUpSwiGLU(SwiGLU):
    """SwiGLU with gate and up as two products when compiled too."""

    stacked_projections = ()

    def project(self, x):
        return self.gate_proj(x), self.up_proj(x)


class ConcatWeightsAttention(Attention):
    """Attention whose compute copies carry no stacked weight: compiled, fused_linear concatenates."""

    stacked_projections = ()


class ConcatWeightsSwiGLU(SwiGLU):
    stacked_projections = ()


class ExpandedKVBlock(LlamaBlock):
    pass


class RotaryBTDBlock(LlamaBlock):  # a class of its own: compiled groups are keyed by class
    pass


class SeparateQKVBlock(LlamaBlock):
    pass


class RotaryHalvesBlock(LlamaBlock):
    pass


class SeparateGateUpBlock(LlamaBlock):
    pass


class ConcatWeightsBlock(LlamaBlock):
    pass


# name -> (block class, {submodule: its class} for the forms with code of their own, compile_blocks
# keyword arguments or None = eager)
VARIANTS = {
    "eager": (LlamaBlock, {}, None),
    "compiled": (LlamaBlock, {}, {}),
    # inductor's own concatenations: a cat of few inputs fused into its consumer as masked loads
    # (the backward's q/k/v gradient with the rotary backward: 85 us at smollm-360m where the
    # compiled default's kernels take ~40); second, so that a run cut short keeps it
    "cat-fused": (LlamaBlock, {}, {"options": inductor_preset("cat-fused")}),
    "combo-kernels": (LlamaBlock, {}, {"options": inductor_preset("combo-kernels")}),
    "pdl": (LlamaBlock, {}, {"options": inductor_preset("pdl")}),
    "mix-order-64": (LlamaBlock, {}, {"options": inductor_preset("mix-order-64")}),
    "rotary-btd": (RotaryBTDBlock, {"attn": RotaryBTDAttention}, {}),
    "separate-qkv": (SeparateQKVBlock, {"attn": SeparateQKVAttention}, {}),
    "separate-gate-up": (SeparateGateUpBlock, {"mlp": SeparateGateUpSwiGLU}, {}),
    "concat-weights": (ConcatWeightsBlock, {"attn": ConcatWeightsAttention, "mlp": ConcatWeightsSwiGLU}, {}),
    "coordinate-descent": (LlamaBlock, {}, {"options": {"coordinate_descent_tuning": True}}),
    "rotary-halves": (RotaryHalvesBlock, {"attn": RotaryHalvesAttention}, {}),
    "expanded-kv": (ExpandedKVBlock, {"attn": ExpandedKVAttention}, {}),
    "grad-accum-fusion": (LlamaBlock, {}, {}),  # (FUSED_GRADIENTS: the compute copies' option)
    "max-autotune": (LlamaBlock, {}, {"mode": "max-autotune"}),
}


FUSED_GRADIENTS = {"grad-accum-fusion"}
"""The forms whose compute copies add their weight gradients into float32 in the products."""


def missing_options(variant: str) -> list:
    """The inductor options of ``variant``'s preset (throughput_rows.INDUCTOR_PRESETS) where this
    torch's inductor has none of them: such a form would compile as ``compiled`` does under its own
    name. (A preset this torch has in part runs with the part it has, as the throughput bench's row.)"""
    if variant not in INDUCTOR_PRESETS or inductor_preset(variant):
        return []
    return sorted(INDUCTOR_PRESETS[variant])


# max-autotune only when asked: minutes of autotuning, and 0.92x in a whole smollm-360m step on an
# H100; a preset form this torch cannot set, never
CUDA_DEFAULT = [v for v in VARIANTS if v != "max-autotune" and not missing_options(v)]


def build_block(variant: str, cfg, reference: LlamaBlock, device) -> torch.nn.Module:
    cls, parts, _ = VARIANTS[variant]
    block = cls(cfg)
    for name, part in parts.items():
        setattr(block, name, part(cfg))
    block.load_state_dict(reference.state_dict())
    return block.to(device)


def profiled(fn, device: torch.device, iters: int = 3) -> dict:
    """summarize_trace of ``iters`` calls, the per-kind times and kernel times divided by iters."""
    s = trace_calls(fn, iters, device)
    return {"ms_by_kind": {k: round(v / iters, 3) for k, v in s["device_ms_by_kind"].items()},
            "kernels": s["kernels"] // iters,
            # the device waiting on the host between kernels (the launches of an eager block)
            "idle_between_ms": round(s["idle_between_ms"] / iters, 3) if s["idle_between_ms"] is not None else None,
            # the costliest kernels, and each kind's leaders beyond them (training/profiling.py)
            "top_kernels": [{**t, "ms": round(t["ms"] / iters, 4), "launches": t["launches"] // iters}
                            for t in s["top_kernels"]]}


def measure(variant: str, model: str, seq: int, args, device: torch.device) -> dict:
    cfg = llama_preset_config(model, seq_len=seq)
    batch = max(1, args.tokens // seq)
    reference = LlamaBlock(cfg)  # float32, eager: the correctness column's reference
    llama_init_(reference, 0, cfg)  # as a model's block starts
    block = build_block(variant, cfg, reference, device)
    reference = reference.to(device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    copies = maybe_compute_copies(block, dtype, enabled=True, fuse_weight_gradients=variant in FUSED_GRADIENTS)
    module = copies.module if copies is not None else block
    if copies is not None:
        copies.begin_step()  # (fused: the gradients the products add into; they go on adding, as in a step)
        copies.refresh()
    compile_kwargs = VARIANTS[variant][2]
    compile_s = None
    compiled = compile_blocks([module], device=device, **compile_kwargs) if compile_kwargs is not None else None
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, seq, cfg.n_embd, generator=gen).to(device)
    dout = torch.randn(batch, seq, cfg.n_embd, generator=gen).to(device)
    # float32 in and out, as in a stage under autocast: the residual stream keeps the embedding's dtype
    x_in, dout_in = x.clone().requires_grad_(), dout

    def step():
        x_in.grad = None
        for p in module.parameters():
            p.grad = None
        with autocast_context(device, dtype):
            out = module(x_in)
        out.backward(dout_in)
        if copies is not None:  # the copies' gradients into the float32 ones, as a stage does per microbatch
            copies.accumulate()
        return out

    t0 = time.perf_counter()
    step()  # the first call compiles
    if device.type == "cuda":
        torch.cuda.synchronize()
    if compile_kwargs is not None:
        compile_s = round(time.perf_counter() - t0, 1)
    for _ in range(args.warmup):
        step()
    ms = timed(step, args.iters, device)
    got = [step().detach().float(), x_in.grad.float()]
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    out_ref.backward(dout)
    ref = [out_ref.detach(), x_ref.grad]
    err = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))
    fallbacks = compiled.fallbacks if compiled is not None else {}
    check = "ok" if err <= args.tol else f"FAIL (> {args.tol:g})"
    if fallbacks:  # the form ran eagerly: its figures are not the form's
        check = "FAIL (ran eagerly: " + "; ".join(f"{k}: {v}" for k, v in fallbacks.items()) + ")"
    row = {"variant": variant, "model": model, "seq_len": seq, "batch": batch, "dtype": args.dtype,
           "ms": round(ms, 4), "compile_s": compile_s, "max_rel_err": err, "check": check}
    if compiled is not None and getattr(compiled, "options", {}).get(concat_lowering.OPTION) == 0:
        # whose lowering built the concatenations: the package's (models/concat_lowering.py, on a
        # torch that cannot be asked for them) or inductor's own
        row["concat_lowering"] = "package" if concat_lowering.installed() else "inductor"
    if args.profile:
        row["profile"] = profiled(step, device)
    return row


def report(device: torch.device, rows: list) -> dict:
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": rows}


def write(args, device: torch.device, rows: list) -> None:
    if args.json and args.json != "-":
        write_json(args.json, report(device, rows))


def parse(argv=None):
    ap = ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--models", default=None, help="comma-separated presets (cuda: smollm-360m; cpu: llama-tiny)")
    ap.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join(VARIANTS)} "
                    "(cuda: all but max-autotune; cpu: eager)")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="cuda: bf16; cpu: fp32")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch (default 8192)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="calls before the timed ones, after the first "
                    "(which compiles); the timer adds two of its own")
    ap.add_argument("--tol", type=float, default=None, help="correctness bound (bf16 3e-2, fp32 1e-4)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled window")
    ap.add_argument("--json", default=None, help="write the rows to this file (- : stdout, alone)")
    args = ap.parse_args(argv)
    shapes = CUDA_SHAPES if args.device == "cuda" else CPU_SHAPES
    args.models = args.models.split(",") if args.models else [next(iter(shapes))]
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.variants:
        args.variants = args.variants.split(",")
    elif args.device == "cuda":  # every form this dtype has (the fused gradients' are bf16 only)
        args.variants = [v for v in CUDA_DEFAULT if args.dtype == "bf16" or v not in FUSED_GRADIENTS]
    else:
        args.variants = ["eager"]
    args.tol = args.tol if args.tol is not None else (3e-2 if args.dtype == "bf16" else 1e-4)
    for m in args.models:
        if m not in CUDA_SHAPES and m not in CPU_SHAPES:
            raise BenchError(f"--models: unknown model {m!r}; choose from {', '.join([*CUDA_SHAPES, *CPU_SHAPES])}")
    for v in args.variants:
        if v not in VARIANTS:
            raise BenchError(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        if v in FUSED_GRADIENTS and args.dtype != "bf16":
            raise BenchError(f"--variants: {v} fuses the bf16 compute copies' weight gradients; "
                             f"use --dtype bf16 or leave it out")
        if missing_options(v):
            raise BenchError(f"--variants: {v} needs inductor option(s) {', '.join(missing_options(v))}, which "
                             f"torch {torch.__version__} does not have; leave it out")
    for name in ("tokens", "iters"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be at least 0, got {args.warmup}")
    if not 0 < args.tol < math.inf:
        raise BenchError(f"--tol must be a positive relative difference, got {args.tol}")
    if args.json not in (None, "-"):
        check_report_path(args.json, "block_step.json")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device here; pass --device cpu")
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except BenchError as exc:
        print(f"block_step: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    to_stdout = args.json == "-"
    log = (lambda *a: print(*a, file=sys.stderr)) if to_stdout else print
    rows = []
    with attention_preference(resolve_attention("auto", device)):
        for model in args.models:
            seq = {**CUDA_SHAPES, **CPU_SHAPES}[model]
            for variant in args.variants:
                row = measure(variant, model, seq, args, device)
                rows.append(row)
                write(args, device, rows)  # after every row: a stopped run keeps what it measured
                kinds = ", ".join(f"{k} {v:.3f}" for k, v in row.get("profile", {}).get("ms_by_kind", {}).items())
                if row.get("profile", {}).get("idle_between_ms") is not None:
                    kinds += f"; device idle between kernels {row['profile']['idle_between_ms']:.3f}"
                log(f"{model:12s} T={seq:<5d} {variant:19s} {row['ms']:9.3f} ms  compile {row['compile_s']} s  "
                    f"err {row['max_rel_err']:.2e} {row['check']}  [{kinds}]")
                for t in row.get("profile", {}).get("top_kernels", []):
                    log(f"    {t['ms']:8.4f} ms x{t['launches']:<3d} {t['kind']:9s} {t['name'][:110]}")
    if to_stdout:
        print(json.dumps(report(device, rows), indent=1))
    return 1 if any(r["check"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
