"""TensorBoard logging of a run's metrics rows and of each pipeline stage's compute/wait split.

``TensorboardLogger`` writes the scalars of the rows the trainer appends to ``metrics.jsonl``
(train/loss, eval/loss, train/lr, train/tokens_per_s, train/tflops, train/mfu, keyed by optimizer
step) and per-stage time shares (stage{s}/compute_share, stage{s}/wait_share).
``stage_time_shares`` computes those shares from a ``Pipeline.trace``. TensorBoard is optional:
``pip install 'asyncpp_ext[tensorboard]'``; it is imported only when a logger is created.
"""
from __future__ import annotations

import math
import numbers
from os import PathLike
from typing import Iterable, Mapping, Optional, Union

INSTALL_HINT = "pip install 'asyncpp_ext[tensorboard]'"
"""The command that installs the optional TensorBoard dependency."""

COMPUTE_OPS = frozenset({"forward", "backward", "optimizer_step"})
"""Trace ops that are stage compute; the others (recv_act, send_act, recv_grad, send_grad) are
waits for or hand-offs of transfers."""

# metrics.jsonl key -> TensorBoard tag
METRIC_TAGS = (("loss", "train/loss"), ("eval_loss", "eval/loss"), ("lr", "train/lr"),
               ("tokens_per_s", "train/tokens_per_s"), ("tflops", "train/tflops"), ("mfu", "train/mfu"),
               ("grad_norm", "train/grad_norm"))


EVAL_SET_TAG = "eval/loss/{}"
"""Tag of each named held-out set's loss (a row's ``eval_losses``; build.build_eval_sets)."""

BLOCK_NORM_TAG = "train/grad_norm/{}"
"""Tag of each block's gradient norm (a row's ``grad_norms``; --log-block-grad-norms)."""
CHOICE_TAG = "eval/choices/{}/{}"
"""Tag of each multiple-choice task's figure (a row's ``choices``: task name, then accuracy,
accuracy_norm or right_loglik; --eval-choices)."""
CHOICE_FIGURES = ("accuracy", "accuracy_norm", "right_loglik")


def row_scalars(row: Mapping) -> dict:
    """A metrics row's figures by tag: METRIC_TAGS' keys, each ``eval_losses`` entry under
    EVAL_SET_TAG and each ``choices`` task's figures under CHOICE_TAG; a value that is None
    (skipped, non-finite) or missing is left out."""
    values = {tag: float(row[key]) for key, tag in METRIC_TAGS if row.get(key) is not None}
    for name, loss in (row.get("eval_losses") or {}).items():
        if loss is not None:
            values[EVAL_SET_TAG.format(name)] = float(loss)
    for name, norm in (row.get("grad_norms") or {}).items():
        values[BLOCK_NORM_TAG.format(name)] = float(norm)
    for name, figures in (row.get("choices") or {}).items():
        for figure in CHOICE_FIGURES:
            if figures.get(figure) is not None:
                values[CHOICE_TAG.format(name, figure)] = float(figures[figure])
    return values


class TensorboardUnavailableError(ValueError):
    """TensorBoard logging was asked for but the tensorboard package cannot be imported."""


class TensorboardLogError(ValueError):
    """A metrics row, stage or step the logger cannot place on a TensorBoard axis."""


class StageTraceError(ValueError):
    """A trace window that has no duration, so no time shares exist for it."""


def _non_negative_int(value, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise TensorboardLogError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def require_tensorboard() -> None:
    """Raise TensorboardUnavailableError (naming the install command) unless TensorBoard logging
    can work here; the CLI calls it before any rank starts."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise TensorboardUnavailableError(
            f"--tensorboard needs the tensorboard package, which cannot be imported ({exc}); install "
            f"it with {INSTALL_HINT}") from None


class TensorboardLogger:
    """Scalars of one run in a TensorBoard log directory (a ``torch.utils.tensorboard.SummaryWriter``).

    ``purge_step``: for a resumed run, the first step it will log again; TensorBoard then hides the
    events at or after it that an earlier writer left in the same directory (the steps the resumed
    run recomputes), so the curves do not fold back. Use as a context manager or call ``close()``.
    Raises ``TensorboardUnavailableError`` naming the install command when tensorboard is missing.
    """

    def __init__(self, log_dir: Union[str, PathLike], purge_step: Optional[int] = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TensorboardUnavailableError(
                f"TensorBoard logging needs the tensorboard package, which cannot be imported "
                f"({exc}); install it with {INSTALL_HINT}") from None
        if purge_step is not None:
            purge_step = _non_negative_int(purge_step, "purge_step")
        self.log_dir = str(log_dir)
        """Directory the event files go to."""
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)
        """The underlying SummaryWriter (for scalars this class does not name)."""

    def log_metrics(self, row: Mapping) -> None:
        """Log one metrics.jsonl row ({"step", "loss", "lr", "tokens", "elapsed_s", optional
        "eval_loss", "eval_losses", "tokens_per_s", "tflops", "mfu", "grad_norm"}) at its ``step``
        (``row_scalars``); keys whose value is None (a skipped or non-finite loss) or that the row
        lacks are not logged."""
        if "step" not in row:
            raise TensorboardLogError(f"a metrics row needs a 'step', got keys {sorted(row)}")
        step = _non_negative_int(row["step"], "the row's 'step'")
        for tag, value in row_scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=step)

    def log_stage_shares(self, stage: int, step: int, shares: Mapping[str, float]) -> None:
        """Log ``stage_time_shares`` output as stage{stage}/compute_share and
        stage{stage}/wait_share at ``step``."""
        stage = _non_negative_int(stage, "stage")
        step = _non_negative_int(step, "step")
        for key in ("compute_share", "wait_share"):
            self.writer.add_scalar(f"stage{stage}/{key}", float(shares[key]), global_step=step)

    def flush(self) -> None:
        """Write pending events to disk now."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

    def __enter__(self) -> "TensorboardLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _op_name(op) -> str:
    # The bindings return op names as strings; a core Op enum value carries the same `.name`.
    return op if isinstance(op, str) else getattr(op, "name", str(op))


def stage_time_shares(trace: Iterable[tuple], start_ns: Optional[int] = None,
                      end_ns: Optional[int] = None) -> dict:
    """How one stage spent a window of wall time: ``{"compute_share", "wait_share"}``.

    ``trace`` is a ``Pipeline.trace``: ``(op, step, microbatch, version, start_ns, end_ns)`` per
    executed instruction, on the steady clock of the stage's machine (``time.monotonic_ns()`` on
    Linux). compute_share is the time inside forward, backward and optimizer_step instructions,
    clipped to the window, over the window's length; wait_share = 1 - compute_share is everything
    else: waiting for receives and sends, and time between instructions. The window defaults to the
    first instruction's start and the last one's end; instructions outside it count for nothing.
    Raises ``StageTraceError`` when the window is empty (no events and no bounds, or end <= start).
    """
    events = [(_op_name(e[0]), int(e[4]), int(e[5])) for e in trace]
    if start_ns is None:
        start_ns = min((s for _, s, _ in events), default=None)
    if end_ns is None:
        end_ns = max((e for _, _, e in events), default=None)
    if start_ns is None or end_ns is None or not end_ns > start_ns:
        raise StageTraceError(f"the trace window [{start_ns}, {end_ns}] ns has no duration; pass a "
                              "trace with executed instructions or explicit start_ns < end_ns")
    clipped = sorted((max(s, start_ns), min(e, end_ns)) for op, s, e in events
                     if op in COMPUTE_OPS and min(e, end_ns) > max(s, start_ns))
    # A stage runs its instructions one at a time, but overlapping intervals (traces of two calls
    # merged by hand, say) are merged so that no moment counts twice.
    compute_ns, cur_start, cur_end = 0, None, None
    for s, e in clipped:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                compute_ns += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        compute_ns += cur_end - cur_start
    compute_share = compute_ns / (end_ns - start_ns)
    assert 0.0 <= compute_share <= 1.0 and math.isfinite(compute_share)
    return {"compute_share": compute_share, "wait_share": 1.0 - compute_share}


__all__ = ["TensorboardLogger", "TensorboardUnavailableError", "TensorboardLogError", "StageTraceError",
           "stage_time_shares", "row_scalars", "EVAL_SET_TAG", "INSTALL_HINT", "COMPUTE_OPS"]
