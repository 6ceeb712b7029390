"""What cutting a step's minibatch costs: one token file against a --data-mix mixture of three.

Writes three uint16 token files (random ids, memory-mapped as training maps them), then times
``minibatch(position)`` -- the host work before each step: the window starts, the reads, the
(inputs, targets) tensors -- for one file (``BatchStream``) and for the three mixed 5 : 3 : 2
(``MixtureStream``), in the random and the epoch order, side by side; medians over ``--steps``
positions after a warm-up. The check column: the mixture's windows come from its sources in its
counts (each file's ids lie in a range of their own) and every minibatch has the shape asked for.

    python bench/data_batches.py [--quick] [--json] [--seq-len 1024] [--windows 64] [--tokens 8000000]
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:  # the bench's sibling scripts
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_command import ArgumentParser  # noqa: E402

from asyncpp_ext.data import BatchStream, MixtureStream, load_tokens  # noqa: E402

WEIGHTS = (5, 3, 2)
ID_RANGE = 20000  # each file's ids: [k * ID_RANGE, (k + 1) * ID_RANGE)


def _write_sources(root: Path, tokens: int) -> list[Path]:
    paths = []
    for k in range(len(WEIGHTS)):
        ids = np.random.default_rng(k).integers(k * ID_RANGE, (k + 1) * ID_RANGE, size=tokens, dtype=np.uint16)
        path = root / f"source{k}.bin"
        ids.tofile(path)
        paths.append(path)
    return paths


def _time(stream, steps: int) -> tuple[float, list]:
    """Median seconds of ``minibatch(p)`` over positions 1..steps (position 0 warms up)."""
    stream.minibatch(0)
    seconds, batches = [], []
    for position in range(1, steps + 1):
        began = time.perf_counter()
        batch = stream.minibatch(position)
        seconds.append(time.perf_counter() - began)
        batches.append((position, batch))
    return statistics.median(seconds), batches


def _checked(stream, batches, microbatches: int, batch: int, seq_len: int) -> bool:
    for position, minibatch in batches:
        if len(minibatch) != microbatches or any(x.shape != (batch, seq_len) or y.shape != (batch, seq_len)
                                                  for x, y in minibatch):
            return False
        if isinstance(stream, MixtureStream):
            firsts = np.concatenate([x[:, 0].numpy() for x, _ in minibatch]) // ID_RANGE
            if list(np.bincount(firsts, minlength=len(WEIGHTS))) != stream.counts(position):
                return False
    return True


def measure(seq_len: int, microbatches: int, batch: int, tokens: int, steps: int) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="data-batches-") as root:
        paths = _write_sources(Path(root), tokens)
        vocab = len(WEIGHTS) * ID_RANGE
        for sampling in ("random", "epoch"):
            def part(path):
                return BatchStream(load_tokens(str(path), vocab), microbatches, batch, seq_len, seed=0,
                                   sampling=sampling, vocab_size=vocab, source=path.name)
            one = part(paths[0])
            mixture = MixtureStream([part(p) for p in paths], list(WEIGHTS), names=[p.name for p in paths])
            for name, stream in (("one file", one), ("mixture 5:3:2", mixture)):
                median, batches = _time(stream, steps)
                rows.append({"data": name, "sampling": sampling, "ms_per_minibatch": 1e3 * median,
                             "check": "ok" if _checked(stream, batches, microbatches, batch, seq_len) else "MISMATCH"})
    for row in rows:
        base = next(r for r in rows if r["sampling"] == row["sampling"] and r["data"] == "one file")
        row["ratio"] = row["ms_per_minibatch"] / base["ms_per_minibatch"]
    return {"seq_len": seq_len, "microbatches": microbatches, "micro_batch_size": batch, "tokens_per_file": tokens,
            "steps": steps, "rows": rows, "check": "ok" if all(r["check"] == "ok" for r in rows) else "MISMATCH"}


def format_report(r: dict) -> str:
    lines = [f"minibatch of {r['microbatches']} x {r['micro_batch_size']} windows of {r['seq_len']} + 1 tokens, "
             f"files of {r['tokens_per_file']:,} tokens, medians of {r['steps']} positions",
             f"  {'data':<15}{'order':<8}{'ms':>9}{'ratio':>8}  check"]
    for row in r["rows"]:
        lines.append(f"  {row['data']:<15}{row['sampling']:<8}{row['ms_per_minibatch']:>9.2f}{row['ratio']:>8.2f}  "
                     f"{row['check']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8_000_000, help="tokens per file (default 8M: 16 MB)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="small files and minibatches (a second)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    if a.quick:
        a.seq_len, a.microbatches, a.micro_batch_size, a.tokens, a.steps = 64, 2, 8, 200_000, 10
    p.require_positive(a, ("seq_len", "microbatches", "micro_batch_size", "tokens", "steps"))
    if a.tokens < 4 * a.microbatches * a.micro_batch_size * (a.seq_len + 1):
        p.error(f"--tokens {a.tokens} is too few for minibatches of {a.microbatches} x {a.micro_batch_size} "
                f"windows of {a.seq_len} + 1; raise --tokens")
    result = measure(a.seq_len, a.microbatches, a.micro_batch_size, a.tokens, a.steps)
    print(json.dumps(result, indent=2) if a.json else format_report(result))
    return 0 if result["check"] == "ok" else 1


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
