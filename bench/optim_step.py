"""Optimizer step microbenchmark: asyncpp_ext.optim vs torch.optim on a GPT-like parameter set.

Method. Every case pits a reference against ours on identical fresh parameters and gradients. The
two step in alternation (reference, ours, reference, ... with the first one swapped every round), so
a burst of load from other processes hits both alike; the table shows the median step time and the
spread (10th-90th percentile) of each. Correctness, one step from the same start:
  AdamW: max |W_ours - W_ref| / max |W_ref - W_start| against a fixed bound (elementwise math);
  Muon: both ours and the reference against a float64 run of the same math (err = max |W - W64| /
  max |W64 - W_start|); "ok" when ours is no worse than twice the reference's own error (floor
  1e-6). Newton-Schulz amplifies rounding (up to a^5 ~ 480x along small singular values), so a
  fixed bound between two float32 runs would depend on the matrix size: at width 1024 plain
  PyTorch's float32 result is 1e-4 away from float64.
2bw rows (docs/design.md §1.3, asyncpp_ext/optim/versioned.py): two weight buffers, the parameters
pointed at the destination each step. "out-of-place" steps from W(t) in its buffer into the
destination against today's copy of W(t) into the destination plus an in-place step (checked bitwise
equal after three steps); "EF buffer"/"EF weights" time ef_source="buffer" and "weights" against EF
off, all three interleaved in one run, on the out-of-place step.
Run: .venv/bin/python bench/optim_step.py [--device cpu|cuda] [--repeats N] [--json]   (15 s at the default size)
Width sweep: --muon-widths 256,1024,2048 runs only the bf16 Muon step against torch.optim.Muon, on
--layers layers of matrices at each width, and, where bf16 matmuls are native, the matmul bound:
NS5's flops as plain bf16 torch.mm on the same shapes, and the speedup over torch a step doing only
those matmuls would reach (once both steps run at the matmul rate, no faster NS5 is possible). It
uses the full set on every CPU, with or without bf16 dot products (the header says which): without
them torch's bf16 matmuls take minutes per step from width 1024 on (use --layers 1 --repeats 1 there).
On --device cuda every case runs on GPU tensors (timed with a synchronize after each step), and the
Newton-Schulz throughput of our step is set against plain bf16 torch.mm on the same shapes.

Equal precision in the bf16 case. torch.optim.Muon runs Newton-Schulz in bfloat16: bf16 operands,
float32 accumulation inside the matmul, bf16 results. Ours (ns_dtype=torch.bfloat16) does the same:
natively on CPUs with bf16 dot products (AVX512-BF16/AMX, the same oneDNN kernels torch calls), and
elsewhere by rounding every intermediate to bf16 exactly where a bf16 run stores it while doing the
products in float32 (a product of two bf16 numbers is exact in float32, so only the summation order
differs). The header says which path ran. The errors of that row are bf16-sized (~1e-2).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch

from asyncpp_ext import build_info
from asyncpp_ext.optim import AdamW, Muon
from asyncpp_ext.optim import _kernels as K
from asyncpp_ext.optim.newton_schulz import NS_COEFFICIENTS, bf16_matmul_choice, cpu_has_bf16_dot

A, B, C = NS_COEFFICIENTS
LR, WD = 0.02, 0.01
DEVICE = torch.device("cpu")  # --device: where every parameter of every case lives


def gpt_matrices(layers, width):
    shapes = []
    for _ in range(layers):
        shapes += [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return shapes


def gpt_vectors(layers, width, vocab=4096):
    return [(vocab, width), (width, vocab)] + [(width,)] * (4 * layers) + [(4 * width,)] * layers


class PlainMuon:
    """The same math as asyncpp Muon in plain PyTorch, one matrix at a time: the fp32 reference,
    and on float64 parameters the float64 run the Muon rows are checked against."""

    def __init__(self, params, lr, wd, mu=0.95):
        self.params, self.lr, self.wd, self.mu = params, lr, wd, mu
        self.bufs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, b in zip(self.params, self.bufs):
            g = p.grad
            b.lerp_(g, 1 - self.mu)
            v = g.lerp(b, self.mu)
            x = v.T if v.shape[0] > v.shape[1] else v
            x = x / (x.norm() + 1e-7)
            for _ in range(5):
                a = x @ x.T
                x = torch.addmm(x, torch.addmm(a, a, a, beta=B, alpha=C), x, beta=A)
            o = x.T if v.shape[0] > v.shape[1] else x
            p.mul_(1 - self.lr * self.wd).add_(o, alpha=-self.lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).mul_(0.02).to(DEVICE).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
    return params


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def clone_params(params):
    out = [p.detach().clone().requires_grad_() for p in params]
    for o, p in zip(out, params):
        o.grad = p.grad.clone()
    return out


def motion_error(got, want, start):
    """max |got - want| relative to how far `want` moved from `start` (compared in float64)."""
    num = max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))
    den = max((w.double() - s.double()).abs().max().item() for w, s in zip(want, start))
    return num / den


def one_step_error(make_ours, make_ref, shapes):
    start = make_params(shapes, seed=1)
    ours, ref = clone_params(start), clone_params(start)
    make_ours(ours).step()
    make_ref(ref).step()
    return motion_error(ours, ref, start)


def error_vs_float64(make_opt, shapes):
    """One step of make_opt(params) from the seed-1 start vs the same step of PlainMuon in float64."""
    start = make_params(shapes, seed=1)
    got = clone_params(start)
    make_opt(got).step()
    exact = [p.detach().double().requires_grad_() for p in start]
    for e, p in zip(exact, start):
        e.grad = p.grad.double()
    PlainMuon(exact, LR, WD).step()
    return motion_error(got, exact, start)


def interleaved_times(steppers, repeats):
    """Alternate the steppers step by step (start swapped each round); seconds per stepper."""
    if DEVICE.type == "cuda":  # time each step to its completion on the GPU
        steppers = [lambda s=s: (s(), sync()) for s in steppers]
    for s in steppers:  # warm-up: state allocation, oneDNN primitive caches
        s()
    times = [[] for _ in steppers]
    for r in range(repeats):
        order = list(range(len(steppers)))
        if r % 2:
            order.reverse()
        for i in order:
            t0 = time.perf_counter()
            steppers[i]()
            times[i].append(time.perf_counter() - t0)
    return times


def summary(ts):
    # inclusive: the percentiles stay inside the measured range (the default method extrapolates
    # past it with few rounds, down to negative times)
    q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) >= 2 else [ts[0]] * 9
    return dict(median_ms=statistics.median(ts) * 1e3, p10_ms=q[0] * 1e3, p90_ms=q[-1] * 1e3)


def compare(rows, label, shapes, make_ours, make_ref, ref_label, repeats, err_bound):
    """err_bound: a number (ours vs the reference), "float64" (both vs float64, see the module
    docstring) or None (the two compute different things, e.g. EF on vs off: no check)."""
    ref, ours = make_ref(make_params(shapes)), make_ours(make_params(shapes))
    t_ref, t_ours = interleaved_times([ref.step, ours.step], repeats)
    ref_err = float("nan")
    if err_bound == "float64":
        err, ref_err = error_vs_float64(make_ours, shapes), error_vs_float64(make_ref, shapes)
        err_bound = max(2 * ref_err, 1e-6)
    else:
        err = one_step_error(make_ours, make_ref, shapes) if err_bound is not None else float("nan")
    n = sum(math.prod(s) for s in shapes)
    s_ref, s_ours = summary(t_ref), summary(t_ours)
    rows.append(dict(case=label, reference=ref_label, tensors=len(shapes), params=n,
                     ref=s_ref, ours=s_ours, speedup=s_ref["median_ms"] / s_ours["median_ms"],
                     max_rel_err=err, ref_err_vs_float64=ref_err, err_bound=err_bound,
                     check="-" if err_bound is None else ("ok" if err <= err_bound else "FAIL")))


def ef_kernel_rows(rows, shapes, repeats):
    """The fused apply kernel alone, EF off vs on: what EF adds to the memory traffic (one extra
    read and write of E next to read O, read+write W)."""
    params = [p.detach() for p in make_params(shapes)]
    updates = [torch.randn_like(p) for p in params]
    efs = [torch.zeros_like(p) for p in params]
    scales = [-LR] * len(params)
    off = lambda: K.apply_update(params, updates, [], scales, [], lr=LR, weight_decay=WD, ef_beta=0.0)  # noqa: E731
    on = lambda: K.apply_update(params, updates, efs, scales, [False] * len(params), lr=LR,  # noqa: E731
                                weight_decay=WD, ef_beta=0.5)
    t_off, t_on = interleaved_times([off, on], repeats * 4)
    s_off, s_on = summary(t_off), summary(t_on)
    rows.append(dict(case="apply kernel only, EF on", reference="apply kernel EF off", tensors=len(shapes),
                     params=sum(p.numel() for p in params), ref=s_off, ours=s_on,
                     speedup=s_off["median_ms"] / s_on["median_ms"], max_rel_err=float("nan"),
                     ref_err_vs_float64=float("nan"), err_bound=None, check="-"))


class TwoVersions:
    """A 2bw stage's weights: two buffer sets, the parameters pointed at the destination (buffer
    (t+1) % 2, holding W(t-1)) before each step. copy=True steps as the stage did: W(t) copied into
    the destination, then in place; else step_from reads W(t) from buffer t % 2 and, for EF from
    the weights, W(t-1) from the destination itself."""

    def __init__(self, shapes, make_opt, copy):
        self.params = make_params(shapes)
        self.bufs = [[p.detach().clone() for p in self.params] for _ in range(2)]
        self.opt, self.copy, self.t = make_opt(self.params), copy, 0

    def step(self):
        src, dst = self.bufs[self.t % 2], self.bufs[(self.t + 1) % 2]
        for p, d in zip(self.params, dst):
            p.data = d
        if self.copy:
            for d, s in zip(dst, src):
                d.copy_(s)
            self.opt.step()
        else:
            self.opt.step_from(dict(zip(self.params, src)), dict(zip(self.params, dst)) if self.t else None)
        self.t += 1


def timed_row(case, reference, shapes, t_ref, t_ours, err=float("nan"), err_bound=None):
    s_ref, s_ours = summary(t_ref), summary(t_ours)
    return dict(case=case, reference=reference, tensors=len(shapes), params=sum(math.prod(s) for s in shapes),
                ref=s_ref, ours=s_ours, speedup=s_ref["median_ms"] / s_ours["median_ms"], max_rel_err=err,
                ref_err_vs_float64=float("nan"), err_bound=err_bound,
                check="-" if err_bound is None else ("ok" if err <= err_bound else "FAIL"))


def versioned_rows(rows, label, shapes, make_opt, repeats, ef_repeats):
    """The 2bw rows of one optimizer (module docstring); make_opt(params, **ef_kwargs). ef_repeats:
    rounds of the EF on/off comparison, whose few-percent differences need more than the rest."""
    pair = [TwoVersions(shapes, make_opt, copy) for copy in (True, False)]
    t_copy, t_oop = interleaved_times([v.step for v in pair], repeats)
    check = [TwoVersions(shapes, make_opt, copy) for copy in (True, False)]
    for _ in range(3):
        for v in check:
            v.step()
    err = max((a - b).abs().max().item() for x, y in zip(*(v.bufs for v in check)) for a, b in zip(x, y))
    rows.append(timed_row(f"2bw {label} out-of-place", "copy + in-place", shapes, t_copy, t_oop, err, 0.0))
    ef = [TwoVersions(shapes, lambda ps, kw=kw: make_opt(ps, **kw), False)
          for kw in (dict(), dict(ef_beta=0.5, ef_source="buffer"), dict(ef_beta=0.5, ef_source="weights"))]
    t_off, t_buffer, t_weights = interleaved_times([v.step for v in ef], ef_repeats)
    rows.append(timed_row(f"2bw {label} EF buffer", "2bw EF off", shapes, t_off, t_buffer))
    rows.append(timed_row(f"2bw {label} EF weights", "2bw EF off", shapes, t_off, t_weights))


def ns_flops(shapes, steps=5):
    """Multiply-add FLOPs of NS5 on the wide side (r <= c): per step X X^T (2r^2c), G G (2r^3), P X (2r^2c)."""
    total = 0
    for rows, cols in shapes:
        r, c = min(rows, cols), max(rows, cols)
        total += steps * (4 * r * r * c + 2 * r ** 3)
    return total


def mm_tflops(shapes, repeats, steps=5):
    """Plain bf16 torch.mm doing NS5's products on the same shapes (wide side): the matmul ceiling
    our Newton-Schulz is measured against."""
    mats = [torch.randn(min(s), max(s), device=DEVICE, dtype=torch.bfloat16) for s in shapes]
    squares = [torch.randn(min(s), min(s), device=DEVICE, dtype=torch.bfloat16) for s in shapes]

    def products():
        for x, g in zip(mats, squares):
            for _ in range(steps):
                torch.mm(x, x.T)
                torch.mm(g, g)
                torch.mm(g, x)
        sync()  # timed to completion on the GPU, as every optimizer step is
    (times,) = interleaved_times([products], repeats)
    return ns_flops(shapes, steps) / statistics.median(times) / 1e12


def phase_breakdown(shapes, device, repeats):
    """Where one Muon bf16 step of ours spends its time: the step is run as is, with its four phases
    (NaN scan, momentum kernel, Newton-Schulz, apply kernel) timed from the outside (on CUDA with a
    synchronize around each, which adds a little)."""
    import asyncpp_ext.optim.fused as fused_mod

    spent = {}

    def timed(module, name, label):
        inner = getattr(module, name)

        def call(*args, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = inner(*args, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
            return out
        setattr(module, name, call)
        return inner

    params = make_params(shapes)
    if device == "cuda":
        params = [p.detach().cuda().requires_grad_() for p in params]
        for p, q in zip(params, make_params(shapes)):
            p.grad = q.grad.cuda()
    opt = Muon(params, lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16)
    patched = [(K, "first_nonfinite", "NaN/Inf scan"), (K, "muon_momentum", "momentum kernel"),
               (fused_mod, "orthogonalize", "Newton-Schulz"), (K, "apply_update", "apply kernel")]
    originals = [(m, n, timed(m, n, label)) for m, n, label in patched]
    try:
        opt.step()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(repeats):
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / repeats
    finally:
        for module, name, inner in originals:
            setattr(module, name, inner)
    phases = {label: spent.get(label, 0.0) / repeats for _, _, label in patched}
    phases["other (Python, lists)"] = max(0.0, total - sum(phases.values()))
    return dict(device=device, step_ms=total * 1e3, phases_ms={k: v * 1e3 for k, v in phases.items()},
                ns_tflops=ns_flops(shapes) / phases["Newton-Schulz"] / 1e12)


def print_breakdown(b):
    print(f"# where ours spends a Muon bf16 step on {b['device']}: {b['step_ms']:.2f} ms")
    print(f"# {'phase':<24}{'ms':>8}{'share':>8}")
    for label, ms in b["phases_ms"].items():
        print(f"  {label:<24}{ms:>8.2f}{ms / b['step_ms']:>8.0%}")
    print(f"# Newton-Schulz: {b['ns_tflops']:.2f} TFLOP/s (bf16 matmuls, 5 steps, wide side)")


def omp_runtimes():
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line})


def print_table(rows, info):
    print(f"# torch {info['torch']}, {info['threads']} threads, load average {info['load_start']} -> "
          f"{info['load_end']} (other processes share these cores; spreads show their effect)")
    print(f"# OpenMP runtimes loaded: {', '.join(info['omp_runtimes'])}; our CPU kernels: {info['cpu_kernel_isa']} clone")
    print(f"# GPT-like set: {info['layers']} layers x width {info['width']}; bf16 Newton-Schulz: {info['bf16_ns']}")
    print("# speedup = reference median / ours median (>1: ours faster); times are median [p10-p90] ms")
    print("# err: muon rows ours vs float64 ('ref err': the reference vs float64; bound 2x that), adamw rows "
          "ours vs the reference")
    print(f"# {'case':<30}{'reference':<24}{'tensors':>7}{'params':>10}{'reference ms':>26}{'ours ms':>26}"
          f"{'speedup':>8}{'err':>10}{'ref err':>10}{'bound':>10}  check")
    for r in rows:
        fmt = lambda s: f"{s['median_ms']:9.2f} [{s['p10_ms']:.2f}-{s['p90_ms']:.2f}]"  # noqa: E731
        bound = "-" if r["err_bound"] is None else f"{r['err_bound']:.2e}"
        ref_err = "-" if math.isnan(r["ref_err_vs_float64"]) else f"{r['ref_err_vs_float64']:.2e}"
        err = "-" if math.isnan(r["max_rel_err"]) else f"{r['max_rel_err']:.2e}"
        print(f"  {r['case']:<30}{r['reference']:<24}{r['tensors']:>7}{r['params']:>10} {fmt(r['ref']):>25}"
              f" {fmt(r['ours']):>25}{r['speedup']:>8.2f}{err:>10}{ref_err:>10}{bound:>10}  {r['check']}")


def parse_widths(text: str) -> list[int]:
    """--muon-widths: comma-separated positive integers."""
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        widths = []
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"--muon-widths {text!r}: give comma-separated positive widths, e.g. 256,1024,2048")
    return widths


def muon_width_rows(widths, layers, repeats, native_bf16):
    """The bf16 Muon step against torch.optim.Muon at each width (the full set, whatever the CPU).

    Where bf16 matmuls are native (a GPU, or a CPU with bf16 dot products) each row also gets the
    matmul bound: NS5's products on the same shapes as plain bf16 torch.mm (``mm_tflops``), the
    rate each step reaches on NS5's flops (its other work counted in its time), and
    ``speedup_ceiling``, torch's time over the time of NS5's flops at the plain-matmul rate: the
    lead over torch.optim.Muon that a Muon step doing nothing but those matmuls would have."""
    rows = []
    for width in widths:
        shapes = gpt_matrices(layers, width)
        compare(rows, f"muon bf16-NS width {width}", shapes,
                lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16),
                lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=WD), "torch.optim.Muon", repeats, "float64")
        row, flops = rows[-1], ns_flops(shapes)
        row["ns_gflop"] = flops / 1e9
        if native_bf16:
            row["mm_tflops"] = mm_tflops(shapes, repeats)
            row["ours_tflops"] = flops / (row["ours"]["median_ms"] * 1e-3) / 1e12
            row["ref_tflops"] = flops / (row["ref"]["median_ms"] * 1e-3) / 1e12
            row["speedup_ceiling"] = row["mm_tflops"] / row["ref_tflops"]
    return rows


def print_matmul_bound(rows) -> None:
    print("# matmul bound: NS5 flops; plain bf16 torch.mm on the same products; each step's rate on those "
          "flops; ceiling = the speedup over torch of a step that only does NS5's matmuls at the plain rate")
    print(f"# {'case':<28}{'NS GFLOP':>10}{'mm TFLOP/s':>12}{'ours TFLOP/s':>14}{'torch TFLOP/s':>15}"
          f"{'speedup':>9}{'ceiling':>9}")
    for r in rows:
        print(f"  {r['case']:<28}{r['ns_gflop']:>10.1f}{r['mm_tflops']:>12.3f}{r['ours_tflops']:>14.3f}"
              f"{r['ref_tflops']:>15.3f}{r['speedup']:>9.2f}{r['speedup_ceiling']:>9.2f}")


def main(argv=None):
    from bench_command import ArgumentParser  # beside this script (its folder is on sys.path)

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds per case")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the parameters live")
    ap.add_argument("--muon-widths", default=None, metavar="W1,W2,...",
                    help="only the bf16 Muon step vs torch.optim.Muon, at each of these widths (--layers each)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU")
    if args.layers < 1 or args.width < 1 or args.repeats < 1:
        ap.error(f"--layers, --width and --repeats must be >= 1 (got {args.layers}, {args.width}, {args.repeats})")
    load_start = "%.1f" % os.getloadavg()[0]
    if args.muon_widths is not None:
        try:
            widths = parse_widths(args.muon_widths)
        except ValueError as e:
            ap.error(str(e))
        if not hasattr(torch.optim, "Muon"):
            ap.error(f"--muon-widths compares with torch.optim.Muon, which torch {torch.__version__} lacks (>= 2.9)")
        return width_sweep(widths, args, load_start)
    mats = gpt_matrices(args.layers, args.width)
    all_shapes = mats + gpt_vectors(args.layers, args.width)
    bf16_path, bf16_reason = bf16_matmul_choice()  # $ASYNCPP_BF16_MATMUL or the CPU
    # Without bf16 dot products a bf16 step is slow on either path (torch.optim.Muon's native bf16
    # matmuls most of all); use a reduced set there.
    bf16_mats = mats if cpu_has_bf16_dot() or DEVICE.type == "cuda" else gpt_matrices(1, 128)
    rows = []
    reps = args.repeats
    if hasattr(torch.optim, "Muon"):  # torch >= 2.9
        compare(rows, "muon bf16-NS", bf16_mats, lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16),
                lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=WD), "torch.optim.Muon", reps, "float64")
    compare(rows, "muon bf16 EF on (beta 0.5)", bf16_mats,
            lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16, ef_beta=0.5),
            lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.bfloat16), "asyncpp EF off", reps, None)
    compare(rows, "muon fp32-NS", mats, lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.float32),
            lambda ps: PlainMuon(ps, LR, WD), "plain PyTorch fp32", reps, "float64")
    compare(rows, "muon fp32 EF on (beta 0.5)", mats,
            lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.float32, ef_beta=0.5),
            lambda ps: Muon(ps, lr=LR, weight_decay=WD, ns_dtype=torch.float32), "asyncpp EF off", reps, None)
    for variant, kw in (("torch AdamW for-loop", dict(foreach=False)), ("torch AdamW foreach", dict(foreach=True)),
                        ("torch AdamW fused", dict(fused=True))):
        compare(rows, "adamw", all_shapes, lambda ps: AdamW(ps, lr=1e-3, weight_decay=WD),
                lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=WD, **kw), variant, reps, 1e-5)
    compare(rows, "adamw EF on (beta 0.5)", all_shapes, lambda ps: AdamW(ps, lr=1e-3, weight_decay=WD, ef_beta=0.5),
            lambda ps: AdamW(ps, lr=1e-3, weight_decay=WD), "asyncpp EF off", reps, None)
    ef_kernel_rows(rows, mats, reps)
    # An AdamW step is ~100x cheaper than a Muon one: four times the rounds cost ~1 s.
    versioned_rows(rows, "adamw", all_shapes, lambda ps, **kw: AdamW(ps, lr=1e-3, weight_decay=WD, **kw), reps,
                   4 * reps)
    versioned_rows(rows, "muon " + ("bf16-NS" if DEVICE.type == "cuda" else "fp32-NS"), mats,  # ns_dtype auto
                   lambda ps, **kw: Muon(ps, lr=LR, weight_decay=WD, **kw), reps, reps)
    devices = ["cuda"] if DEVICE.type == "cuda" else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    breakdowns = [phase_breakdown(bf16_mats if d == "cpu" else mats, d, reps) for d in devices]
    mm = mm_tflops(mats, reps) if DEVICE.type == "cuda" else None
    grads = [p.grad for p in make_params(all_shapes)]
    (t_scan,) = interleaved_times([lambda: K.first_nonfinite(grads)], reps * 4)
    scan = summary(t_scan)
    info = dict(torch=torch.__version__, threads=torch.get_num_threads(), layers=args.layers, width=args.width,
                bf16_ns=(f"{bf16_path} ({bf16_reason})"
                         + ("" if bf16_mats is mats else "; reduced set 1 x 128: no bf16 dot products")),
                cpu_kernel_isa=build_info()["cpu_kernel_isa"], omp_runtimes=omp_runtimes(),
                load_start=load_start, load_end="%.1f" % os.getloadavg()[0],
                nan_scan_ms=scan["median_ms"], nan_scan_params=sum(g.numel() for g in grads), device=str(DEVICE))
    muon = next((r for r in rows if r["reference"] == "torch.optim.Muon"), None)
    summary_ = dict(device=str(DEVICE), checks_ok=all(r["check"] != "FAIL" for r in rows),
                    ours_muon_bf16_ms=muon["ours"]["median_ms"] if muon else None,
                    torch_optim_muon_ms=muon["ref"]["median_ms"] if muon else "torch.optim.Muon not in this torch",
                    ns_tflops=breakdowns[-1]["ns_tflops"], bf16_mm_tflops_same_shapes=mm)
    if args.json:
        print(json.dumps(dict(info=info, rows=rows, breakdowns=breakdowns, summary=summary_), indent=1))
        return
    print_table(rows, info)
    print(f"# NaN/Inf gradient scan (part of every step): {scan['median_ms']:.2f} ms "
          f"[{scan['p10_ms']:.2f}-{scan['p90_ms']:.2f}] over {info['nan_scan_params']} gradient elements")
    ef = {r["case"]: r["ours"]["median_ms"] / r["ref"]["median_ms"] - 1 for r in rows if r["reference"].endswith("EF off")
          or r["reference"] == "EF off"}
    print("# EF overhead (ours EF on / EF off - 1): " + ", ".join(f"{k}: {v:+.1%}" for k, v in ef.items()))
    print("# 2bw step without the copy (copy + in-place / out-of-place): " + ", ".join(
        f"{r['case']}: x{r['speedup']:.2f}" for r in rows if r["reference"] == "copy + in-place"))
    for b in breakdowns:
        print_breakdown(b)
    if mm is not None:
        print(f"# plain bf16 torch.mm, the same products on the same shapes: {mm:.2f} TFLOP/s")


def width_sweep(widths, args, load_start) -> None:
    bf16_path, bf16_reason = bf16_matmul_choice()
    capability = ("bf16 dot products (AVX512-BF16 or AMX)" if cpu_has_bf16_dot() else "no bf16 dot products"
                  ) if DEVICE.type == "cpu" else "GPU"
    native = DEVICE.type == "cuda" or bf16_path == "native"
    rows = muon_width_rows(widths, args.layers, args.repeats, native)
    info = dict(torch=torch.__version__, threads=torch.get_num_threads(), layers=args.layers,
                width=",".join(map(str, widths)), bf16_ns=f"{bf16_path} ({bf16_reason})", cpu_bf16=capability,
                cpu_kernel_isa=build_info()["cpu_kernel_isa"], omp_runtimes=omp_runtimes(),
                load_start=load_start, load_end="%.1f" % os.getloadavg()[0], device=str(DEVICE))
    if args.json:
        print(json.dumps(dict(info=info, rows=rows), indent=1))
        return
    print(f"# width sweep on {DEVICE}: {capability}")
    print_table(rows, info)
    if native:
        print_matmul_bound(rows)
    else:
        print("# no matmul bound: bf16 matmuls are not native here (emulated NS), so torch's are a slow path")


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
