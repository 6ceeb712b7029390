"""``train(cfg)``: a whole run from a validated config, in this process or over stage processes.

What ``asyncpp-train`` does after parsing, and what a Python script calls to do the same. Parts
come from build.py; multi-process runs go through distributed.py's launcher.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..models.attention import attention_preference
from ..models.compile_support import resolve_compile
from ..models.registry import describe
from ..optim._kernels import cpu_kernel_isa
from ..optim.newton_schulz import bf16_matmul_choice
from ..pipeline.launch import launcher
from .build import build_choice_sets, build_run_data, build_simulator, resume
from .stage_compute import stage_compute
from .checkpoint import CheckpointError, load_checkpoint, read_meta, restore_rng_state
from .config import ConfigError, RunConfig
from .run_files import (CONFIG_NAME, prepare_run_dir, set_aside_later, read_metrics, release_run_dir, remove_unfinished_checkpoints,
                        truncate_metrics, write_text_atomic)


class RunSetupError(ValueError):
    """The config is valid but this machine or environment cannot run it (a missing extra, a bad
    environment variable, no GPU, a transport this device cannot use); the message says what to do."""


def preflight(cfg: RunConfig) -> None:
    """Every check a run can fail before it writes anything or starts a process: the config
    (ConfigError), then what this machine offers (RunSetupError). Pins the "auto" values."""
    cfg.validate()
    cfg.optim.pin_auto_values(cfg.train.steps)  # a resumed run reads the numbers back (older checkpoints: None)
    if cfg.train.tensorboard:
        from .tensorboard_log import TensorboardUnavailableError, require_tensorboard
        try:
            require_tensorboard()
        except TensorboardUnavailableError as exc:
            raise RunSetupError(str(exc)) from None
    if cfg.train.wandb:
        from .wandb_log import WandbSetupError, require_wandb
        try:
            require_wandb()
        except WandbSetupError as exc:
            raise RunSetupError(str(exc)) from None
    try:  # the CPU-path variables fail here, not inside a rank after the run has started
        bf16_matmul_choice()
        cpu_kernel_isa()  # spawned ranks read $ASYNCPP_CPU_ISA afresh; this process too, if no kernel ran yet
    except ValueError as exc:
        raise RunSetupError(str(exc)) from None
    if cfg.runs_multi_process() and cfg.pipeline.schedule == "sync":
        raise RunSetupError(f"--schedule sync is the one-process reference rule; a run with --stages "
                            f"{cfg.pipeline.stages} --dp {cfg.pipeline.dp} needs a pipeline schedule: "
                            "gpipe or 1f1b (the same update rule), or 2bw; or add --simulate")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA GPU is visible; use --device cpu")
    if cfg.runs_multi_process():
        check_rank_devices(cfg)
    if cfg.train.cuda_graphs and not cfg.runs_multi_process() and _simulation_is_delayed(cfg):
        raise RunSetupError(f"--cuda-graphs cannot run the one-process simulation of {cfg.pipeline.schedule} "
                            "(its delayed weight versions move the parameters a graph reads); run "
                            "--stages >= 2 as a pipeline, --schedule sync, or drop --cuda-graphs")
    try:
        stage_compute(cfg)  # --compile where torch cannot, a head-loss kernel without its extra
    except ValueError as exc:  # one line that starts with the flag it is about
        raise RunSetupError(str(exc)) from None


def _simulation_is_delayed(cfg: RunConfig) -> bool:
    """Whether the simulator runs any stage behind the newest weights (it then swaps versions in)."""
    from .simulate import stage_delay

    p = cfg.pipeline
    return any(stage_delay(p.schedule, s, p.stages, p.delay) for s in range(p.stages))


def check_rank_devices(cfg: RunConfig) -> None:
    """Before any rank starts: this machine's ranks can each get the device and transport asked for."""
    from ..pipeline.devices import (DeviceError, check_local_world, check_spawned_ranks, choose_transport,
                                    local_world_size, usable_cores)

    try:
        transport = choose_transport(cfg.pipeline.transport, cfg.train.device)
        started_by = launcher()
        if started_by == "spawn":  # under torchrun, --nproc-per-node says how many run here
            check_spawned_ranks(cfg.pipeline.stages * cfg.pipeline.dp, usable_cores())
        if cfg.train.device != "cuda":
            return
        local_world = local_world_size(started_by, cfg.pipeline.stages * cfg.pipeline.dp, os.environ)
        check_local_world(local_world, torch.cuda.device_count(), transport, started_by)
    except DeviceError as exc:
        raise RunSetupError(str(exc)) from None
    if transport == "nccl":
        from ..pipeline.nccl import NcclUnavailableError, require_nccl
        try:
            require_nccl(need_gpu=True)
        except NcclUnavailableError as exc:
            via = "" if cfg.pipeline.transport == "nccl" else " (auto picks nccl on cuda; --transport gloo avoids it)"
            raise RunSetupError(f"--transport nccl{via}: {exc}") from None
    if transport == "torch":
        import torch.distributed as dist
        if not dist.is_nccl_available():
            raise RunSetupError("--transport torch on cuda needs torch.distributed's NCCL backend, which this "
                             "torch build lacks; use --transport nccl or gloo")


def start_run_dir(cfg: RunConfig, resume_dir: Optional[Path], start_step: int) -> Path:
    """The run directory, made (or checked) only after every other check passed, with its
    config.json, and metrics rows past the checkpoint dropped on resume."""
    # --auto-resume found no checkpoint: rows an earlier attempt wrote before it died go
    again = resume_dir is None and cfg.train.auto_resume
    out = prepare_run_dir(cfg.train.out, resuming=resume_dir is not None or again)
    if again:
        truncate_metrics(out, 0)
        remove_unfinished_checkpoints(out)
    if resume_dir is not None:
        attic = set_aside_later(out, start_step)  # --rewind: the abandoned branch kept aside
        if attic is not None:
            print(f"asyncpp-train: the checkpoints and metrics rows after step {start_step} moved to {attic}",
                  file=sys.stderr)
        truncate_metrics(out, start_step)
        remove_unfinished_checkpoints(out)
        changed = changed_settings(read_meta(resume_dir)["config"], cfg.to_dict())
        print(f"asyncpp-train: resuming from {resume_dir.name} (step {start_step})"
              + (f"; changed: {', '.join(changed)}" if changed else ""), file=sys.stderr)
        if cfg.data.skip_batches:
            print(f"asyncpp-train: passing over the next {cfg.data.skip_batches} minibatches of the data "
                  "(--skip-batches)", file=sys.stderr)
    elif cfg.train.init_from is not None:
        print(f"asyncpp-train: starting from the weights of {cfg.train.init_from} (step "
              f"{read_meta(cfg.train.init_from)['step']}); optimizer, steps, data order and lr schedule anew",
              file=sys.stderr)
    write_text_atomic(out / CONFIG_NAME, json.dumps(cfg.to_dict(), indent=1) + "\n")
    if start_step < cfg.train.steps and _compiles(cfg):  # else the first step's wait is unexplained
        print("asyncpp-train: compiling the blocks (torch.compile) before the first step, a minute or more "
              "on a cold inductor cache; --no-compile runs eagerly", file=sys.stderr)
    return out


def _compiles(cfg: RunConfig) -> bool:
    """Whether the run's blocks are compiled (auto: on CUDA where torch can)."""
    if cfg.train.compile is False or (cfg.train.compile is None and torch.device(cfg.train.device).type != "cuda"):
        return False  # without asking torch (a C++ compiler probe) what it would not use
    return resolve_compile(cfg.train.compile, cfg.train.device)


PER_START = (("train", "out"), ("train", "resume"), ("data", "change_mix"), ("data", "skip_batches"))
"""Settings of one start, not of the run: a resume's line does not list them as changed."""


def changed_settings(saved: dict, now: dict, shown: int = 6) -> list[str]:
    """``section.field before->after`` for each setting a resumed run changes (the ones allowed to:
    the checks refused the others), the first ``shown`` of them and a count of the rest."""
    changed = [f"{section}.{name} {before!r}->{now[section].get(name)!r}"
               for section, fields in saved.items() if isinstance(fields, dict)
               for name, before in fields.items()
               if section in now and (section, name) not in PER_START
               and now[section].get(name, before) != before]
    return changed[:shown] + ([f"{len(changed) - shown} more"] if len(changed) > shown else [])


def train(cfg: RunConfig, resume_dir: Optional[Path] = None, started_at: Optional[float] = None) -> int:
    """Run ``cfg`` (validated) to the end: one process (the simulator, or a 1-stage 1-replica
    run), or one process per stage and replica (spawned here, or torchrun's). Returns 0.
    ``started_at``: when the command started (Unix time; default now), which --time-limit counts
    from: the start-up (the build, the ranks' start, a checkpoint's load) is part of a job's time."""
    from .stop_request import noting

    started_at = time.time() if started_at is None else started_at
    threads = torch.get_num_threads()
    try:
        # --stop-on-signal: from here on the signal is noted for the trainer (a launcher passes it
        # on to its ranks once they run) instead of ending the process where it is
        with noting(cfg.train.stop_signal):
            if cfg.runs_multi_process():
                return _train_pipeline(cfg, resume_dir, started_at)
            from .distributed import check_one_process_world
            check_one_process_world(cfg)
            if cfg.train.threads is not None:
                torch.set_num_threads(cfg.train.threads)
            return _train_single_process(cfg, resume_dir, started_at)
    finally:  # train() may be called as a library function: leave the caller's setting as it was
        torch.set_num_threads(threads)
        release_run_dir(cfg.train.out)  # held from start_run_dir on


def _train_single_process(cfg: RunConfig, resume_dir: Optional[Path], started_at: float) -> int:
    from .trainer import Trainer

    stream, eval_set, eval_sets = build_run_data(cfg)  # --dp R: one replica on the global microbatches
    choice_sets = build_choice_sets(cfg)
    compute = stage_compute(cfg)
    with attention_preference(compute.attention):  # from the compile on: it keys compiled blocks
        engine = build_simulator(cfg, compute, first_weights=resume_dir is None)
        resumed = resume(engine, stream, resume_dir, skip_batches=cfg.data.skip_batches)
        out = start_run_dir(cfg, resume_dir, resumed.start_step)
        show_plan(stream, cfg)
        if resumed.rng is not None:
            restore_rng_state(resumed.rng)
        Trainer(cfg, engine, stream, eval_set, out, start_step=resumed.start_step, elapsed_s=resumed.elapsed_s,
                device=cfg.train.device, started_at=started_at, eval_sets=eval_sets, choice_sets=choice_sets).run()
    print_summary(out, cfg, resumed.start_step)
    return 0


def _train_pipeline(cfg: RunConfig, resume_dir: Optional[Path], started_at: float) -> int:
    from ..pipeline import under_launcher
    from .distributed import launch

    # Every check that can fail on bad input happens before any process starts.
    stream, start_step = check_inputs(cfg, resume_dir)
    if not under_launcher() or os.environ.get("RANK") == "0":  # under torchrun, one line for the run
        show_plan(stream, cfg)
    launch(cfg, resume_dir, lambda: start_run_dir(cfg, resume_dir, start_step), started_at)
    if not under_launcher() or os.environ.get("RANK") == "0":
        print_summary(Path(cfg.train.out), cfg, start_step)
    return 0


def check_inputs(cfg: RunConfig, resume_dir: Optional[Path]):
    """(the training stream at the run's start, its start step): the data and evaluation sets
    built, and the checkpoint to resume or start from verified (its shards; the resumed data is
    the run's, which the ranks check again)."""
    stream = build_run_data(cfg)[0]
    build_choice_sets(cfg)  # the task files and the run's tokenizer
    if resume_dir is None:
        if cfg.train.init_from is not None:
            load_checkpoint(cfg.train.init_from, mmap=True)  # verifies its shard files (each rank reads them)
        return stream, 0
    meta = load_checkpoint(resume_dir)[0]  # verifies the checkpoint's shard files
    try:
        stream.load_state_dict(meta["data"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {resume_dir} does not fit this run ({exc})") from None
    return stream, int(meta["step"])


def show_plan(stream, cfg: RunConfig) -> None:
    """A mixture's line on stderr: each source's share, tokens and epochs over the run (one
    source's run prints none: its output stays what scripts read)."""
    if cfg.data.mix:
        print(f"asyncpp-train: {stream.plan(cfg.train.steps)}", file=sys.stderr)


def steady_tokens_per_s(rows: list) -> float | None:
    """Tokens per second of metrics rows (one call's, in order) after the first: its time holds the
    first compile and allocations. None for a single row or no time between them."""
    if len(rows) < 2 or rows[-1]["elapsed_s"] <= rows[0]["elapsed_s"] or "tokens" not in rows[-1]:
        return None
    return (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])


def steady_utilisation(rows: list, rate: float) -> str:
    """", 12.3 TFLOP/s, MFU 41.2%" at the steady tokens/s ``rate``, from a row's ratio of its
    figures to its tokens/s (each proportional to it); "" where the rows have none."""
    row = next((r for r in reversed(rows) if r.get("tflops") and r.get("tokens_per_s")), None)
    if row is None:
        return ""
    text = f", {rate * row['tflops'] / row['tokens_per_s']:.3g} TFLOP/s"
    return text + (f", MFU {100 * rate * row['mfu'] / row['tokens_per_s']:.1f}%" if row.get("mfu") else "")


def print_summary(out: Path, cfg: RunConfig, start_step: int) -> None:
    """One line: where the run ended, its last loss, its training time (the steps' own, as
    metrics.jsonl's elapsed_s: start-up and compilation before the first step are not in it), its
    tokens/s (over the steps after this call's first, whose time holds the first compile and
    allocations), and what it trained."""
    rows = [r for r in read_metrics(out) if r["step"] > start_step]
    if not rows:
        print(f"{out}: already at step {start_step} of {cfg.train.steps}; nothing to do")
        return
    last = rows[-1]
    shown = ""
    if "eval_loss" in last:  # written null when non-finite
        shown = " eval_loss non-finite" if last["eval_loss"] is None else f" eval_loss {last['eval_loss']:.4f}"
    skipped = sum(1 for r in rows if r.get("skipped"))
    shown += f" ({skipped} step{'s' if skipped != 1 else ''} skipped: non-finite values)" if skipped else ""
    loss = "skipped" if last["loss"] is None else f"{last['loss']:.4f}"
    rate = steady_tokens_per_s(rows)
    speed = f", {rate:,.0f} tokens/s{steady_utilisation(rows, rate)}" if rate else ""
    print(f"{out}: step {last['step']} loss {loss}{shown} "
          f"({last['elapsed_s']:.1f} s training{speed}, {describe(cfg.model)}, {cfg.pipeline.schedule}, {cfg.optim.name}, "
          f"{cfg.pipeline.stages} stage{'s' if cfg.pipeline.stages > 1 else ''}"
          f"{f' x {cfg.pipeline.dp} replicas' if cfg.pipeline.dp > 1 else ''})")


__all__ = ["RunSetupError", "preflight", "check_inputs", "show_plan", "check_rank_devices", "train", "start_run_dir", "print_summary",
           "steady_tokens_per_s", "steady_utilisation"]
