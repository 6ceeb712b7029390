"""`make demo`: a short 2-stage PipeDream-2BW run with Muon + error feedback on the built-in corpus
(Python's own standard library source), then a table of the loss by step and the loss plot."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..info import build_info
from ..models.registry import model_config
from .config import RunConfig
from .run import preflight, train

OUT = Path("runs/demo")
FLAGS = ["--schedule", "2bw", "--stages", "2", "--microbatches", "4", "--micro-batch-size", "8",
         "--model", "small", "--optimizer", "muon", "--lr", "0.02", "--adamw-lr", "0.003",
         "--ef-beta", "0.5", "--steps", "150", "--eval-every", "25", "--ckpt-every", "150",
         "--data", "builtin"]
"""The same run as the asyncpp-train command line, printed for the reader to try."""


def demo_config() -> RunConfig:
    """The run FLAGS describe, built as a Python script would."""
    cfg = RunConfig()
    cfg.model = model_config("small")
    cfg.pipeline.schedule, cfg.pipeline.stages, cfg.pipeline.microbatches = "2bw", 2, 4
    cfg.pipeline.micro_batch_size = 8
    cfg.optim.name, cfg.optim.lr, cfg.optim.adamw_lr, cfg.optim.ef_beta = "muon", 0.02, 0.003, 0.5
    cfg.train.steps, cfg.train.eval_every, cfg.train.ckpt_every = 150, 25, 150
    cfg.data.source, cfg.train.out = "builtin", str(OUT)
    return cfg


def main() -> int:
    info = build_info()
    print(f"asyncpp_ext {info['version']}  torch {info['torch_version']}  CUDA kernels "
          f"{'compiled for ' + info['cuda_archs'] if info['cuda_compiled'] else 'not compiled'}  "
          f"GPU {'visible' if info['gpu_visible'] else 'not visible'}")
    print("training: asyncpp-train " + " ".join(FLAGS) + f" --out {OUT}")
    shutil.rmtree(OUT, ignore_errors=True)  # the demo always starts fresh
    cfg = demo_config()
    preflight(cfg)
    code = train(cfg)
    if code != 0:
        return code
    rows = [json.loads(line) for line in (OUT / "metrics.jsonl").read_text().splitlines()]
    print(f"\n{'step':>6} {'train loss':>11} {'eval loss':>10} {'tokens':>9} {'elapsed s':>10}")
    for r in rows:
        if r["step"] == 1 or "eval_loss" in r:
            eval_loss = f"{r['eval_loss']:.4f}" if "eval_loss" in r else ""
            print(f"{r['step']:>6} {r['loss']:>11.4f} {eval_loss:>10} {r['tokens']:>9} {r['elapsed_s']:>10.1f}")
    print(f"\nloss plot: {OUT / 'loss.png'}   metrics: {OUT / 'metrics.jsonl'}   "
          f"checkpoint: {OUT / 'ckpt-000150'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
