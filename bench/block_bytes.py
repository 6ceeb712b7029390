"""Bytes one compiled Llama block moves, by inductor's own estimates, per form of bench/block_step.py
with code of its own: a change to the block's code weighed on the CPU before a GPU measures its time.

    python bench/block_bytes.py                                  # smollm-360m, 8192 tokens, three forms
    python bench/block_bytes.py --forms compiled,separate-qkv --model smollm-135m --tokens 8192
    python bench/block_bytes.py --json out.json                  # --json -: the JSON alone, on stdout

Each form's block is compiled by inductor for the CPU, as training compiles it (bf16 compute
copies under bf16 autocast, ``compile_blocks``), and run forward and backward once on ``--tokens``
tokens. While inductor generates the forward's and the backward's code, the scheduler's nodes are
read after fusion: each node's bytes read and written (``get_read_write_buffers_sizes``, the
estimate inductor itself uses to weigh fusions), summed apart for the kernels inductor generates
and for the extern kernels it calls (matrix products, attention; not the nodes that only pick an
output of one). Reported per token, with the count of each kind of kernel. A form that counts no
kernel of either kind fails (exit 2): its code was not freshly scheduled.

What it does not say: time. Matrix products are compute-bound on a GPU and their bytes are not
their cost; the generated kernels are memory-bound there, their bytes close to their cost. The
CPU's kernels are not the GPU's: the CPU's attention is another extern kernel with other bytes,
and inductor fuses a little differently per backend (no split or mix-order reductions on the CPU).
Concatenations are lowered as kernels of their own here, as compiled blocks do on CUDA by default
(models/compile_support.DEVICE_OPTIONS). Inductor's code caches are off while a form compiles: a
cached graph is not scheduled again, and would count nothing. Exit 2 on bad input (one line).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # the package, and the bench's sibling scripts
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from asyncpp_ext.models.compile import compile_blocks  # noqa: E402
from asyncpp_ext.models.llama import LlamaBlock, llama_init_, llama_preset_config  # noqa: E402
from asyncpp_ext.pipeline.compute_copies import maybe_compute_copies  # noqa: E402
from bench_command import BenchError, check_report_path, write_json  # noqa: E402
from block_step import VARIANTS, build_block  # noqa: E402  (the forms and how they are built)

DEFAULT_FORMS = ("compiled", "separate-gate-up", "concat-weights")


@contextlib.contextmanager
def scheduled_bytes():
    """Yields a dict that collects, while inductor generates code, the bytes and the count of the
    generated and of the extern kernels of every graph it schedules. Inductor's and AOTAutograd's
    caches are off meanwhile: a graph served from them is not scheduled again."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import ir, scheduler as S

    totals = {"generated_bytes": 0, "extern_bytes": 0, "generated_kernels": 0, "extern_kernels": 0}
    original = S.Scheduler.codegen

    def codegen(self):
        for node in self.nodes:
            if isinstance(node, S.NopKernelSchedulerNode) or isinstance(node.node, ir.MultiOutput):
                continue  # views, concatenations' outputs, picks from an extern kernel's outputs: no kernel
            kind = "extern" if isinstance(node, S.ExternKernelSchedulerNode) else "generated"
            totals[f"{kind}_bytes"] += node.get_read_write_buffers_sizes()
            totals[f"{kind}_kernels"] += 1
        return original(self)

    S.Scheduler.codegen = codegen
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            if inductor_config.fx_graph_cache or functorch_config.enable_autograd_cache:
                # an environment variable forcing a cache on wins over the patch
                raise BenchError("TORCHINDUCTOR_FX_GRAPH_CACHE or TORCHINDUCTOR_AUTOGRAD_CACHE forces inductor's "
                                 "caches on, and a cached graph is not scheduled: unset them")
            yield totals
    finally:
        S.Scheduler.codegen = original


def measure(form: str, model: str, tokens: int, seq: int) -> dict:
    """One form's block: compiled, run forward and backward once, its scheduled bytes per token."""
    cfg = llama_preset_config(model, seq_len=seq)
    reference = LlamaBlock(cfg)
    llama_init_(reference, 0, cfg)
    block = build_block(form, cfg, reference, "cpu")
    copies = maybe_compute_copies(block, torch.bfloat16, enabled=True)
    copies.refresh()
    module = copies.module
    torch._dynamo.reset()  # each form compiled afresh (block_step's forms are classes of their own anyway)
    report = compile_blocks([module], device="cpu", **(VARIANTS[form][2] or {}))
    x = torch.randn(tokens // seq, seq, cfg.n_embd, requires_grad=True)
    with scheduled_bytes() as totals:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().sum().backward()
    if report.fallbacks:
        raise BenchError(f"form {form} did not compile ({'; '.join(report.fallbacks.values())}); nothing to count")
    if not (totals["generated_kernels"] and totals["extern_kernels"]):  # a graph no scheduler saw
        raise BenchError(f"form {form}: inductor scheduled no kernels of one kind ({totals}); its code "
                         "came from elsewhere than a fresh compile, nothing to count")
    n = x.shape[0] * x.shape[1]
    kb = {k.replace("_bytes", "_kb_per_token"): round(v / n / 1024, 1) for k, v in totals.items() if k.endswith("bytes")}
    return {"form": form, "model": model, "tokens": n, **kb,
            "total_kb_per_token": round(kb["generated_kb_per_token"] + kb["extern_kb_per_token"], 1),
            "generated_kernels": totals["generated_kernels"], "extern_kernels": totals["extern_kernels"]}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (main), not argparse's usage and message
        raise BenchError(message)


def own_forms() -> list:
    """``compiled`` and the forms with code of their own: the others differ from ``compiled`` only
    in inductor options for GPU kernels (Triton's), which change nothing generated for the CPU."""
    return [v for v, (_, parts, kw) in VARIANTS.items() if kw is not None and (v == "compiled" or parts)]


def parse(argv=None):
    ap = _Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--forms", default=",".join(DEFAULT_FORMS),
                    help=f"comma-separated compiled forms of bench/block_step.py (default {','.join(DEFAULT_FORMS)})")
    ap.add_argument("--model", default="smollm-360m", help="a Llama preset (default smollm-360m)")
    ap.add_argument("--seq-len", type=int, default=2048, help="sequence length (default 2048)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch (default 8192): the "
                    "weights' bytes spread over them")
    ap.add_argument("--json", default=None, help="write the rows to this file (- : stdout, alone)")
    args = ap.parse_args(argv)
    args.forms = [f for f in args.forms.split(",") if f]
    if not args.forms:
        raise BenchError(f"--forms is empty; name one or more of {', '.join(own_forms())}")
    for form in args.forms:
        if form not in own_forms():
            raise BenchError(f"--forms: {form!r} is not a compiled form with code of its own; choose from "
                             f"{', '.join(own_forms())}")
    try:
        llama_preset_config(args.model, seq_len=args.seq_len)
    except Exception as exc:
        raise BenchError(f"--model {args.model} / --seq-len {args.seq_len}: {str(exc).splitlines()[0]}") from None
    if args.tokens < args.seq_len or args.tokens % args.seq_len:
        raise BenchError(f"--tokens must be a multiple of --seq-len ({args.seq_len}), got {args.tokens}")
    if args.json not in (None, "-"):
        check_report_path(args.json, "block_bytes.json")
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except BenchError as exc:
        print(f"block_bytes: {exc}", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    log(f"# {args.model}, {args.tokens} tokens of {args.seq_len}, bf16 autocast, compute copies, inductor on the "
        f"CPU (torch {torch.__version__}); KB per token, forward + backward")
    log(f"{'form':<20} {'generated':>10} {'extern':>8} {'total':>8} {'gen. kernels':>13} {'extern kernels':>15}")
    rows = []
    try:
        for form in args.forms:
            row = measure(form, args.model, args.tokens, args.seq_len)
            rows.append(row)
            log(f"{form:<20} {row['generated_kb_per_token']:>10.1f} {row['extern_kb_per_token']:>8.1f} "
                f"{row['total_kb_per_token']:>8.1f} {row['generated_kernels']:>13} {row['extern_kernels']:>15}")
    except BenchError as exc:
        print(f"block_bytes: {exc}", file=sys.stderr)
        return 2
    result = {"torch": torch.__version__, "rows": rows}
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
