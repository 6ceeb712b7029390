"""Weights & Biases logging of a run's metrics rows (``--wandb``; ``pip install 'asyncpp_ext[wandb]'``).

The process that writes metrics.jsonl (one process, or a pipeline's last stage of replica 0) logs
each row's figures under the TensorBoard tags (train/loss, eval/loss, train/lr, train/grad_norm,
...) at the row's step, into a W&B run named after the run directory, in project ``--wandb-project``,
with the run's config. The W&B run's id is kept in ``OUT/wandb_id``, so a resumed run continues
the same W&B run; steps a resumed run computes again (after its checkpoint, before the step the
W&B run reached) are not logged twice -- a resumed run repeats them exactly, so the figures there
are the same. The step reached is the W&B run's own where it says (online), and ``OUT/wandb_step``
(the next step not yet logged, written after each batch of rows) where it does not: an offline
run starts again at step 0. W&B's own settings apply as usual: ``WANDB_MODE=offline`` logs under
``OUT/wandb`` for a later ``wandb sync``, ``WANDB_ENTITY`` names the team, ``WANDB_MODE=disabled``
turns it off.
"""
from __future__ import annotations

import netrc
import os
import uuid
from pathlib import Path
from typing import Mapping
from urllib.parse import urlparse

from .run_files import write_text_atomic
from .tensorboard_log import row_scalars

INSTALL_HINT = "pip install 'asyncpp_ext[wandb]'"
ID_NAME = "wandb_id"
STEP_NAME = "wandb_step"
OFFLINE_MODES = ("offline", "dryrun", "disabled")


class WandbSetupError(ValueError):
    """--wandb cannot log here (no wandb package, no credentials for online logging); the message
    says what to do."""


def _has_credentials() -> bool:
    """WANDB_API_KEY, or a ~/.netrc entry for W&B's host (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def require_wandb() -> None:
    """WandbSetupError unless --wandb can log here; the CLI calls it before any rank starts."""
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        raise WandbSetupError(f"--wandb needs the wandb package, which cannot be imported ({exc}); install it "
                              f"with {INSTALL_HINT}") from None
    if os.environ.get("WANDB_MODE", "online").lower() not in OFFLINE_MODES and not _has_credentials():
        raise WandbSetupError("--wandb logs online, but no W&B credentials are set up here: run `wandb login` "
                              "(or set WANDB_API_KEY), or log locally with WANDB_MODE=offline")


def run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir`` (OUT/wandb_id), made on its first start."""
    path = run_dir / ID_NAME
    if path.is_file():
        return path.read_text().strip()
    made = uuid.uuid4().hex[:12]
    path.write_text(made + "\n")
    return made


def _recorded_step(path: Path) -> int:
    """OUT/wandb_step's step (0 where there is none, or it is not a number: nothing skipped)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


class WandbLogger:
    """The run's metrics rows into a W&B run (see the module's docstring)."""

    def __init__(self, run_dir: Path, project: str, config: Mapping):
        require_wandb()
        import wandb

        try:
            self.run = wandb.init(project=project, name=Path(run_dir).resolve().name, dir=str(run_dir),
                                  id=run_id(Path(run_dir)), resume="allow", config=dict(config))
        except Exception as exc:  # noqa: BLE001 -- wandb's own errors (network, settings): one line
            raise WandbSetupError(f"--wandb: W&B could not start the run ({' '.join(str(exc).split())[:200]}); "
                                  "log locally with WANDB_MODE=offline, or run without --wandb") from None
        self.step_file = Path(run_dir) / STEP_NAME
        # where a resumed W&B run is: its own step (0 offline), or the step this directory recorded
        self.first_step = max(int(getattr(self.run, "step", 0) or 0), _recorded_step(self.step_file))

    def log_metrics(self, row: Mapping) -> None:
        if row["step"] < self.first_step:  # logged by the attempt this run resumed
            return
        values = row_scalars(row)
        if row.get("tokens") is not None:
            values["train/tokens"] = float(row["tokens"])
        self.run.log(values, step=row["step"])

    def log_rows(self, rows) -> None:
        """``log_metrics`` of each row, then the next step not yet logged recorded (OUT/wandb_step)."""
        for row in rows:
            self.log_metrics(row)
        if rows and rows[-1]["step"] + 1 > self.first_step:
            self.first_step = rows[-1]["step"] + 1
            write_text_atomic(self.step_file, f"{self.first_step}\n")

    def close(self) -> None:
        self.run.finish()


__all__ = ["WandbLogger", "WandbSetupError", "require_wandb", "run_id", "INSTALL_HINT"]
