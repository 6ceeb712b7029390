"""Where CPU optimizer time goes when other processes share the cores: OpenMP runtimes, thread counts.

In ONE process, interleaved round by round, it measures
  1. which OpenMP runtime(s) are loaded (one libgomp: the loader reuses a loaded soname);
  2. the cost of one small torch op (an OpenMP parallel region) with 1 and 2 torch threads: on a
     loaded machine a 2-thread region waits for a descheduled team thread (a scheduler time slice);
  3. our fused apply kernel (worker pool, cpu_pool.h) with 1 and 2 threads on the same data;
  4. torch float32 matmul throughput before importing asyncpp_ext, and after our module is imported
     and our kernels have run (our idle helpers sleep; they must not slow torch down).
Run: .venv/bin/python bench/omp_contention.py [--rounds N]   (about 30 s)
"""
from __future__ import annotations

import os
import statistics
import time

import torch


def loaded_omp():
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line})


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def stats(ms):
    q = statistics.quantiles(ms, n=10)
    return f"median {statistics.median(ms):8.3f} ms  p10 {q[0]:8.3f}  p90 {q[-1]:8.3f}  max {max(ms):8.3f}"


def interleave(cases, rounds):
    """cases: {label: (threads, fn)}; one call of each per round, in rotating order."""
    out = {k: [] for k in cases}
    labels = list(cases)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            threads, fn = cases[label]
            torch.set_num_threads(threads)
            out[label].append(timed(fn))
    return out


def main(argv=None):
    from bench_command import ArgumentParser  # beside this script (its folder is on sys.path)

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error(f"--rounds must be >= 2 (a spread needs two timings of each case), got {args.rounds}")
    threads0 = torch.get_num_threads()
    print(f"# torch {torch.__version__}, {threads0} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    a = torch.randn(512, 512)
    mm = lambda: [a @ a for _ in range(20)]  # noqa: E731  ~100 MFLOP
    before = interleave({"torch matmul (asyncpp_ext not imported)": (threads0, mm)}, args.rounds)

    from asyncpp_ext.optim import _kernels as K  # noqa: E402 (import order is the experiment)

    print("# OpenMP runtimes loaded:", ", ".join(loaded_omp()))
    small = torch.randn(200_000)
    params = [torch.randn(1024, 1024) for _ in range(2)]
    updates = [torch.randn_like(p) for p in params]
    apply = lambda: K.apply_update(params, updates, [], [-1e-6] * 2, [], lr=1e-3, weight_decay=0.0,  # noqa: E731
                                   ef_beta=0.0)
    res = interleave({
        "torch add 200k floats, 1 thread": (1, lambda: small.add(1.0)),
        "torch add 200k floats, 2 threads": (2, lambda: small.add(1.0)),
        "asyncpp apply 2M floats, 1 thread": (1, apply),
        "asyncpp apply 2M floats, 2 threads": (2, apply),
        "torch matmul (after our kernels ran)": (threads0, mm),
    }, args.rounds)
    after = interleave({"torch matmul (asyncpp_ext imported, idle)": (threads0, mm)}, args.rounds)
    torch.set_num_threads(threads0)
    for label, ms in {**before, **res, **after}.items():
        print(f"  {label:<45} {stats(ms)}")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
