"""The files of a run directory: metrics.jsonl, config.json, loss.png, and the directory itself.

Checkpoints (ckpt-NNNNNN/) are checkpoint.py's. Everything here writes atomically (temporary file
+ rename), so a reader or a resumed run never sees a half-written file; metrics.jsonl, which the
trainer appends to, is read up to its last complete line (see ``_metric_lines``).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Optional

from ..directories import make_directories, missing_directories, remove_directories
from .checkpoint import list_checkpoints

METRICS_NAME = "metrics.jsonl"
CONFIG_NAME = "config.json"
PLOT_NAME = "loss.png"
LOCK_NAME = ".lock"
"""Held (flock) by the process that made or resumed the run, while it runs: a second run with the
same --out is refused instead of writing its rows and checkpoints among the first's. Removed when
the run ends; the kernel releases the lock of a process that ends otherwise (a file left by a
killed run is taken over by the next)."""
_HELD: dict[str, int] = {}  # run directory -> the lock file this process holds open



class RunDirError(ValueError):
    """--out cannot hold this run (it holds another run, or is not writable)."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file + rename, so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _metric_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, row) for each complete line of metrics.jsonl. The file is only ever appended to, a
    segment's rows at a time, so a line without its newline is the tail of a write that a crash cut
    short: its segment has no checkpoint, so it is dropped here as a resume would drop it.
    RunDirError naming the line for a complete line that is not a JSON row with a step."""
    lines = path.read_text().split("\n")[:-1]  # the last piece ends without a newline: torn or empty
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            int(row["step"])
        except (ValueError, TypeError, KeyError):
            raise RunDirError(f"{path} line {number} is not a metrics row ({line[:60]!r}); the file is "
                              "damaged: repair or delete that line") from None
        rows.append((line, row))
    return rows


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of the run's metrics.jsonl (none when it does not exist)."""
    path = Path(run_dir) / METRICS_NAME
    if not path.exists():
        return []
    return [row for _, row in _metric_lines(path)]


def truncate_metrics(run_dir: str | os.PathLike, last_step: int) -> None:
    """Drop metrics rows after ``last_step`` (steps a resumed run will compute again), and a last
    line that a crash cut short."""
    path = Path(run_dir) / METRICS_NAME
    if not path.exists():
        return
    kept = [line for line, row in _metric_lines(path) if row["step"] <= last_step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def set_aside_later(run_dir: str | os.PathLike, step: int) -> Optional[Path]:
    """A run resumed from its checkpoint at ``step`` (``--rewind``): its later checkpoints and its
    metrics rows past ``step`` moved into ``rewound-<k>-to-step-<step>/`` inside it (the k-th rewind) (kept, not deleted: the
    abandoned branch stays readable, and no later checkpoint of it can be mistaken for the run's
    latest). Returns that directory, or None when nothing lies past ``step``."""
    run_dir = Path(run_dir)
    later = [path for s, path in list_checkpoints(run_dir) if s > step]
    metrics = run_dir / METRICS_NAME
    rows = [line for line, row in _metric_lines(metrics) if row["step"] > step] if metrics.exists() else []
    if not later and not rows:
        return None
    k = 1 + sum(1 for p in run_dir.glob("rewound-*"))
    while (run_dir / f"rewound-{k}-to-step-{step}").exists():
        k += 1
    attic = run_dir / f"rewound-{k}-to-step-{step}"
    attic.mkdir()
    if rows:
        write_text_atomic(attic / METRICS_NAME, "".join(line + "\n" for line in rows))
    for path in later:
        path.rename(attic / path.name)
    return attic


def plot_losses(run_dir: str | os.PathLike) -> Path:
    """loss.png: training loss per step and eval loss at eval steps, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    trained = [r for r in rows if r["loss"] is not None]
    ax.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="train", linewidth=1)
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(run_dir) / PLOT_NAME
    tmp = path.with_name(".loss.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def draw_losses_after_failure(run_dir: str | os.PathLike) -> None:
    """loss.png for a run that failed, from the rows it wrote (the losses that led there); not
    drawing it (no metrics.jsonl yet, say) is not reported: the run's own failure is the one to."""
    try:
        plot_losses(run_dir)
    except Exception:  # noqa: BLE001
        pass


def prepare_run_dir(out: str | os.PathLike, resuming: bool) -> Path:
    """Create (or check) the run directory; callers do this only after every other check passed,
    so a bad input leaves nothing behind."""
    out = Path(out)
    created = []  # the directories made here, deepest last: removed again if --out cannot be written
    try:
        # A run "is there" once it has a metrics row or a checkpoint: one that failed before its
        # first step (bad data found in its first window, say) leaves its --out free for the next.
        created = make_directories(missing_directories(out))
        _hold(out)  # first: a run in progress is named as such; also the write probe (a new file)
        if not resuming and holds_run(out):
            release_run_dir(out)
            raise RunDirError(taken_message(out))
    except OSError as exc:  # unwritable, or a name too long for the file system
        remove_directories(created)
        fix = "a shorter name" if exc.errno == errno.ENAMETOOLONG else "a writable directory"
        raise RunDirError(f"cannot write to --out {out} ({exc.strerror or exc}); choose {fix}") from None
    return out


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a run: a metrics row or a checkpoint (one that failed before its
    first step leaves it free for the next)."""
    metrics = out / METRICS_NAME
    return (metrics.exists() and metrics.stat().st_size > 0) or any(out.glob("ckpt-*"))


def taken_message(out: Path) -> str:
    """The refusal of a new run in ``out``, which holds one."""
    hint = f"continue it with --resume {out} or " if list_checkpoints(out) else ""  # what --resume finds
    return f"--out {out} already holds a run; {hint}choose another --out"


def _hold(out: Path) -> None:
    """Take the run directory's lock for this process, or RunDirError naming who holds it."""
    key = str(out.resolve())
    if key in _HELD:  # this process's own earlier run (train, then resume, from Python)
        return
    while True:
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"--out {out} is in use by another run ({holder}); wait for it to end, "
                              "or choose another --out") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):  # a file system without locks: go on
                os.close(fd)
                raise
        try:  # the file locked is still the one named: not one a finishing run removed meanwhile
            if os.fstat(fd).st_ino == os.stat(out / LOCK_NAME).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    _HELD[key] = fd


def release_run_dir(out: str | os.PathLike) -> None:
    """Let go of the run directory's lock (the run is over); nothing if this process holds none."""
    key = str(Path(out).resolve())
    fd = _HELD.pop(key, None)
    if fd is not None:
        with contextlib.suppress(OSError):  # removed before the lock goes: see _hold's inode check
            os.unlink(os.path.join(key, LOCK_NAME))
        os.close(fd)


def remove_unfinished_checkpoints(out: Path) -> None:
    """Remove the temporaries of checkpoints whose writing a killed run left (``.tmp-ckpt-*``,
    as large as a checkpoint) and the checkpoints it was removing (``.del-ckpt-*``,
    ``--keep-checkpoints``); a resume never reads them. Only with the run's lock held."""
    stale = sorted([*out.glob(".tmp-ckpt-*"), *out.glob(".del-ckpt-*")])
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    if stale:
        print(f"asyncpp-train: removed {len(stale)} unfinished checkpoint(s) ({stale[0].name}"
              f"{', ...' if len(stale) > 1 else ''}) that a stopped run left in {out}", file=sys.stderr)


__all__ = ["set_aside_later", "holds_run", "taken_message", "METRICS_NAME", "CONFIG_NAME", "PLOT_NAME", "LOCK_NAME", "RunDirError", "write_text_atomic",
           "read_metrics", "truncate_metrics", "plot_losses", "draw_losses_after_failure", "prepare_run_dir", "release_run_dir",
           "remove_unfinished_checkpoints"]
