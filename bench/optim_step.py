"""Optimizer step microbenchmark: asyncpp_ext.optim vs torch.optim on a GPT-like parameter set.

Columns (like nccl-tests): case, parameters, median step time, ratio (reference time / ours, >1 means
ours is faster), max relative error of ours vs the reference after one step from the same state
(max |dW_ours - dW_ref| / max |dW_ref|). Run: .venv/bin/python bench/optim_step.py [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from asyncpp_ext.optim import AdamW, Muon
from asyncpp_ext.optim import _kernels as K

A, B, C = 3.4445, -4.7750, 2.0315


def gpt_matrices(layers, width):
    shapes = []
    for _ in range(layers):
        shapes += [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return shapes


def gpt_vectors(layers, width, vocab=4096):
    return [(vocab, width), (width, vocab)] + [(width,)] * (4 * layers) + [(4 * width,)] * layers


class PlainMuon:
    """The same math as asyncpp Muon in plain PyTorch, one matrix at a time (the fp32 reference)."""

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
    params = [torch.randn(s, generator=gen).mul_(0.02).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def clone_params(params):
    out = [p.detach().clone().requires_grad_() for p in params]
    for o, p in zip(out, params):
        o.grad = p.grad.clone()
    return out


def one_step_error(make_ours, make_ref, shapes):
    start = make_params(shapes, seed=1)
    ours, ref = clone_params(start), clone_params(start)
    make_ours(ours).step()
    make_ref(ref).step()
    num = max((o - r).abs().max().item() for o, r in zip(ours, ref))
    den = max((r - s).abs().max().item() for r, s in zip(ref, start))
    return num / den


def interleaved_medians(ref, ours, repeats):
    """Alternate the two optimizers step by step so machine load hits both alike; median ms each."""
    ref.step()
    ours.step()
    t_ref, t_ours = [], []
    for _ in range(repeats):
        for opt, acc in ((ref, t_ref), (ours, t_ours)):
            t0 = time.perf_counter()
            opt.step()
            acc.append(time.perf_counter() - t0)
    return statistics.median(t_ref) * 1e3, statistics.median(t_ours) * 1e3


def compare(rows, label, shapes, make_ours, make_ref, ref_label, repeats):
    n = sum(math.prod(s) for s in shapes)
    t_ref, t_ours = interleaved_medians(make_ref(make_params(shapes)), make_ours(make_params(shapes)), repeats)
    err = one_step_error(make_ours, make_ref, shapes)
    rows.append(dict(case=f"{label}: {ref_label}", tensors=len(shapes), params=n, time_ms=t_ref, ratio=1.0,
                     max_rel_err=0.0))
    rows.append(dict(case=f"{label}: asyncpp", tensors=len(shapes), params=n, time_ms=t_ours,
                     ratio=t_ref / t_ours, max_rel_err=err))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--bf16-layers", type=int, default=1, help="layers of the reduced bf16 set")
    ap.add_argument("--bf16-width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mats = gpt_matrices(args.layers, args.width)
    bf16_mats = gpt_matrices(args.bf16_layers, args.bf16_width)
    rows = []
    lr, wd = 0.02, 0.01

    compare(rows, "muon bf16-NS (reduced set)", bf16_mats,
            lambda ps: Muon(ps, lr=lr, weight_decay=wd, ns_dtype=torch.bfloat16),
            lambda ps: torch.optim.Muon(ps, lr=lr, weight_decay=wd), "torch.optim.Muon", max(3, args.repeats // 2))
    compare(rows, "muon fp32-NS", mats, lambda ps: Muon(ps, lr=lr, weight_decay=wd, ns_dtype=torch.float32),
            lambda ps: PlainMuon(ps, lr, wd), "plain PyTorch", args.repeats)
    compare(rows, "muon fp32 EF on vs off", mats,
            lambda ps: Muon(ps, lr=lr, weight_decay=wd, ns_dtype=torch.float32, ef_beta=0.5),
            lambda ps: Muon(ps, lr=lr, weight_decay=wd, ns_dtype=torch.float32), "asyncpp EF off", args.repeats)
    rows[-1]["max_rel_err"] = float("nan")  # different algorithms (EF changes the update from step 2 on)
    all_shapes = mats + gpt_vectors(args.layers, args.width)
    for variant, kw in (("torch AdamW (for-loop)", dict(foreach=False)), ("torch AdamW foreach", dict(foreach=True)),
                        ("torch AdamW fused", dict(fused=True))):
        try:
            compare(rows, "adamw", all_shapes, lambda ps: AdamW(ps, lr=1e-3, weight_decay=wd),
                    lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=wd, **kw), variant, args.repeats)
        except RuntimeError as e:  # fused may be unavailable on this build
            rows.append(dict(case=f"adamw: {variant}", tensors=0, params=0, time_ms=float("nan"), ratio=float("nan"),
                             max_rel_err=float("nan"), note=str(e)[:80]))
    compare(rows, "adamw EF on vs off", all_shapes, lambda ps: AdamW(ps, lr=1e-3, weight_decay=wd, ef_beta=0.5),
            lambda ps: AdamW(ps, lr=1e-3, weight_decay=wd), "asyncpp EF off", args.repeats)
    rows[-1]["max_rel_err"] = float("nan")
    grads = [p.grad for p in make_params(all_shapes)]
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        K.first_nonfinite(grads)
    check_ms = (time.perf_counter() - t0) / args.repeats * 1e3
    rows.append(dict(case="NaN/Inf gradient scan (part of every step)", tensors=len(grads),
                     params=sum(g.numel() for g in grads), time_ms=check_ms, ratio=float("nan"),
                     max_rel_err=float("nan")))
    info = dict(torch=torch.__version__, threads=torch.get_num_threads(), layers=args.layers, width=args.width,
                bf16_set=f"{args.bf16_layers} layer(s) of width {args.bf16_width}")
    if args.json:
        print(json.dumps(dict(info=info, rows=rows), indent=1))
        return
    print(f"# torch {info['torch']}, {info['threads']} threads; GPT-like set: {args.layers} layers x width "
          f"{args.width}; bf16 set reduced to {info['bf16_set']} (bf16 matmul is very slow on this CPU)")
    print(f"# {'case':<46}{'tensors':>8}{'params':>11}{'time ms':>11}{'ratio':>8}{'max rel err':>13}")
    for r in rows:
        print(f"  {r['case']:<46}{r['tensors']:>8}{r['params']:>11}{r['time_ms']:>11.2f}{r['ratio']:>8.2f}"
              f"{r['max_rel_err']:>13.2e}")


if __name__ == "__main__":
    main()
