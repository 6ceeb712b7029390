"""``asyncpp-train``: train the GPT with a pipeline schedule, or simulate that schedule in one process.

With no arguments it trains the tiny GPT on the built-in corpus for a few seconds. Outputs in the
run directory (--out): metrics.jsonl (one JSON row per step), config.json, loss.png and checkpoints
ckpt-NNNNNN/ (every --ckpt-every steps and at the end; none with --no-checkpoints). ``--resume DIR`` continues DIR's run from its
latest checkpoint exactly as if it had never stopped.

Every bad input ends with one line ``asyncpp-train: error: ...`` on stderr and exit code 2.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from .arguments import PROG, UsageError, build_parser, config_from_args, name_flag
from .checkpoint import (CheckpointError, CheckpointWriteError, NonFiniteCheckpointError, check_resume_config,
                         checkpoint_named, latest_checkpoint, list_checkpoints, read_meta, saved_config)
from .config import ConfigError, RunConfig
from .resume_rules import init_from_mismatch
from .config_file import ConfigFileError, expand_config
from .wandb_log import WandbSetupError
from ..data import DataError
from ..oom import out_of_memory
from .model_source import ModelSourceError, model_from_args
from ..pipeline import LaunchError, under_launcher
from ..pipeline.nonfinite import NonFiniteError
from ..stop_signals import Stopped, stop_signals_raise
from .run import RunSetupError, preflight, train
from .run_files import RunDirError


def resolve(argv) -> tuple[RunConfig, Optional[Path], bool]:
    """The run's config (a resumed run's saved config with the flags given applied), the
    checkpoint to resume from, and whether this is a --dry-run; every check done (run.preflight)."""
    parser = build_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(expand_config(sys.argv[1:] if argv is None else list(argv), parser))
    if args.config is not None:  # an abbreviation of --config, which argparse accepts and expand_config not
        raise UsageError(f"write --config in full (given as an abbreviation, for {args.config})")
    resume_dir = None
    if args.resume is not None and args.init_from is not None:
        raise UsageError("--init-from starts a new run from another run's weights, --resume continues a run "
                         "with its own; pass one of them")
    if args.init_from is not None and args.hf_model is not None:
        raise UsageError("--init-from and --hf-model each give the model's first weights; pass one of them")
    if args.rewind is not None and (args.resume is None or args.auto_resume):
        raise UsageError("--rewind STEP resumes a run from an earlier checkpoint; pass it with --resume RUN "
                         "(not --auto-resume)")
    if args.skip_batches:
        if args.auto_resume:
            raise UsageError("--skip-batches with --auto-resume would skip again at every job of the chain; "
                             "resume once with --resume RUN --skip-batches N, then go on with the chain")
        if args.resume is None:
            raise UsageError("--skip-batches passes over data at a resume; pass --resume RUN")
    if args.auto_resume:
        auto_resume(args)
    if args.resume is not None:
        run_dir = Path(args.resume)
        if not args.resume:  # Path("") is the working directory
            raise UsageError("--resume is empty; pass the --out directory of an earlier run")
        if not run_dir.is_dir():
            raise UsageError(f"--resume {run_dir} is not a directory; pass the --out directory "
                             "of an earlier run")
        if args.out is not None and Path(args.out).resolve() != run_dir.resolve():
            raise UsageError(f"--out {args.out} differs from --resume {args.resume}; a resumed "
                             "run continues in its own directory, drop --out")
        resume_dir = latest_checkpoint(run_dir) if args.rewind is None else rewound_checkpoint(run_dir, args.rewind)
        meta = read_meta(resume_dir)  # shards are verified when they are loaded
        saved = saved_config(resume_dir, meta)
        cfg = config_from_args(args, base=saved)
        cfg.train.out = str(run_dir)
        check_resume_config(resume_dir, meta["config"], cfg)
        if cfg.train.steps < meta["step"]:
            raise UsageError(f"--steps {cfg.train.steps} is before the checkpoint's step "
                             f"{meta['step']} in {resume_dir}; pass --steps >= {meta['step']}")
    else:
        cfg = config_from_args(args)
        if args.init_from is not None:
            start_from(cfg, args)
        if args.out is None and under_launcher():
            raise UsageError("under torchrun pass --out DIR: every rank must write to the same run "
                             "directory")
        if args.out is None:
            cfg.train.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if args.tokens is not None:
        p = cfg.pipeline
        per_step = p.microbatches * p.global_micro_batch_size * cfg.model.seq_len
        print(f"asyncpp-train: --tokens {args.tokens:,}: {cfg.train.steps:,} steps of {per_step:,} tokens "
              f"({cfg.train.steps * per_step:,} tokens)", file=sys.stderr)
    preflight(cfg)
    return cfg, resume_dir, args.dry_run


def rewound_checkpoint(run_dir: Path, step: int) -> Path:
    """``--rewind STEP``: the run's checkpoint at STEP, or UsageError naming the steps it has."""
    found = dict(list_checkpoints(run_dir))
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        raise UsageError(f"--rewind {step}: {run_dir} has no checkpoint at step {step} (its checkpoints: {have})")
    return found[step]


def auto_resume(args) -> None:
    """``--auto-resume``: ``args`` turned into a resume of --out when it holds a checkpoint (its
    --init-from dropped: the run's own checkpoint has its weights), else left a start."""
    if args.resume is not None:
        raise UsageError("--auto-resume continues the run in --out itself; drop --resume")
    if not args.out:
        raise UsageError("--auto-resume needs --out DIR: the run directory every job of the chain continues")
    if Path(args.out).is_dir() and list_checkpoints(args.out):
        args.resume, args.out, args.init_from = args.out, None, None


def start_from(cfg: RunConfig, args) -> None:
    """``--init-from``: the checkpoint it names stored in ``cfg``, and the model the checkpoint's
    (with the model flags given applied), refused where a weight's shape would differ."""
    ckpt = checkpoint_named(args.init_from, "--init-from")
    saved = saved_config(ckpt, read_meta(ckpt)).model  # its shards are verified when they are loaded
    cfg.model = model_from_args(args, replace(saved, hf_model=None))  # its weights come from ckpt
    why = init_from_mismatch(saved, cfg.model)
    if why is not None:
        raise UsageError(f"--init-from {ckpt}: {why}; leave the model flags out (the checkpoint's model is "
                         "taken) or start from a checkpoint of this model")
    cfg.train.init_from = str(ckpt.resolve())


def main(argv=None) -> int:
    started_at = time.time()  # --time-limit counts from here
    cfg = None
    try:
        with stop_signals_raise():  # SIGTERM / SIGHUP end the run as Ctrl-C does
            cfg, resume_dir, dry = resolve(argv)
            if dry:
                from .dry_run import dry_run
                return dry_run(cfg, resume_dir)
            return train(cfg, resume_dir, started_at)
    except (NonFiniteError, NonFiniteCheckpointError) as exc:  # a run failure, not a bad input
        sys.stderr.write(f"{PROG}: error: {' '.join(str(exc).split())}\n")
        return 1
    except KeyboardInterrupt as exc:
        resumable = cfg is not None and list_checkpoints(cfg.train.out)  # what --resume would find
        where = f"; continue with --resume {cfg.train.out}" if resumable else ""
        if isinstance(exc, Stopped):
            # a batch system's warning signal: the flag that would have stopped with a checkpoint
            armed = cfg is not None and cfg.train.stop_signal == exc.name
            hint = (f" (--stop-on-signal {exc.name[3:]} stops at a checkpoint instead)"
                    if exc.name in ("SIGUSR1", "SIGUSR2") and not armed else "")
            sys.stderr.write(f"\n{PROG}: stopped by {exc.name}{hint}{where}\n")
            return 128 + exc.signum
        sys.stderr.write(f"\n{PROG}: interrupted{where}\n")
        return 130
    except (UsageError, RunSetupError, RunDirError, ConfigError, DataError, CheckpointError,
            ModelSourceError, ConfigFileError, WandbSetupError) as exc:
        message = " ".join(str(exc).split())  # exactly one line
        if isinstance(exc, ConfigError):
            message = name_flag(message)
        sys.stderr.write(f"{PROG}: error: {message}\n")
        return 2
    except CheckpointWriteError as exc:  # the message names the shard and the space left
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 1
    except OSError as exc:  # a full disk, most often: the run failed, the input was fine
        where = f" ({exc.filename})" if exc.filename else ""
        sys.stderr.write(f"{PROG}: error: {exc.strerror or exc}{where}; free disk space or choose another "
                         "--out\n")
        return 1
    except LaunchError as exc:  # each rank has already printed its own line
        sys.stderr.write(f"{PROG}: error: the pipeline run failed: {exc}\n")
        return 1
    except (MemoryError, RuntimeError) as exc:
        text = out_of_memory(exc)
        if text is None:
            raise
        sys.stderr.write(f"{PROG}: error: out of memory ({text}); use a smaller model (--n-embd, "
                         "--n-layer, --vocab-size), --micro-batch-size or --seq-len\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
