"""``--log-every N``: a line on stdout every N steps, for logs that no progress bar reaches.

A batch job's output is a file: the progress bar (drawn only on a terminal) never shows there,
and until the summary at the end the log would stay empty for hours. With ``--log-every N`` the
process that writes metrics.jsonl prints, as step N, 2N, ... complete::

    runs/x: step 1200/20000 loss 3.2104 lr 3.00e-04 | 145,200 tokens/s, 18.31 TFLOP/s, MFU 41.2% | 1h02m, ETA 2h11m

(tokens/s over the steps since the line before; elapsed training time, and the time left at that
rate), and each evaluation's loss as it is computed (``runs/x: step 1000 eval_loss 3.1104``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .time_limit import describe_duration
from .utilisation import step_figures


class StepLines:
    def __init__(self, run_dir: Path, every: int, total: int, tokens_per_step: int,
                 flops_per_token: Optional[float], peak_tflops: Optional[float], start_step: int,
                 start_elapsed: float):
        self.run_dir, self.every, self.total = run_dir, every, total
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_tflops
        self.since = (start_step, start_elapsed)  # (step, elapsed_s) of the line before

    def step(self, row: dict) -> None:
        """The line of ``row`` (a metrics row) when its step is one of every N."""
        if not self.every or row["step"] % self.every:
            return
        steps, seconds = row["step"] - self.since[0], row["elapsed_s"] - self.since[1]
        self.since = (row["step"], row["elapsed_s"])
        loss = "skipped" if row["loss"] is None else f"{row['loss']:.4f}"
        line = f"{self.run_dir}: step {row['step']}/{self.total} loss {loss} lr {row['lr']:.2e}"
        if seconds > 0 and steps > 0:
            rate = steps * self.tokens_per_step / seconds
            figures = step_figures(rate, self.flops_per_token, self.peak)
            line += f" | {rate:,.0f} tokens/s"
            if "tflops" in figures:
                line += f", {figures['tflops']:.4g} TFLOP/s"
            if "mfu" in figures:
                line += f", MFU {100 * figures['mfu']:.1f}%"
            left = (self.total - row["step"]) * seconds / steps
            line += f" | {describe_duration(row['elapsed_s'])}, ETA {describe_duration(left)}"
        print(line, flush=True)

    def evaluated(self, step: int, eval_loss: Optional[float], named: Optional[dict] = None,
                  choices: Optional[dict] = None) -> None:
        if self.every:
            def shown(loss):
                return "non-finite" if loss is None else f"{loss:.4f}"

            each = f" ({', '.join(f'{name} {shown(loss)}' for name, loss in named.items())})" if named else ""
            tasks = "".join(f", {name} accuracy {task['accuracy']:.4f} acc_norm {task['accuracy_norm']:.4f}"
                            for name, task in (choices or {}).items())
            print(f"{self.run_dir}: step {step} eval_loss {shown(eval_loss)}{each}{tasks}", flush=True)


__all__ = ["StepLines"]
