"""The host's work per training step, on the CPU: asyncpp-train against the compiled Hugging Face
model, at a model's structure but a width the CPU computes quickly.

Where the host sets a GPU step's pace (smollm-135m on one GPU: the GPU busy a quarter to a half of
the step), what matters is how many operations the host issues per step and what each costs it.
Both show on the CPU without a GPU: the model keeps its layers and heads, its width shrinks until
the arithmetic is small, and a profiler trace of a few steps counts the operations. Counted per
optimizer step, from ``torch.profiler`` traces of steps FIRST..LAST:

* ops: the innermost compute operations -- profiler ``cpu_op`` events that are no view, alias or
  allocation and hold no other compute operation (an inductor kernel, an ``mm``, an in-place
  ``add_``), i.e. what would be one kernel launch each on a GPU;
* compiled calls: dynamo cache lookups (one per compiled region called: the guards run there);
* ms/step: the untraced steps' mean (before the traced window; ours without a step that evaluated).

Rows: ours (``asyncpp-train --stages 1 --schedule sync --compile``) with ``--compile-scope block``
and ``stage``, and ``transformers.LlamaForCausalLM`` compiled whole (forward + loss, as
bench/gpu_throughput.py's ``hf compile`` row), the same shape, data, micro-batches, AdamW and dtype.
A first run compiles for about a minute per row on two cores (the inductor cache keeps later runs
short).

    python bench/host_ops.py [--layers 30 --width 72 --heads 9 --kv-heads 3 --mlp 192 --vocab 256]
        [--seq-len 32 --micro-batch-size 1 --microbatches 8 --steps 30 --trace 2 --dtype fp32|bf16]
        [--rows ours-block,ours-stage,ours-block-fusion,hf] [--json]
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import json
import statistics
import sys
import tempfile
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench_command import ArgumentParser  # noqa: E402

# ours-block-fusion: ours-block with --gradient-accumulation-fusion (bf16 only): what the fused
# weight-gradient products cost the host against the accumulate kernel they replace
ROWS = ("ours-block", "ours-stage", "ours-block-fusion", "hf")
# Operations that launch nothing on a GPU: views, aliases, allocations, host reads, casts' wrappers,
# and the host's own bookkeeping around compiled calls and gradient accumulation (an AccumulateGrad
# that takes the gradient over launches nothing; one that adds holds an add_, which counts).
NO_LAUNCH = {"TorchDynamo Cache Lookup", "Pregraph bytecode", "AOTDispatcher Runtime Wrapper Prologue",
             "torch::autograd::AccumulateGrad", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
"aten::as_strided", "aten::view", "aten::resolve_conj", "aten::resolve_neg", "aten::empty",
             "aten::empty_strided", "aten::empty_like", "detach", "aten::detach", "aten::_unsafe_view",
             "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::expand", "aten::alias",
             "aten::lift_fresh", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute",
             "aten::contiguous", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow",
             "aten::unbind", "aten::unflatten", "aten::flatten", "aten::view_as", "aten::_local_scalar_dense",
             "aten::item", "aten::is_nonzero", "aten::result_type", "aten::set_", "aten::to", "aten::_to_copy"}


def count_trace(events: list, steps: int) -> dict:
    """ops and compiled calls per step in a Chrome trace's events (see the module docstring)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            by_thread[e["tid"]].append(e)
    ops = collections.Counter()
    lookups = 0
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, inner = [], []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            e["_holds_op"] = False
            if e["name"] not in NO_LAUNCH:
                for outer in stack:
                    outer["_holds_op"] = True
            stack.append(e)
            inner.append(e)
        for e in inner:
            lookups += e["name"] == "TorchDynamo Cache Lookup"
            if e["name"] not in NO_LAUNCH and not e["_holds_op"]:
                ops[e["name"]] += 1
    return dict(ops_per_step=sum(ops.values()) / steps, compiled_calls_per_step=lookups / steps,
                top=[(name, n / steps) for name, n in ops.most_common(6)])


# The model-shape flags and the config fields they set, to name the flag in a config error.
SHAPE_FLAGS = {"model.n_layer": "--layers", "model.n_embd": "--width", "model.n_kv_head": "--kv-heads",
               "model.n_head": "--heads", "model.intermediate_size": "--mlp", "model.vocab_size": "--vocab",
               "model.seq_len": "--seq-len", "pipeline.micro_batch_size": "--micro-batch-size",
               "pipeline.microbatches": "--microbatches", "train.steps": "--steps"}


def _ours_config(args, row: str, out: Path):
    """The run config of one of our rows: asyncpp-train's flags at this shape, checked as the
    command checks them (ConfigError, RunSetupError)."""
    from asyncpp_ext.training.arguments import build_parser, config_from_args
    from asyncpp_ext.training.run import preflight

    scope = row.split("-")[1]
    first = args.steps - args.trace + 1
    argv = ["--model", "smollm-135m", "--n-layer", str(args.layers), "--n-embd", str(args.width),
            "--n-head", str(args.heads), "--vocab-size", str(args.vocab), "--seq-len", str(args.seq_len),
            "--micro-batch-size", str(args.micro_batch_size), "--microbatches", str(args.microbatches),
            "--stages", "1", "--schedule", "sync", "--optimizer", "adamw", "--ef-beta", "0", "--dtype", args.dtype,
            "--compile", "--compile-scope", scope, "--threads", "1", "--steps", str(args.steps),
            "--eval-batches", "0", "--no-checkpoints", "--no-progress", "--data", "builtin", "--out", str(out),
            "--profile-steps", f"{first}:{args.steps}"] + (["--gradient-accumulation-fusion"] if
                                                           row.endswith("-fusion") else [])
    # asyncpp-train's flags, read as the command reads them: smollm-135m's structure (grouped-query
    # heads, tied head) at this shape; the key/value heads and SwiGLU width have no flags.
    cfg = config_from_args(build_parser().parse_args(argv))
    cfg.model.n_kv_head, cfg.model.intermediate_size = args.kv_heads, args.mlp
    preflight(cfg)
    return cfg


def _ours(args, row: str, work: Path) -> dict:
    from asyncpp_ext.training.run import train

    out = work / row
    train(_ours_config(args, row, out))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {m["step"]: m["elapsed_s"] for m in metrics if "loss" in m}
    trace = next((out / "profile").glob("trace_*.json.gz"))
    row = count_trace(json.load(gzip.open(trace, "rt"))["traceEvents"], args.trace)
    return dict(row, ms_per_step=_mean_ms(elapsed, args), losses=[m["loss"] for m in metrics if "loss" in m])


def _hf(args, work: Path) -> dict:
    """The bench's Hugging Face training loop (throughput_workers.worker_train), its last steps traced."""
    import torch
    from throughput_workers import worker_train

    torch.set_num_threads(1)
    hf_config = dict(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.mlp,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
                     mlp_bias=False)
    trace = work / "hf-trace.json"
    out = worker_train(dict(kind="hf", device="cpu", seed=0, hf_config=hf_config,
                            shape=dict(vocab_size=args.vocab, tie_embeddings=True), optimizer="adamw",
                            dtype=args.dtype, compile=True, micro_batch_size=args.micro_batch_size,
                            microbatches=args.microbatches, seq_len=args.seq_len, steps=args.steps,
                            trace_steps=(args.steps - args.trace + 1, args.steps), trace_path=str(trace)))
    row = count_trace(json.loads(trace.read_text())["traceEvents"], args.trace)
    elapsed = {k + 1: t for k, t in enumerate(out["elapsed_s"])}
    return dict(row, ms_per_step=_mean_ms(elapsed, args), losses=out["losses"])


def _mean_ms(elapsed: dict, args) -> float:
    """Mean ms per step over the untraced steps after the first third (compiles and warm-up)."""
    last = args.steps - args.trace
    steps = [k for k in range(args.steps // 3 + 1, last + 1) if k - 1 in elapsed]
    return 1e3 * statistics.mean(elapsed[k] - elapsed[k - 1] for k in steps)


def parse_args(argv):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("layers", 30), ("width", 72), ("heads", 9), ("kv-heads", 3), ("mlp", 192),
                          ("vocab", 256), ("seq-len", 32), ("micro-batch-size", 1), ("microbatches", 8),
                          ("steps", 30), ("trace", 2)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rows", default=None, help=f"comma-separated, of {', '.join(ROWS)} (default: all that "
                    "run at --dtype: the fusion row under bf16 only)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if args.rows is None:
        args.rows = ",".join(r for r in ROWS if args.dtype == "bf16" or not r.endswith("-fusion"))
    args.rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in args.rows if r not in ROWS]
    if bad or not args.rows:
        ap.error(f"--rows: {', '.join(bad) or 'none given'}; choose from {', '.join(ROWS)}")
    if args.dtype != "bf16" and any(r.endswith("-fusion") for r in args.rows):
        ap.error(f"--rows ours-block-fusion: the fused weight gradients need bf16 compute copies; "
                 f"add --dtype bf16 (given {args.dtype})")
    if not 1 <= args.trace <= args.steps // 3:
        ap.error(f"--trace {args.trace}: trace 1 to a third of --steps ({args.steps // 3}) steps; the "
                 "first third warms up, the traced steps come last")
    if args.vocab < 256:
        ap.error(f"--vocab {args.vocab} is below 256: the rows train on the built-in corpus of byte ids")
    try:  # every row trains this shape: a bad one is one line now, not a traceback from the first row
        _ours_config(args, "ours-block", Path("unused"))
    except ValueError as exc:  # ConfigError, RunSetupError
        message = str(exc)
        for field, flag in SHAPE_FLAGS.items():
            message = message.replace(field, flag)
        ap.error(message)
    return args


def run(args) -> dict:
    """Each row's figures: ops_per_step, compiled_calls_per_step, top, ms_per_step, losses."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # inductor's kernels as profiler events (counted)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.rows:
            results[row] = _ours(args, row, Path(tmp)) if row.startswith("ours") else _hf(args, Path(tmp))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # --json: stdout is the JSON alone
        results = run(args)
    if args.json:
        print(json.dumps(dict(args=vars(args), rows=results), indent=1))
        return 0
    print(f"# {args.layers} layers x width {args.width}, {args.heads}/{args.kv_heads} heads, SwiGLU {args.mlp}, "
          f"vocab {args.vocab}; {args.microbatches} microbatches of {args.micro_batch_size} x {args.seq_len}; "
          f"{args.dtype}, AdamW, one thread; ops = innermost compute operations (a GPU launch each)")
    print(f"{'row':<18}{'ops/step':>10}{'compiled calls/step':>21}{'ms/step':>9}  most frequent ops")
    for row, r in results.items():
        top = ", ".join(f"{name[:40]} {n:.0f}" for name, n in r["top"][:3])
        print(f"{row:<18}{r['ops_per_step']:>10.0f}{r['compiled_calls_per_step']:>21.0f}{r['ms_per_step']:>9.1f}  {top}")
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
