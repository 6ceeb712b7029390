"""``asyncpp-train --dry-run``: every check a start makes, and what the run would be, with nothing
written and no process started.

A batch job that fails on a typo after an hour in the queue costs the hour. The dry run checks
what a start checks -- the flags and config (``preflight``), the data and each evaluation set,
the checkpoint to resume or start from and whether it fits, whether ``--out`` is free -- and
prints the run it would make: where, the model and its parameters, tokens per step and in all, the
schedule, the data (a mixture's share, tokens and epochs per source) and the evaluations, then the
``config.json`` the run would write. A bad input is the start's own one line and exit code 2.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..models.registry import build_model, describe
from ..pipeline.partition import as_blocks, split
from .config import RunConfig
from .run import check_inputs
from .run_files import RunDirError, holds_run, taken_message
from .stage_compute import document_boundary


def meta_model(cfg: RunConfig) -> Optional[torch.nn.Module]:
    """The model built on the meta device (no memory, no weights read), or None where it cannot be
    built there (a Hugging Face model's own code may need real tensors)."""
    try:
        with torch.device("meta"):
            return build_model(cfg.model, seed=cfg.train.seed)
    except Exception:  # noqa: BLE001 -- only figures of the summary are lost
        return None


def parameter_count(cfg: RunConfig) -> Optional[int]:
    """The model's parameters (a tied tensor once), or None (``meta_model``)."""
    model = meta_model(cfg)
    return None if model is None else sum(p.numel() for p in model.parameters())


def stage_line(model: torch.nn.Module, stages: int) -> str:
    """Each stage's blocks and parameters as the pipeline splits them (balanced by parameters; a
    tied tensor counts on every stage that holds a copy of it)."""
    blocks = as_blocks(model)
    each = []
    for stage, indices in enumerate(split(blocks, stages)):
        count = sum(p.numel() for i in indices for p in blocks[i].parameters())
        span = f"block {indices[0]}" if len(indices) == 1 else f"blocks {indices[0]}-{indices[-1]}"
        each.append(f"{stage}: {span} ({count:,} parameters)")
    return f"stages of {len(blocks)} blocks: " + ", ".join(each)


def dry_run(cfg: RunConfig, resume_dir: Optional[Path]) -> int:
    """Check ``cfg`` (validated) as a start would and print the run; exit code 0."""
    stream, start = check_inputs(cfg, resume_dir)
    out = Path(cfg.train.out)
    if resume_dir is None and out.is_dir() and holds_run(out) and not cfg.train.auto_resume:
        raise RunDirError(taken_message(out))
    p, t = cfg.pipeline, cfg.train
    tokens_per_step = cfg.tokens_per_step()
    model = meta_model(cfg)
    params = None if model is None else sum(p.numel() for p in model.parameters())
    where = f"resuming {out} at step {start} ({resume_dir.name})" if resume_dir is not None else f"{out}, a new run"
    data = stream.plan(t.steps)
    sets = f" and {len(cfg.data.eval_data)} more set(s)" if cfg.data.eval_data else ""
    if cfg.data.eval_choices:
        sets += f", {len(cfg.data.eval_choices)} multiple-choice task(s)"
    when = f"every {t.eval_every} steps" if t.eval_every else "at the end"  # the last step is always due
    evaluation = f"{when}, {cfg.data.eval_batches} batches{sets}" if cfg.data.eval_batches else "none"
    replicas = f" x {p.dp} replicas" if p.dp > 1 else ""
    print("asyncpp-train --dry-run: every check passed; nothing was written")
    print(f"run: {where}")
    print(f"model: {describe(cfg.model)}, seq_len {cfg.model.seq_len}"
          + (f", {params:,} parameters" if params is not None else ""))
    print(f"steps: {t.steps:,} x {tokens_per_step:,} tokens ({p.microbatches} microbatches of "
          f"{p.global_micro_batch_size} x {cfg.model.seq_len}), {t.steps * tokens_per_step:,} tokens in all")
    print(f"schedule: {p.schedule}, {p.stages} stage{'s' if p.stages > 1 else ''}{replicas}"
          f"{', simulated in one process' if t.simulate else ''}, on {t.device}")
    if model is not None and p.stages > 1:
        print(stage_line(model, p.stages))
    print(f"optimizer: {cfg.optim.name}, lr {cfg.optim.effective_lr():g}, {cfg.optim.lr_schedule} schedule"
          + (f", z-loss {cfg.optim.z_loss:g}" if cfg.optim.z_loss else ""))
    if cfg.train.document_mask is not None:
        print(f"attention: within documents, each starting at token {document_boundary(cfg)}"
              + (", by FlexAttention's block-sparse kernel" if cfg.train.attention == "flex" else ""))
    print(f"data: {data}")
    print(f"evaluation: {evaluation}")
    print("config.json:")
    print(json.dumps(cfg.to_dict(), indent=1))
    return 0


__all__ = ["dry_run", "meta_model", "parameter_count", "stage_line"]
