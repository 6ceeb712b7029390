"""Per-step losses of a fixed set of ``asyncpp-train`` runs, kept in ``losses.json`` as a regression
record: the same command lines must give the same bits whatever the code's internal layout.

``python tests/golden/runs.py --write`` records them; ``--check`` (what the test runs) reproduces
them and exits 1 naming the first run that differs. Every run happens in this one process (the
multi-process runs spawn their ranks from it), under environment variables that make CPU float
arithmetic independent of the CPU model: MKL's conditional numerical reproducibility, torch's
baseline vector kernels, oneDNN's oldest ISA and asyncpp's baseline optimizer loops, one thread.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# Before torch is imported, in this process and (inherited) every rank it spawns.
PINNED_ENV = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
              "ASYNCPP_CPU_ISA": "baseline", "OMP_NUM_THREADS": "1", "ASYNCPP_BF16_MATMUL": "emulated"}

GOLDEN = Path(__file__).with_name("losses.json")
LLAMA_HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
COMMON = ["--no-progress", "--threads", "1", "--micro-batch-size", "2", "--seq-len", "16",
          "--eval-every", "3", "--ckpt-every", "0"]

# name -> flags (after COMMON); "resume" runs are continued from a checkpoint half way (see _run).
RUNS = {
    "sync-sim-muon-ef": ["--simulate", "--schedule", "sync", "--optimizer", "muon", "--ef-beta", "0.5",
                         "--microbatches", "2", "--steps", "6"],
    "gpipe-real-adamw": ["--stages", "2", "--schedule", "gpipe", "--optimizer", "adamw", "--microbatches", "2",
                         "--steps", "5"],
    "1f1b-real-adamw": ["--stages", "2", "--schedule", "1f1b", "--optimizer", "adamw", "--microbatches", "3",
                        "--steps", "5"],
    "2bw-real-muon-ef": ["--stages", "2", "--schedule", "2bw", "--optimizer", "muon", "--ef-beta", "0.5",
                         "--microbatches", "2", "--steps", "6", "--lr-schedule", "cosine", "--warmup-steps", "2"],
    "2bw-sim-muon-ef": ["--simulate", "--stages", "2", "--schedule", "2bw", "--optimizer", "muon",
                        "--ef-beta", "0.5", "--microbatches", "2", "--steps", "6", "--lr-schedule", "cosine",
                        "--warmup-steps", "2"],
    "pipedream-real-sgd": ["--stages", "3", "--schedule", "pipedream", "--optimizer", "sgd", "--lr", "0.05",
                           "--microbatches", "1", "--steps", "6"],
    "pipedream-sim-sgd": ["--simulate", "--stages", "3", "--schedule", "pipedream", "--optimizer", "sgd",
                          "--lr", "0.05", "--microbatches", "1", "--steps", "6"],
    "2bw-sim-lion-ef": ["--simulate", "--schedule", "2bw", "--optimizer", "lion", "--ef-beta", "0.5",
                        "--microbatches", "2", "--steps", "5"],
    "2bw-real-hf-tied-normuon": ["--hf-config", "{hf_config}", "--stages", "2", "--schedule", "2bw",
                                 "--optimizer", "normuon", "--microbatches", "2", "--steps", "5",
                                 "--clip-grad-norm", "1.0"],
    "2bw-sim-llama-dc": ["--simulate", "--model", "llama-tiny", "--schedule", "2bw", "--optimizer", "adamw",
                         "--mitigation", "dc", "--microbatches", "2", "--steps", "5"],
    "2bw-real-ppxdp-muon": ["--stages", "2", "--dp", "2", "--schedule", "2bw", "--optimizer", "muon",
                            "--microbatches", "2", "--steps", "4"],
    "2bw-real-muon-resumed": ["--stages", "2", "--schedule", "2bw", "--optimizer", "muon", "--ef-beta", "0.5",
                              "--microbatches", "2", "--steps", "6", "--ckpt-every", "3"],
}
RESUMED = {"2bw-real-muon-resumed": 3}  # run to this step, drop later checkpoints, resume to the end
NEEDS = {"2bw-sim-lion-ef": "pytorch_optimizer", "2bw-real-hf-tied-normuon": "transformers"}


def _run(name: str, flags: list, work: Path) -> list:
    from asyncpp_ext.training.cli import main

    hf_config = work / "llama_tied.json"
    hf_config.write_text(json.dumps(LLAMA_HF))
    flags = [f.format(hf_config=hf_config) for f in flags]
    out = work / name
    if "--hf-config" not in flags:
        flags = ["--n-layer", "2"] + flags
    argv = COMMON + flags + ["--data", "builtin"]
    if name in RESUMED:
        steps = argv[argv.index("--steps") + 1]
        part = list(argv)
        part[part.index("--steps") + 1] = str(RESUMED[name])
        if main(part + ["--out", str(out)]) != 0:
            raise SystemExit(f"{name}: the first part failed")
        if main(["--resume", str(out), "--steps", steps, "--no-progress"]) != 0:
            raise SystemExit(f"{name}: the resumed part failed")
    elif main(argv + ["--out", str(out)]) != 0:
        raise SystemExit(f"{name}: the run failed")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [[r["step"], r["loss"], r.get("eval_loss")] for r in rows]


def environment() -> dict:
    """What the record depends on besides the code: the built-in corpus is this Python's standard
    library source, and initialisation and kernels are torch's (a Xeon with Python 3.12 and torch
    2.11 gave other losses from step 1)."""
    import platform

    import torch

    return {"python": ".".join(platform.python_version_tuple()[:2]), "torch": torch.__version__}


def available(name: str) -> bool:
    import importlib.util

    return name not in NEEDS or importlib.util.find_spec(NEEDS[name]) is not None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode = argv[0] if argv else "--check"
    only = argv[1:]
    os.environ.update(PINNED_ENV)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    recorded_env = golden.pop("_environment", None)
    if mode == "--check" and recorded_env is not None and recorded_env != environment():
        print(f"skipped: recorded under {recorded_env}, this is {environment()}")
        return 0
    results, failures = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS.items():
            if only and name not in only:
                continue
            if not available(name):
                print(f"{name}: skipped ({NEEDS[name]} is not installed)")
                continue
            results[name] = _run(name, flags, Path(tmp))
            if mode == "--check":
                if name not in golden:
                    failures.append(f"{name}: no golden record")
                elif results[name] != golden[name]:
                    diff = next(((a, b) for a, b in zip(results[name], golden[name]) if a != b), None)
                    failures.append(f"{name}: differs from the golden record (first: now {diff[0] if diff else '?'}"
                                    f", recorded {diff[1] if diff else '?'})")
    if mode == "--write":
        merged = {"_environment": environment(), **golden, **results}
        GOLDEN.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in merged.items())
                          + "\n}\n")
        print(f"wrote {len(results)} runs to {GOLDEN}")
        return 0
    for line in failures:
        print(line)
    print(f"{len(results) - len(failures)} of {len(results)} runs match the golden record")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
