"""asyncpp-prepare-data throughput and memory on JSON lines, beside the tokenizer's own
``encode_batch`` on the same text.

Method. A byte-level BPE with <|endoftext|> (``--vocab``, GPT-2's 50257 by default) is trained on
the built-in corpus (Python's standard library source) plus, when present, tinyshakespeare; no
download. Documents are the corpus cut at blank lines (about 1-4 KB each) and Shakespeare's
speeches; they are written, in a new seeded order per pass, as ``--files`` JSONL files until
``--mb`` MB. Then, each in its own process, one after another:

  * encode_batch, 1 thread: the same documents, streamed from the same files, given to
    ``Tokenizer.encode_batch_fast`` 512 at a time with TOKENIZERS_PARALLELISM=false; only the calls
    are timed (reading and JSON parsing are free for it), and ``.ids`` is not even read;
  * encode_batch, all threads: the same with the tokenizer's own thread pool (every core);
  * encode_batch, 1 thread x N copies: N such processes at once, each over its share of the files
    (only the calls timed; the slowest copy's call time is the row's wall): what N cores give
    independent tokenizers side by side, the ceiling of any N-worker run on this machine;
  * ours, --workers N for N in ``--workers`` (default: 1 and the cores): the whole command --
    start, reading, decompression-free JSON parsing, encoding, EOT insertion, shards, sidecars,
    manifest -- timed from launch to exit.

Rates count the tokenizer's tokens of the documents (the EOT markers ours adds are not counted),
so every row is the same work. "per core" divides by the cores the run can use (1 thread: 1; all
threads and ours with N workers: min(N, cores), the writer process sharing them). Peak memory:
the largest sum of PSS (proportional set size, so pages shared between processes count once)
over the process and its children, sampled every 50 ms. The two --workers runs' outputs are
compared byte for byte. The machine's load average is printed before and after: on a shared
machine other processes take cores from every row alike, so compare rows of one run.

Run: .venv/bin/python bench/prepare_data.py [--mb 200] [--workers 1,2] [--vocab 50257] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_command import ArgumentParser  # noqa: E402
from proc_memory import tree_pss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
BATCH = 512


def _train_tokenizer(path: Path, vocab: int, text: str) -> float:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    start = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    tok.save(str(path))
    return time.perf_counter() - start


def _documents() -> tuple[list, str]:
    from asyncpp_ext.data import builtin_corpus

    text = bytes(builtin_corpus()).decode("utf-8", "ignore")
    docs = [d for d in text.split("\n\n\n") if d.strip()]
    source = "builtin corpus"
    if SHAKESPEARE.is_file():
        play = SHAKESPEARE.read_text(encoding="utf-8")
        docs += [d for d in play.split("\n\n") if d.strip()]
        text += play
        source += " + tinyshakespeare"
    return docs, source


def _write_corpus(folder: Path, docs: list, mb: float, files: int) -> tuple[int, int]:
    folder.mkdir(parents=True, exist_ok=True)
    target, written, count, outs = mb * 1e6, 0, 0, []
    outs = [open(folder / f"part-{i:03d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    rng, sweep = random.Random(0), 0
    while written < target:
        order = list(range(len(docs)))
        rng.shuffle(order)
        for k in order:
            line = json.dumps({"id": f"{sweep}-{k}", "text": docs[k]}) + "\n"
            outs[count % files].write(line)
            written += len(line.encode("utf-8"))
            count += 1
            if written >= target:
                break
        sweep += 1
    for f in outs:
        f.close()
    return written, count


def _baseline_child(tokenizer: str, folder: str, part: str = "0/1") -> None:
    """One process: encode_batch_fast over the documents of files ``k::n`` (``part`` "k/n"), 512
    at a time; prints JSON."""
    import resource

    from tokenizers import Tokenizer

    k, n = map(int, part.split("/"))
    tok = Tokenizer.from_file(tokenizer)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    totals = {"seconds": 0.0, "cpu_seconds": 0.0, "tokens": 0, "docs": 0}

    def timed_encode(batch: list) -> None:  # only the call is timed
        start, start_cpu = time.perf_counter(), time.process_time()
        out = encode(batch, add_special_tokens=False)
        totals["seconds"] += time.perf_counter() - start
        totals["cpu_seconds"] += time.process_time() - start_cpu
        totals["tokens"] += sum(len(e) for e in out)
        totals["docs"] += len(batch)

    for path in sorted(Path(folder).glob("*.jsonl"))[k::n]:
        with open(path, encoding="utf-8") as f:
            batch = []
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == BATCH:
                    timed_encode(batch)
                    batch = []
            if batch:
                timed_encode(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({**totals, "peak_bytes": peak}))


def _measure(cmd: list, env: dict) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds of the process and the children it waited for, peak PSS of the
    process tree, stdout) of a command."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, status, usage = 0, None, None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, tree_pss(proc.pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.stdout.read(), proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}): {err.strip()[-500:]}")
    return seconds, usage.ru_utime + usage.ru_stime, peak, out


def _measure_copies(cmds: list, env: dict) -> tuple[int, list]:
    """(summed peak PSS, stdouts) of commands started together (independent processes sharing
    the machine's cores); each reports its own timings on stdout."""
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    peaks, waiting = [0] * len(procs), set(range(len(procs)))
    while waiting:
        for i in list(waiting):
            pid, status, _ = os.wait4(procs[i].pid, os.WNOHANG)
            if pid:
                waiting.discard(i)
                if os.waitstatus_to_exitcode(status):
                    raise SystemExit(f"a baseline copy failed: {procs[i].stderr.read().strip()[-500:]}")
            else:
                peaks[i] = max(peaks[i], tree_pss(procs[i].pid))
        time.sleep(0.05)
    return sum(peaks), [p.stdout.read() for p in procs]


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes() if path.suffix == ".bin" else b"")
        if path.suffix == ".json":  # sidecars / manifest (the tokenizer path is the same)
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="JSONL to tokenize, MB (default 200)")
    parser.add_argument("--files", type=int, default=8, help="JSONL files (default 8)")
    parser.add_argument("--vocab", type=int, default=50257, help="BPE vocabulary (default 50257)")
    parser.add_argument("--workers", default=None, help="comma-separated --workers values "
                        "(default: 1 and the cores)")
    parser.add_argument("--shard-tokens", default="20M")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every row (default 1)")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--baseline-child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_child:
        _baseline_child(*args.baseline_child)
        return
    cores = len(os.sched_getaffinity(0))
    try:
        workers = [int(w) for w in args.workers.split(",")] if args.workers else sorted({1, cores})
    except ValueError:
        parser.error(f"--workers must be comma-separated whole numbers, got {args.workers!r}")
    # checked before the corpus is written and the tokenizer trained (a minute at the defaults)
    if not (math.isfinite(args.mb) and args.mb > 0):
        parser.error(f"--mb must be a positive number of megabytes, got {args.mb}")
    for flag, value, low in (("--files", args.files, 1), ("--repeats", args.repeats, 1), ("--vocab", args.vocab, 257),
                             ("--workers", min(workers), 1)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}"
                         + (" (the 256 bytes and an end-of-text token)" if flag == "--vocab" else ""))
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="prep-bench-")
    work = Path(args.dir or tmp.name)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--dir {work} cannot be made ({exc.strerror or exc}); choose a writable directory")
    try:
        docs, source = _documents()
        tok = work / "tokenizer.json"
        train_s = _train_tokenizer(tok, args.vocab, "".join(docs)[:6_000_000])
        written, count = _write_corpus(work / "corpus", docs, args.mb, args.files)
        print(f"corpus: {written / 1e6:.1f} MB of JSONL, {count:,} documents ({source}; "
              f"{len(docs):,} distinct), {args.files} files; tokenizer: byte-level BPE, vocabulary "
              f"{args.vocab:,}, trained in {train_s:.1f} s; {cores} cores; load average before "
              f"{os.getloadavg()[0]:.2f}")
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        configs = [("encode_batch, 1 thread", "base", "false", 1),
                   ("encode_batch, all threads", "base", "true", cores)]
        # What the machine gives independent single-thread tokenizers at once (each its share of
        # the files): the ceiling of any N-worker run, whatever it does besides encoding.
        configs += [(f"encode_batch, 1 thread x {n} copies", "copies", n, min(n, cores)) for n in workers if n > 1]
        configs += [(f"asyncpp-prepare-data --workers {n}", "ours", n, min(n, cores)) for n in workers]
        samples = {label: [] for label, *_ in configs}
        digests, shards = {}, {}
        for r in range(args.repeats):  # rounds, each in a rotated order: load hits every row alike
            for label, kind, arg, used in configs[r % len(configs):] + configs[:r % len(configs)]:
                if kind == "copies":
                    peak, outs = _measure_copies(
                        [[sys.executable, __file__, "--baseline-child", str(tok), str(work / "corpus"), f"{k}/{arg}"]
                         for k in range(arg)], dict(env, TOKENIZERS_PARALLELISM="false"))
                    results = [json.loads(o) for o in outs]
                    # As the 1-thread row: only the calls count (each copy's own timer); the
                    # copies run side by side, so the slowest one's call time is the row's wall.
                    samples[label].append((max(r["seconds"] for r in results), sum(r["cpu_seconds"] for r in results),
                                           peak, sum(r["tokens"] for r in results)))
                    continue
                if kind == "base":
                    _, _, peak, out = _measure([sys.executable, __file__, "--baseline-child", str(tok),
                                                str(work / "corpus")],
                                               dict(env, TOKENIZERS_PARALLELISM=arg))
                    result = json.loads(out)
                    samples[label].append((result["seconds"], result["cpu_seconds"], result["peak_bytes"],
                                           result["tokens"]))
                    continue
                out_dir = work / f"out-w{arg}"
                out_dir.mkdir(exist_ok=True)
                cmd = [sys.executable, "-m", "asyncpp_ext.data.prepare", "--tokenizer", str(tok),
                       "--input", str(work / "corpus"), "--out", str(out_dir / "train.bin"),
                       "--shard-tokens", args.shard_tokens, "--workers", str(arg)]
                seconds, cpu, peak, _ = _measure(cmd, dict(env, TOKENIZERS_PARALLELISM="false"))
                manifest = json.loads((out_dir / "train.manifest.json").read_text())
                samples[label].append((seconds, cpu, peak, manifest["num_tokens"] - manifest["num_documents"]))
                shards[label] = len(manifest["shards"])
                digests[arg] = _digest(out_dir)
                for p in out_dir.iterdir():
                    p.unlink()
        tokens = samples[configs[0][0]][0][3]
        assert all(t == tokens for rows in samples.values() for *_, t in rows), samples
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        rows = []
        for label, kind, arg, used in configs:
            walls, cpus, peaks = zip(*[(w, c, p) for w, c, p, _ in samples[label]])
            rows.append({"run": label, "cores": used, "tokens": tokens, "seconds": med(walls),
                         "best_seconds": min(walls), "cpu_seconds": med(cpus),
                         "peak_bytes": max(peaks), "shards": shards.get(label)})
        base_wall = tokens / rows[0]["seconds"]
        base_cpu = tokens / rows[0]["cpu_seconds"]
        print(f"load average after {os.getloadavg()[0]:.2f}; {args.repeats} round(s), medians; outputs "
              f"identical across --workers {','.join(map(str, workers))}: {len(set(digests.values())) == 1}\n")
        print(f"| {'run':<34} | cores | {'wall s':>6} | {'tokens/s':>9} | {'per core':>9} | "
              f"{'/ 1 thread':>10} | {'CPU s':>6} | {'tokens/CPU-s':>12} | {'/ 1 thread':>10} | {'peak PSS':>8} |")
        print(f"|{'-' * 36}|------:|{'-' * 7}:|{'-' * 10}:|{'-' * 10}:|{'-' * 11}:|{'-' * 7}:|"
              f"{'-' * 13}:|{'-' * 11}:|{'-' * 9}:|")
        for row in rows:
            rate, per_cpu = tokens / row["seconds"], tokens / row["cpu_seconds"]
            row.update(tokens_per_s=rate, per_core=rate / row["cores"], ratio_wall=rate / row["cores"] / base_wall,
                       tokens_per_cpu_s=per_cpu, ratio_cpu=per_cpu / base_cpu)
            print(f"| {row['run']:<34} | {row['cores']:>5} | {row['seconds']:>6.1f} | {rate:>9,.0f} | "
                  f"{rate / row['cores']:>9,.0f} | {row['ratio_wall']:>10.2f} | {row['cpu_seconds']:>6.1f} | "
                  f"{per_cpu:>12,.0f} | {row['ratio_cpu']:>10.2f} | {row['peak_bytes'] / 2**20:>5.0f} MB |")
        print(f"\n{tokens:,} tokens (without the {count:,} EOT markers ours adds) in every row. "
              "'/ 1 thread': per core (wall) or per CPU-second, over encode_batch with 1 thread; "
              "ours' CPU s include its start, reading, JSON parsing and writing, encode_batch's only the calls.")
        if args.json:
            print(json.dumps({"rows": rows, "mb": written / 1e6, "documents": count, "cores": cores,
                              "vocab": args.vocab, "repeats": args.repeats}, indent=1))
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
