"""``--profile-steps FIRST:LAST``: trace those optimizer steps with ``torch.profiler`` and say where
the time went.

Each process that trains writes, under ``OUT/profile/``:

* ``trace_<who>.json.gz`` -- the Chrome/Perfetto trace of the window (open in ui.perfetto.dev);
* ``summary_<who>.txt`` -- torch's operator table sorted by device time (CPU time on the CPU);
* ``summary_<who>.json`` -- the figures a reader checks first: the window's wall time, the time
  the GPU was busy (the union of every kernel and copy interval, so overlapping streams count
  once) and its share of the wall time, the kernel time by kind (matrix products, attention,
  Triton/compiled, other kernels, copies, collectives), the kernel count, and how often the host
  waited on the device (``cudaStreamSynchronize``/``cudaDeviceSynchronize`` calls and
  ``aten::_local_scalar_dense``, i.e. ``.item()``), and the costliest kernels by name with their
  time and launches (``top_kernels``: which attention kernel ran, which fusions cost most; the
  costliest overall, then each kind's costliest until a few are named and they hold most of
  their kind's time), and where the device
  sat idle: at the window's edges (``idle_edges_ms``), between its work (``idle_between_ms``) and
  the longest such gaps with the work on either side, the host operator that overlapped each
  most and the few that overlapped it most, outermost first (``idle_gaps``: a host sync, a loss
  read, the optimizer's Python).

``<who>`` is ``stage<S>`` (``stage<S>_dp<R>`` for data-parallel replicas). The window starts when
step FIRST-1 has completed and ends when step LAST has: in a pipeline, neighbouring steps overlap,
so the window holds the work the process did in that wall-time span. Tracing slows the traced
steps a little (the profiler records every operator); the steps outside the window run as usual.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Optional


class ProfileSpecError(ValueError):
    """A ``--profile-steps`` value that names no window of steps."""


def parse_profile_steps(text: str) -> tuple[int, int]:
    """``"FIRST:LAST"`` (or ``"K"``, one step) -> (first, last), 1-based, first <= last."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not match:
        raise ProfileSpecError(f"train.profile_steps must look like FIRST:LAST (e.g. 6:8), got {text!r}")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if first < 1 or last < first:
        raise ProfileSpecError(f"train.profile_steps={text!r} needs 1 <= FIRST <= LAST (steps count from 1)")
    return first, last


# Kernel kinds by name, the first that matches. Attention: the SDPA backends (flash, memory-
# efficient "fmha", cuDNN's "..._sdpa_..."), looked for first because the flash kernels' names
# carry their CUTLASS template arguments; matrix products: cuBLAS / cuBLASLt / CUTLASS names
# (sm90_xmma, nvjet, cutlass, gemm); Triton: what torch.compile (inductor) and the Triton-based
# extras generate.
_KINDS = (("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
          ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul", re.I)),
          ("triton", re.compile(r"^triton|_kernel$|liger|cce_", re.I)),
          ("collective", re.compile(r"nccl", re.I)))


TOP_KERNELS = 15
"""Kernels listed by name in a summary (``top_kernels``), the costliest first..."""
TOP_GAPS = 6
"""Idle gaps of the device listed in a summary (``idle_gaps``), the longest first."""
PER_KIND = 4
"""... and beyond those, each kind's costliest until it has this many listed,"""
KIND_SHARE = 0.9
"""... and on until the listed ones hold this share of their kind's time,"""
PER_KIND_MAX = 12
"""... but no more than this many of one kind (inductor's kernels: dozens of small ones)."""
HOST_OPS_PER_GAP = 5
"""Host operators listed per idle gap (``host_ops``): those that overlapped it most, outermost first."""


def kernel_kind(name: str, category: str) -> str:
    """The kind a device event counts under in the summary."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def summarize_trace(events: list[dict]) -> dict:
    """The summary figures of a Chrome trace's events (see the module docstring)."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver",
                                                                            "user_annotation", "python_function")]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", ""))) for e in device)
    busy, end, last = 0.0, None, ""
    gaps = []  # (idle us, where it starts, the device work before it, the device work after it)
    for start, stop, name in spans:  # the union of the intervals: overlapping streams count once
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, end, last, name))
            busy += stop - start
            end, last = stop, name
        elif stop > end:
            busy += stop - end
            end, last = stop, name
    times = [float(e["ts"]) for e in host + device] + [float(e["ts"]) + float(e.get("dur", 0.0)) for e in host + device]
    wall_us = (max(times) - min(times)) if times else 0.0
    origin = min(times) if times else 0.0
    edges_us = (spans[0][0] - origin) + (origin + wall_us - end) if spans else None  # None: no device work
    kinds: dict[str, float] = {}
    by_name: dict[str, list] = {}  # kernel name -> [ms, launches]
    for e in device:
        name = str(e.get("name", ""))
        kind = kernel_kind(name, e.get("cat", ""))
        kinds[kind] = kinds.get(kind, 0.0) + float(e.get("dur", 0.0)) / 1e3
        if e.get("cat") == "kernel":
            entry = by_name.setdefault(name, [0.0, 0])
            entry[0] += float(e.get("dur", 0.0)) / 1e3
            entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    top = ranked[:TOP_KERNELS]
    # and each kind's costliest beyond those, so that most of every kind's time has names (the
    # "other" kind's kernels sit below the matrix products and attention in a large model's list)
    for kind, kind_ms in kinds.items():
        listed = [v[0] for n, v in top if kernel_kind(n, "kernel") == kind]
        for name, value in ranked[TOP_KERNELS:]:
            if kernel_kind(name, "kernel") != kind:
                continue
            if len(listed) >= PER_KIND and (sum(listed) >= KIND_SHARE * kind_ms or len(listed) >= PER_KIND_MAX):
                break
            top.append((name, value))
            listed.append(value[0])
    top.sort(key=lambda kv: -kv[1][0])
    names = [str(e.get("name", "")) for e in host]
    return {
        "window_ms": round(wall_us / 1e3, 3),
        "device_busy_ms": round(busy / 1e3, 3),
        "device_busy_share": round(busy / wall_us, 4) if wall_us > 0 and device else None,
        "device_ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels": sum(1 for e in device if e.get("cat") == "kernel"),
        "host_syncs": sum(1 for n in names if n in ("cudaStreamSynchronize", "cudaDeviceSynchronize")),
        "item_calls": sum(1 for n in names if n == "aten::_local_scalar_dense"),
        # which kernels the time went to (which attention kernel ran, the costliest fusions)
        "top_kernels": [{"name": n[:160], "kind": kernel_kind(n, "kernel"), "ms": round(ms, 3), "launches": k}
                        for n, (ms, k) in top],
        # where the device waited: before its first and after its last work in the window (the
        # profiler's start and stop, the host's first launches) apart from the gaps between
        "idle_edges_ms": round(edges_us / 1e3, 3) if edges_us is not None else None,
        "idle_between_ms": round(sum(g[0] for g in gaps) / 1e3, 3) if spans else None,
        "idle_gaps": [_gap(g, origin, host) for g in sorted(gaps, key=lambda g: -g[0])[:TOP_GAPS]],
    }


def trace_calls(fn, calls: int, device) -> dict:
    """``summarize_trace`` of ``calls`` calls of ``fn`` under torch.profiler (the device's kernels
    too on CUDA), the window starting and ending with the device idle; the Chrome trace goes
    through a temporary file, the form its events are documented in. For benchmarks that trace a
    few calls of their own (a StepProfiler traces a run's steps and keeps its trace)."""
    import tempfile

    import torch

    dev = torch.device(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(dev)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return summarize_trace(json.loads(path.read_text()).get("traceEvents", []))


def _gap(gap: tuple, origin: float, host: list) -> dict:
    """One idle gap: its length, where in the window, the device work on either side, and the host
    operator that overlapped it most (what the host was doing while the device waited)."""
    us, start, before, after = gap
    stop = start + us

    def overlap(e):
        t = float(e["ts"])
        return min(stop, t + float(e.get("dur", 0.0))) - max(start, t)

    candidates = [e for e in host if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
    busiest = max(candidates, key=lambda e: (overlap(e), -float(e.get("dur", 0.0))), default=None)
    # and the ops that spanned it, outermost first (the step, the optimizer, the copy inside it):
    # a runtime call alone ("cudaMemcpyAsync") does not say which operator made it
    during = sorted((e for e in candidates if overlap(e) > 0), key=lambda e: (-overlap(e), -float(e.get("dur", 0.0))))
    return {"ms": round(us / 1e3, 3), "at_ms": round((start - origin) / 1e3, 3), "prev_work": before[:100],
            "next_work": after[:100],
            "host": str(busiest.get("name", ""))[:100] if busiest is not None and overlap(busiest) > 0 else None,
            "host_ops": [{"name": str(e.get("name", ""))[:100], "overlap_ms": round(overlap(e) / 1e3, 3)}
                         for e in during[:HOST_OPS_PER_GAP]]}


def _all_threads_config():
    """Record the operators of every thread: a pipeline's executor runs its stage on a thread of its
    own, started before the window. None where torch lacks the option (then only this thread's)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def _init_before_cuda_graphs() -> None:
    """Start and stop the profiler once, before any training: CUDA graphs captured before the
    profiler's first start (``--cuda-graphs`` captures at the first step, the window comes later)
    would make that start fail or lose the graphs' kernels; torch's remedy is an early empty
    profile, which initialises the device tracing before the capture."""
    from torch.autograd.profiler import profile

    with profile():
        pass


class StepProfiler:
    """Starts ``torch.profiler`` once step FIRST-1 has completed and writes its files once step
    LAST has (or when the run ends first). ``after_step(k)`` is called with each completed step."""

    def __init__(self, window: Optional[tuple[int, int]], out_dir: Path, who: str, device: str):
        self.window, self.out_dir, self.who, self.device = window, Path(out_dir), who, device
        self._prof = None
        self.written: Optional[Path] = None
        if window is not None and device == "cuda":
            _init_before_cuda_graphs()

    def before_steps(self, next_step: int) -> None:
        """Called with the number of the step about to run, before any of a segment's steps."""
        if self.window is not None and self._prof is None and self.written is None and next_step == self.window[0]:
            self._start()

    def after_step(self, step: int) -> None:
        if self.window is None or self.written is not None:
            return
        if self._prof is None and step == self.window[0] - 1:
            self._start()
        elif self._prof is not None and step >= self.window[1]:
            self._finish()

    def close(self) -> None:
        """The run ended: write what was traced (a window past the last step is cut short)."""
        if self._prof is not None:
            self._finish()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()  # the window starts with the device idle, not mid-step
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False,
                             experimental_config=_all_threads_config())
        self._prof.__enter__()

    def _finish(self) -> None:
        import torch

        if self.device == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f"trace_{self.who}.json"
        prof.export_chrome_trace(str(raw))  # torch writes the trace to a file only
        data = raw.read_bytes()
        raw.unlink()
        with gzip.open(f"{raw}.gz", "wb") as dst:
            dst.write(data)
        events = json.loads(data).get("traceEvents", [])
        summary = {"steps": list(self.window), **summarize_trace(events)}
        (self.out_dir / f"summary_{self.who}.json").write_text(json.dumps(summary, indent=1) + "\n")
        sort = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        try:
            table = prof.key_averages().table(sort_by=sort, row_limit=40)
        except (KeyError, AttributeError, RuntimeError):  # an older torch names the column cuda_time
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        (self.out_dir / f"summary_{self.who}.txt").write_text(table + "\n")
        self.written = self.out_dir


__all__ = ["ProfileSpecError", "StepProfiler", "kernel_kind", "parse_profile_steps", "summarize_trace", "trace_calls"]
