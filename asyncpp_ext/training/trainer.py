"""The per-step bookkeeping shared by every way of running steps: metrics, evaluation, checkpoints,
progress. What actually computes a step is a *step engine* with the ``StepEngine`` interface below:
the single-process ``DelaySimulator`` (simulate.py) or a pipeline rank's ``PipelineEngine``
(distributed.py).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional, Protocol, Sequence

import torch

from .async_checkpoint import BackgroundWriter, take_snapshot
from .checkpoint import checkpoint_path, save_checkpoint
from .profiling import StepProfiler, parse_profile_steps
from .config import RunConfig
from ..data import BatchStream
from .run_files import METRICS_NAME, draw_losses_after_failure, plot_losses
from .step_lines import StepLines
from . import stop_request
from .time_limit import SegmentClock, describe_duration
from .utilisation import run_peak_tflops, step_figures

class StepOutcome(NamedTuple):
    """What an engine yields for a step whose update was skipped (non-finite values), or whose
    end it timed where the step ran (a pipeline's stream runs ahead of its losses reaching the
    loop); plain steps yield just the loss."""
    loss: Optional[float]
    skipped: bool = False
    done_at: Optional[float] = None  # time.perf_counter() when the step completed; None: as it arrives


def finite(figures: dict) -> dict:
    """``figures`` with each non-finite float written None (JSON has no NaN or Infinity)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}


class StepEngine(Protocol):
    def train_steps(self, stream: BatchStream, steps: int) -> Iterator[Optional[float]]:
        """Run ``steps`` steps on the stream's next minibatches as one unit (a pipeline runs them
        as one continuous stream); yield each step's loss as it completes (None where this
        process does not see the loss, e.g. a pipeline stage other than the last)."""
        ...

    def eval_loss(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Optional[float]: ...

    def row_losses(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Optional[list]:
        """Each row's summed cross entropy over its targets, rows in order (--eval-choices; None
        where this process does not see them)."""
        ...

    # Optional: ``take_grad_norms() -> {step index: norm}``, the global gradient norms measured
    # (by --clip-grad-norm) since the last call; the rows of those steps get ``grad_norm``.

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Trainer:
    """Runs ``engine`` from ``start_step`` to ``cfg.train.steps``, writing into ``run_dir``.

    Step numbers count completed optimizer steps: the row ``step = k`` reports the loss of the
    k-th minibatch, and checkpoint ``ckpt-k`` holds the state after k steps. Steps run in
    segments that end at evaluation and checkpoint steps (and at the end), so a pipeline never
    has to stop mid-stream. In a multi-process run every rank runs a Trainer; only the one that
    sees the losses (``writes_metrics``) writes metrics.jsonl, and loss.png unless ``draws_plot``
    is False (a spawned pipeline's launcher draws it once its ranks end), and checkpointing is the
    collective ``checkpoint_fn``.
    """

    def __init__(self, cfg: RunConfig, engine: StepEngine, stream: BatchStream,
                 eval_set: Sequence[tuple[torch.Tensor, torch.Tensor]], run_dir: str | os.PathLike,
                 start_step: int = 0, elapsed_s: float = 0.0, device: str = "cpu",
                 checkpoint_fn: Optional[Callable[[int, dict], Path]] = None,
                 writes_metrics: bool = True, num_stages: int = 1,
                 agree_on_end: Optional[Callable[[int, bool], tuple[int, bool]]] = None,
                 started_at: Optional[float] = None, checkpoint_writer: Optional[BackgroundWriter] = None,
                 eval_sets: Optional[dict] = None, choice_sets: Optional[dict] = None,
                 draws_plot: Optional[bool] = None):
        self.cfg = cfg
        self.started_at = started_at  # when the command started (Unix time): --time-limit's origin
        # --time-limit, --stop-on-signal: the ranks of a pipeline end each segment where the
        # earliest of them proposes, and learn whether any noted the stop signal (an all-reduce in
        # distributed.py); one process decides alone
        self.agree_on_end = agree_on_end or (lambda end, noted: (end, noted))
        self.engine = engine
        self.stream = stream
        self.device = torch.device(device)
        self.eval_set = [(x.to(self.device), y.to(self.device)) for x, y in eval_set]
        # more held-out sets by name (build.build_eval_sets), evaluated with eval_set: eval_losses
        self.eval_sets = {name: [(x.to(self.device), y.to(self.device)) for x, y in batches]
                          for name, batches in (eval_sets or {}).items()}
        # --eval-choices: multiple-choice tasks by name (choice_eval.ChoiceSet), scored at each
        # evaluation after the losses: the rows' ``choices``
        self.choice_sets = {name: replace(task, batches=[(x.to(self.device), y.to(self.device)) for x, y in task.batches])
                            for name, task in (choice_sets or {}).items()}
        self.run_dir = Path(run_dir)
        self.step = start_step
        self.elapsed_before = elapsed_s
        # How a checkpoint gets written; a pipeline run replaces this with per-stage shards.
        self.checkpoint_fn = checkpoint_fn or self._save_single_process
        # --async-checkpoints: the thread that writes them (a pipeline's checkpoint_fn shares it)
        self.checkpoint_writer = checkpoint_writer
        if checkpoint_fn is None and cfg.writes_checkpoints_async():
            self.checkpoint_writer = BackgroundWriter()
        self.writes_metrics = writes_metrics
        self.draws_plot = writes_metrics if draws_plot is None else draws_plot  # loss.png
        self.num_stages = num_stages
        self.tokens_per_step = cfg.tokens_per_step()
        # model TFLOP/s and MFU per step (utilisation.py), where the engine knows its model's FLOPs
        self.flops_per_token = getattr(engine, "flops_per_token", None)
        self.peak_tflops = run_peak_tflops(cfg, self.compute_device) if self.flops_per_token else None
        self.lr_schedule = cfg.lr_schedule()
        self.base_lr = cfg.optim.effective_lr()
        # TensorBoard: the metrics writer logs the rows under tensorboard/; each stage of replica 0
        # of a pipeline logs its compute/wait shares under tensorboard/stageN (engines with a
        # ``time_shares()`` report them).
        self.tensorboard, self.tensorboard_stage = None, None
        if cfg.train.tensorboard:
            from .tensorboard_log import TensorboardLogger

            root = self.run_dir / "tensorboard"
            if writes_metrics:
                self.tensorboard = TensorboardLogger(root, purge_step=start_step + 1)
            if callable(getattr(engine, "time_shares", None)) and getattr(engine, "replica", 0) == 0:
                self.tensorboard_stage = TensorboardLogger(root / f"stage{engine.stage}", purge_step=start_step + 1)
        self.wandb = None  # --wandb: the metrics writer logs its rows to a W&B run too
        if cfg.train.wandb and writes_metrics:
            from .wandb_log import WandbLogger

            self.wandb = WandbLogger(self.run_dir, cfg.train.wandb_project, cfg.to_dict())

    @property
    def compute_device(self) -> torch.device:
        """The engine's compute device where it has one (a pipeline rank's Trainer holds its data
        on the CPU while the stage runs on a GPU, whose kernels and peak the profiler and the MFU
        are about), else the Trainer's."""
        return torch.device(getattr(self.engine, "device", None) or self.device)

    def _profiler(self) -> StepProfiler:
        """``--profile-steps``: this process's tracer, its files named by stage (and replica)."""
        spec = self.cfg.train.profile_steps
        who = f"stage{getattr(self.engine, 'stage', 0)}"
        if getattr(getattr(self.engine, "pipe", None), "dp", 1) > 1:
            who += f"_dp{getattr(self.engine, 'replica', 0)}"
        return StepProfiler(parse_profile_steps(spec) if spec else None, self.run_dir / "profile", who,
                            self.compute_device.type)

    def _save_single_process(self, step: int, meta: dict) -> Path:
        keep = self.cfg.train.keep_checkpoints
        if self.checkpoint_writer is None:
            return save_checkpoint(self.run_dir, step, [self.engine.state_dict()], meta, keep=keep)
        self.checkpoint_writer.wait()  # the write before: one copy of the state in memory at a time
        snapshot, rng = take_snapshot(0, self.engine.state_dict())
        self.checkpoint_writer.start(lambda: save_checkpoint(self.run_dir, step, [snapshot], meta, keep=keep,
                                                             rng_state=rng))
        return checkpoint_path(self.run_dir, step)

    def _checkpoint_written(self) -> None:
        """--async-checkpoints: until the checkpoint in flight is sealed (its error, if it failed)."""
        if self.checkpoint_writer is not None:
            self.checkpoint_writer.wait()

    def _is_due(self, step: int, every: int) -> bool:
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def _segment_end(self) -> int:
        """The next step at which every stage must be quiet: an eval, a checkpoint, the end, or a
        --profile-steps window's edge (a pipeline's stream runs ahead of the steps' losses reaching
        this loop: quiet before FIRST and after LAST, the trace holds those steps and only those)."""
        t = self.cfg.train
        ends = [t.steps]
        for every in (t.eval_every if self.eval_set else 0, t.ckpt_every if t.checkpoints else 0):
            if every > 0:
                ends.append((self.step // every + 1) * every)
        if t.profile_steps:
            first, last = parse_profile_steps(t.profile_steps)
            ends += [edge for edge in (first - 1, last) if edge > self.step]
        return min(ends)

    def save(self, elapsed_s: float) -> Path:
        meta = {"config": self.cfg.to_dict(), "data": self.stream.state_dict(),
                "elapsed_s": elapsed_s, "num_stages": self.num_stages}
        return self.checkpoint_fn(self.step, meta)

    def _log_rows(self, rows: list[dict]) -> None:
        """The rows written to metrics.jsonl, to TensorBoard and W&B where the run logs there."""
        if self.wandb is not None:
            self.wandb.log_rows(rows)
        if self.tensorboard is not None:
            for row in rows:
                self.tensorboard.log_metrics(row)
        if self.tensorboard_stage is not None and rows:
            measured = self.engine.time_shares()
            if measured is not None:
                self.tensorboard_stage.log_stage_shares(self.engine.stage, rows[-1]["step"], measured)

    def run(self) -> list[dict]:
        """Train to ``cfg.train.steps``; returns the metrics rows written by this call."""
        total = self.cfg.train.steps
        rows = []
        bar = None
        if self.writes_metrics and self.cfg.train.progress and sys.stderr.isatty() and total > self.step:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=self.step, desc="train", unit="step", file=sys.stderr)
        start = time.perf_counter()
        metrics = open(self.run_dir / METRICS_NAME, "a") if self.writes_metrics else None
        last_elapsed = self.elapsed_before
        profiler = self._profiler()
        pending = []  # this segment's rows, written at its end (with its checkpoint)
        failed = False
        t = self.cfg.train
        # --time-limit counts from the command's start where it is known, else from here
        origin = start - max(0.0, time.time() - self.started_at) if self.started_at is not None else start
        clock = SegmentClock(t.time_limit_s, origin, t.signal_response_s if t.stop_signal else None)
        if self.checkpoint_writer is not None:  # a stop's checkpoint waits for its write
            clock.write_s = self.checkpoint_writer.write_s
        end = clock.first_end(self.step, self._segment_end())
        lines = StepLines(self.run_dir, t.log_every if self.writes_metrics else 0, total, self.tokens_per_step,
                          self.flops_per_token, self.peak_tflops, self.step, self.elapsed_before)
        try:
            while self.step < total:
                pending = []
                segment_from, segment_start = self.step, time.perf_counter()
                profiler.before_steps(self.step + 1)
                for loss in self.engine.train_steps(self.stream, end - self.step):
                    outcome = loss if isinstance(loss, StepOutcome) else StepOutcome(loss)
                    skipped, loss = outcome.skipped, outcome.loss
                    if loss is not None and not math.isfinite(loss):
                        loss = None  # JSON has no NaN; the row says why
                    lr = self.base_lr * self.lr_schedule.multiplier(self.step)  # the lr step t used
                    self.step += 1
                    profiler.after_step(self.step)
                    # the step's own end where the engine timed it: a stream's losses come in bursts
                    done_at = outcome.done_at if outcome.done_at is not None else time.perf_counter()
                    elapsed = self.elapsed_before + done_at - start
                    step_s = elapsed - last_elapsed
                    last_elapsed = elapsed
                    pending.append({"step": self.step, "loss": loss, "lr": lr,
                                    "tokens": self.step * self.tokens_per_step,
                                    "tokens_per_s": round(self.tokens_per_step / step_s, 1) if step_s > 0 else None,
                                    **step_figures(self.tokens_per_step / step_s if step_s > 0 else None,
                                                   self.flops_per_token, self.peak_tflops),
                                    "elapsed_s": round(elapsed, 4),
                                    # when the loss reached the host (Unix seconds): a run's steps
                                    # set against what happened around them (its process's start)
                                    "time": round(time.time(), 3)})
                    if skipped:
                        pending[-1]["skipped"] = True
                    lines.step(pending[-1])
                    if bar is not None:
                        bar.update(1)
                        if loss is not None and not skipped:
                            bar.set_postfix(loss=f"{loss:.4f}")
                clock.trained(end - segment_from, time.perf_counter() - segment_start)
                # --clip-grad-norm's measured norms (a pipeline's last stage has the segment's by its end)
                norms = self.engine.take_grad_norms() if callable(getattr(self.engine, "take_grad_norms", None)) else {}
                by_block = (self.engine.take_block_grad_norms()
                            if callable(getattr(self.engine, "take_block_grad_norms", None)) else {})
                for row in pending:
                    if row["step"] - 1 in norms:
                        row["grad_norm"] = norms[row["step"] - 1]
                    if row["step"] - 1 in by_block:  # --log-block-grad-norms
                        row["grad_norms"] = by_block[row["step"] - 1]
                if self.eval_set and self._is_due(end, self.cfg.train.eval_every):
                    with clock.timing("eval"):
                        eval_loss = self.engine.eval_loss(self.eval_set)
                        # every rank evaluates every set, in one order (a pipeline's are collective)
                        named = {name: self.engine.eval_loss(batches) for name, batches in self.eval_sets.items()}
                        choices = {name: (task, self.engine.row_losses(task.batches))
                                   for name, task in self.choice_sets.items()}
                    if eval_loss is not None:  # JSON has no NaN: a non-finite one is written null
                        pending[-1]["eval_loss"] = eval_loss if math.isfinite(eval_loss) else None
                        if named:
                            pending[-1]["eval_losses"] = {name: loss if math.isfinite(loss) else None
                                                          for name, loss in named.items()}
                        if choices:
                            pending[-1]["choices"] = {name: finite(task.score(rows))
                                                      for name, (task, rows) in choices.items()}
                        lines.evaluated(end, pending[-1]["eval_loss"], pending[-1].get("eval_losses"),
                                        pending[-1].get("choices"))
                checkpoint_due = self.cfg.train.checkpoints and self._is_due(end, self.cfg.train.ckpt_every)
                next_end = self._segment_end() if self.step < total else total
                signalled = False
                if clock.sizes_segments and self.step < total:
                    noted = stop_request.requested()  # read once: a signal may land between two reads
                    proposal = self.step if noted else clock.next_end(self.step, next_end, checkpoint_due)
                    next_end, signalled = self.agree_on_end(proposal, noted)
                # the stop signal, or the time limit leaving no room for another step
                stop = next_end == self.step < total
                if stop:
                    pending[-1]["stopped"] = t.stop_signal if signalled else "time limit"
                written, pending = pending, []
                if metrics is not None:
                    metrics.write("".join(json.dumps(row) + "\n" for row in written))  # one write
                    metrics.flush()
                    os.fsync(metrics.fileno())  # metrics up to a checkpoint survive with it
                rows += written
                self._log_rows(written)
                if checkpoint_due or stop:
                    with clock.timing("checkpoint"):
                        saved = self.save(self.elapsed_before + time.perf_counter() - start)
                        if stop:
                            self._checkpoint_written()  # sealed before the line that names it
                if stop:
                    if self.writes_metrics:
                        why = (f"{t.stop_signal} (--stop-on-signal)" if signalled else
                               f"--time-limit {describe_duration(clock.limit_s)}")
                        print(f"{self.run_dir}: {why}: stopped at step {self.step} of {total} with checkpoint "
                              f"{saved.name}; continue with --resume {self.run_dir}", flush=True)
                    break
                end = next_end
            self._checkpoint_written()  # the run's last checkpoint is sealed before it ends
        except Exception:
            failed = True  # a NaN/Inf stop, a lost peer: the plot shows the losses that led there
            raise
        finally:
            if metrics is not None:
                # stopped inside a segment (a NaN/Inf stop, an interrupt): its finished steps' rows
                # still go in (a resume drops rows past its checkpoint's step)
                metrics.write("".join(json.dumps(row) + "\n" for row in pending))
                metrics.close()
            profiler.close()
            for logger in (self.tensorboard, self.tensorboard_stage, self.wandb):
                if logger is not None:
                    logger.close()
            if bar is not None:
                bar.close()
            if failed and self.draws_plot:
                draw_losses_after_failure(self.run_dir)
        if self.draws_plot:
            plot_losses(self.run_dir)
        return rows


__all__ = ["StepEngine", "StepOutcome", "Trainer"]
