"""Checkpoints written in the loop against written in the background (--async-checkpoints).

Runs the same ``asyncpp-train`` run with ``--no-async-checkpoints`` and ``--async-checkpoints``,
alternating (``--repeats`` times each), every ``--ckpt-every`` steps a checkpoint, and reports
per mode the median wall time of the command and of its training loop (the last metrics row's
``elapsed_s``: the loop's own time, checkpoints included), the checkpoint size, async / sync as a
ratio, and a check column: the two modes' losses equal step for step and their last checkpoints
equal tensor for tensor (RNG states aside: the process's own, unseeded).

    python bench/checkpoint_overlap.py [--quick] [--device cpu|cuda] [--model tiny] [--n-embd 512] ...
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench's sibling scripts
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_command import ArgumentParser, BenchError  # noqa: E402

MODES = ("no-async", "async")


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _last_shards(run: Path) -> dict:
    last = sorted(run.glob("ckpt-*"))[-1]
    return {p.name: {k: v for k, v in torch.load(p, weights_only=True).items() if k != "rng"}
            for p in sorted(last.glob("stage-*.pt"))}


def _run(argv: list, out: Path) -> dict:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "asyncpp_ext.train", *argv, "--out", str(out)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise BenchError(f"asyncpp-train failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    size = sum(p.stat().st_size for p in sorted(out.glob("ckpt-*"))[-1].glob("stage-*.pt"))  # meta.json names the mode
    return {"wall_s": wall, "loop_s": rows[-1]["elapsed_s"], "losses": [r["loss"] for r in rows],
            "checkpoint_bytes": size}


def measure(train_args: list, repeats: int) -> dict:
    results = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="ckpt-overlap-") as root:
        for i in range(repeats):
            for mode in MODES:
                out = Path(root) / f"{mode}-{i}"
                results[mode].append(_run([*train_args, f"--{mode}-checkpoints"], out))
                if i == repeats - 1:
                    results[mode][-1]["shards"] = _last_shards(out)
        same_losses = all(r["losses"] == results["no-async"][0]["losses"] for rs in results.values() for r in rs)
        same_files = _same(results["no-async"][-1].pop("shards"), results["async"][-1].pop("shards"))
    summary = {mode: {"wall_s": statistics.median(r["wall_s"] for r in rs),
                      "loop_s": statistics.median(r["loop_s"] for r in rs),
                      "checkpoint_bytes": rs[-1]["checkpoint_bytes"]} for mode, rs in results.items()}
    return {"args": train_args, "repeats": repeats, "modes": summary,
            "loop_ratio": summary["async"]["loop_s"] / summary["no-async"]["loop_s"],
            "check": "ok" if same_losses and same_files else "MISMATCH"}


def format_report(r: dict) -> str:
    lines = [f"asyncpp-train {' '.join(r['args'])}  ({r['repeats']} runs per mode, medians)",
             f"  {'checkpoints':<14}{'wall s':>9}{'loop s':>9}{'ckpt MiB':>10}"]
    for mode, m in r["modes"].items():
        name = "background" if mode == "async" else "in the loop"
        lines.append(f"  {name:<14}{m['wall_s']:>9.2f}{m['loop_s']:>9.2f}{m['checkpoint_bytes'] / 2**20:>10.1f}")
    lines.append(f"  loop time background / in the loop: {r['loop_ratio']:.2f}   check: {r['check']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="tiny", help="asyncpp-train --model (default tiny, widened below)")
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a small model, 6 steps, one run per mode (seconds)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    if a.quick:
        a.n_embd, a.n_layer, a.seq_len, a.steps, a.repeats = 64, 2, 32, 6, 1
    p.require_positive(a, ("n_embd", "n_layer", "seq_len", "steps", "ckpt_every", "stages", "repeats"))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu")
    train_args = ["--model", a.model, "--n-embd", str(a.n_embd), "--n-layer", str(a.n_layer), "--n-head", "8",
                  "--seq-len", str(a.seq_len), "--micro-batch-size", "4", "--microbatches", "2",
                  "--steps", str(a.steps), "--ckpt-every", str(a.ckpt_every), "--eval-every", "0",
                  "--keep-checkpoints", "2", "--no-progress", "--device", a.device,
                  *(["--stages", str(a.stages)] if a.stages > 1 else ["--simulate"])]
    result = measure(train_args, a.repeats)
    print(json.dumps(result, indent=2) if a.json else format_report(result))
    return 0 if result["check"] == "ok" else 1


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
