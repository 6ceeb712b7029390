"""The attention kernel alone, per --attention choice: which SDPA backend torch runs for a model's
causal grouped-query attention, its forward + backward time and TFLOP/s, and a correctness column
(output and the three gradients against a float32 reference).

    python bench/attention_kernels.py                       # CUDA: smollm-135m / 1024, smollm-360m / 2048
    python bench/attention_kernels.py --device cpu          # tiny shapes, torch's own order (the smoke test)
    python bench/attention_kernels.py --json out.json --iters 20   # --json -: the JSON alone, on stdout
    python bench/attention_kernels.py --documents 256        # and within documents of 256 tokens

Each shape holds the tokens of one microbatch of the throughput bench (8 x 1024): the batch is
8192 / T sequences. Queries, keys and values are handed over as the model hands them -- (B, T,
heads, D) projections seen as (B, heads, T, D), the key/value heads grouped (``enable_gqa``) -- so
the backend named is the one training asks for. "first" is the --attention choice (cudnn: cuDNN
first; flash: cuDNN off; default: torch's own choice, what a run without the flag off Hopper, or
another library's model, gets), "runs" the backend torch then picks. FLOPs: 4*B*H*T*T*D for the forward
(two products), halved for the causal mask, and 2.5 times that for the backward (five products,
one of them recomputing the scores): 3.5 * 2*B*H*T*T*D in all. Correctness: the largest absolute
difference from the float32 math kernel, over the largest absolute reference value, must be at
most --tol (bf16 keeps 8 bits of mantissa; a kernel summing in bf16 would be far off).
With ``--documents L`` each shape also runs within documents of L tokens (``--document-mask``;
each row's boundaries at another offset): SDPA with the boolean mask ("sdpa+mask", the kernel
torch picks for a masked call) and, on CUDA, ``flex_attention`` compiled with the documents'
BlockMask ("flex", ``--attention flex``), checked against the math kernel under the same mask.
Their FLOPs count the allowed (query, key) pairs only: 3.5 * 4*H*D*pairs, the useful work, so a
kernel that skips the masked blocks shows it as TFLOP/s. The CPU's flex_attention has no
backward: there the documents' rows are SDPA's alone.
Bad inputs: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):  # the package, and the bench's sibling scripts
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from asyncpp_ext.models.attention import attention_preference, chosen_kernel  # noqa: E402
from asyncpp_ext.models.document_mask import attend_within, document_mask, flex_block_mask  # noqa: E402
from bench_command import BenchError, check_report_path, write_json  # noqa: E402

TOKENS = 8192  # one microbatch of bench/gpu_throughput.py (8 x 1024)
# name: (heads, key/value heads, head dim, sequence length): the SmolLM shapes the bench trains
CUDA_SHAPES = {"smollm-135m": (9, 3, 64, 1024), "smollm-360m": (15, 5, 64, 2048)}
CPU_SHAPES = {"tiny-gqa": (6, 2, 16, 64)}


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def reference(q, k, v, dout, mask=None):
    """Output and gradients from torch's math kernel in float32, the key/value heads expanded;
    causal, or by the boolean ``mask``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))  # (B, heads, T, D) leaves
    how = {"is_causal": True} if mask is None else {"attn_mask": mask}
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q32, k32.repeat_interleave(group, 1), v32.repeat_interleave(group, 1),
                                             **how)
    out.backward(dout.float())
    return [out.detach(), q32.grad, k32.grad, v32.grad]


def timed(fn, iters: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _problem(shape: tuple, device: torch.device, dtype):
    """(batch, (B, T, heads, D) q/k/v leaves, dout) of a shape: one microbatch's tokens."""
    heads, kv_heads, dim, seq = shape
    batch = max(1, TOKENS // seq)
    gen = torch.Generator(device="cpu").manual_seed(0)
    leaves = [torch.randn(batch, seq, h, dim, generator=gen).to(device, dtype).requires_grad_()
              for h in (heads, kv_heads, kv_heads)]
    return batch, leaves, torch.randn(batch, heads, seq, dim, generator=gen).to(device, dtype)


def _measured(attend, leaves, dout, iters: int, device: torch.device, reference_mask=None):
    """(ms, max relative error) of ``attend``'s forward + backward on the leaves seen as (B, heads,
    T, D), as the model's q/k/v projections hand them over."""
    def views():
        return [t.transpose(1, 2) for t in leaves]

    def step():
        for t in leaves:
            t.grad = None
        out = attend(*views())
        out.backward(dout)
        return out

    ms = timed(step, iters, device)
    got = [step().detach()] + [t.grad.transpose(1, 2) for t in leaves]
    ref = reference(*views(), dout, reference_mask)
    return ms, max(float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))


def _row(name, shape, batch, first, kernel, ms, flops, err, tol, **extra) -> dict:
    heads, kv_heads, dim, seq = shape
    return dict(shape=name, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=dim, seq_len=seq,
                first=first, kernel=kernel, ms=ms, tflops=flops / ms / 1e9, max_rel_err=err,
                check="ok" if err <= tol else f"FAIL (> {tol:g})", **extra)


def measure(name: str, shape: tuple, first: str, device: torch.device, dtype, iters: int, tol: float) -> dict:
    heads, _, dim, seq = shape
    batch, leaves, dout = _problem(shape, device, dtype)
    with attention_preference(first):
        kernel = chosen_kernel(*[t.transpose(1, 2) for t in leaves], enable_gqa=True)
        ms, err = _measured(attention, leaves, dout, iters, device)
    return _row(name, shape, batch, first, kernel, ms, 3.5 * 2 * batch * heads * seq * seq * dim, err, tol)


def document_boundaries(batch: int, seq: int, length: int, device) -> torch.Tensor:
    """(B, T) ids with the boundary token 1 every ``length`` positions, each row at another
    offset (documents cut at different places), 0 elsewhere."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        ids[b, (b * 37) % length::length] = 1
    return ids.to(device)


def measure_documents(name: str, shape: tuple, kernel: str, device: torch.device, dtype, iters: int, tol: float,
                      length: int) -> dict:
    """A row within documents of ``length`` tokens: "sdpa+mask" (the boolean mask) or "flex"
    (flex_attention compiled, the BlockMask)."""
    heads, _, dim, seq = shape
    batch, leaves, dout = _problem(shape, device, dtype)
    ids = document_boundaries(batch, seq, length, device)
    mask = document_mask(ids, 1)
    if kernel == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        compiled, blocks = torch.compile(flex_attention), flex_block_mask(ids, 1)
        runs = "flex"

        def attend(q, k, v):
            return compiled(q, k, v, block_mask=blocks, enable_gqa=True)
    else:
        runs = chosen_kernel(*[t.transpose(1, 2) for t in leaves], enable_gqa=True, attn_mask=mask)

        def attend(q, k, v):
            return attend_within(q, k, v, mask, enable_gqa=True)
    ms, err = _measured(attend, leaves, dout, iters, device, reference_mask=mask)
    pairs = int(mask.sum())  # the allowed (query, key) pairs of the batch
    return _row(name, shape, batch, kernel, runs, ms, 3.5 * 4 * heads * dim * pairs, err, tol, documents=length)


def parse_args(argv=None):
    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise BenchError(message)

    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=int, default=10, help="timed calls per row (median reported)")
    p.add_argument("--tol", type=float, default=2e-2, help="largest relative difference from the fp32 reference")
    p.add_argument("--json", help="write the rows here as well; '-': print the JSON instead of the table")
    p.add_argument("--documents", type=int, metavar="L",
                   help="also within documents of L tokens: SDPA with the boolean mask and (CUDA) flex_attention")
    args = p.parse_args(argv)
    if args.iters < 1:
        raise BenchError(f"--iters must be >= 1, got {args.iters}")
    if args.documents is not None and args.documents < 1:
        raise BenchError(f"--documents must be a document length >= 1, got {args.documents}")
    if not 0 < args.tol < math.inf:
        raise BenchError(f"--tol must be a positive relative difference, got {args.tol}")
    if args.json not in (None, "-"):
        check_report_path(args.json, "attention_kernels.json")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA GPU is visible; use --device cpu")
    return args


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        shapes, dtype, orders = CUDA_SHAPES, torch.bfloat16, ("default", "flash", "cudnn")
    else:  # no CUDA kernels there: torch's own choice, in float32
        shapes, dtype, orders = CPU_SHAPES, torch.float32, ("default",)
    rows = [measure(name, shape, first, device, dtype, args.iters, args.tol)
            for name, shape in shapes.items() for first in orders]
    if args.documents is not None:  # the CPU's flex_attention has no backward: SDPA's rows alone there
        kernels = ("sdpa+mask", "flex") if device.type == "cuda" else ("sdpa+mask",)
        rows += [measure_documents(name, shape, kernel, device, dtype, args.iters, args.tol, args.documents)
                 for name, shape in shapes.items() for kernel in kernels]
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    return dict(device=gpu, torch=torch.__version__, dtype=str(dtype).removeprefix("torch."), rows=rows)


def format_report(report: dict) -> str:
    lines = [f"# attention kernels on {report['device']}, torch {report['torch']}, {report['dtype']}, causal, "
             "grouped key/value heads (enable_gqa); FLOPs 3.5 * 2*B*H*T*T*D per forward + backward "
             "(within documents of L tokens, first = sdpa+mask or flex: 3.5 * 4*H*D*(allowed pairs))",
             f"{'shape':<14}{'B x H/KV x T x D':<28}{'first':<11}{'runs':<11}{'ms':>9}{'TFLOP/s':>10}"
             f"{'max rel err':>13}  check"]
    for r in report["rows"]:
        dims = f"{r['batch']} x {r['heads']}/{r['kv_heads']} x {r['seq_len']} x {r['head_dim']}"
        dims += f" L={r['documents']}" if "documents" in r else ""
        lines.append(f"{r['shape']:<14}{dims:<28}{r['first']:<11}{r['kernel']:<11}{r['ms']:>9.3f}{r['tflops']:>10.1f}"
                     f"{r['max_rel_err']:>13.2e}  {r['check']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except BenchError as exc:
        print(f"attention_kernels.py: {exc}", file=sys.stderr)
        return 2
    report = run(args)
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
        if args.json:
            write_json(args.json, report)
    return 0 if all(r["check"] == "ok" for r in report["rows"]) else 1


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
